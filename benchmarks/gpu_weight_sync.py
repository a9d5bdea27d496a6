#!/usr/bin/env python
"""GPU measurement of the weight sync's device-side packing: one 1 GiB bucket of Qwen3-30B-shaped expert tensors
written into a flat bucket on the device, each GLU fc1 split into HF's gate and up (the copy SGLang's receivers wait
for). One JSON line. What must hold on a GPU (the NCCL update group and its abort, an NCCL push between two processes,
a device push into an embedded engine) is asserted by the GPU tier, tests/gpu/test_gpu.py.

    python benchmarks/gpu_weight_sync.py
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch


def _emit(**record: Any) -> None:
    print(json.dumps(record), flush=True)


def check_pack_rate() -> None:
    experts = [torch.randn(2 * 768, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(170)]  # ~1 GiB
    out = torch.empty(sum(t.nbytes for t in experts), dtype=torch.uint8, device="cuda")
    for _ in range(3):
        offset = 0
        for t in experts:
            gate, up = torch.chunk(t, 2, dim=0)  # the HF split of a GLU fc1, written straight into the bucket
            for half in (gate, up):
                out[offset : offset + half.nbytes].view(torch.bfloat16).view(half.shape).copy_(half)
                offset += half.nbytes
    torch.cuda.synchronize()
    t0 = time.monotonic()
    reps = 10
    for _ in range(reps):
        offset = 0
        for t in experts:
            for half in torch.chunk(t, 2, dim=0):
                out[offset : offset + half.nbytes].view(torch.bfloat16).view(half.shape).copy_(half)
                offset += half.nbytes
    torch.cuda.synchronize()
    seconds = (time.monotonic() - t0) / reps
    _emit(check="pack_rate", gib=round(out.nbytes / 2**30, 3), seconds=round(seconds, 5),
          gb_per_s=round(out.nbytes / seconds / 1e9, 1))  # fmt: skip


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this measures the device-side packing")
    check_pack_rate()


if __name__ == "__main__":
    main()

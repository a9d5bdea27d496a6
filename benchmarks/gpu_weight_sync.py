#!/usr/bin/env python
"""GPU check of the weight sync (prepared for sessions lent one GPU; the CPU tiers test the same code on gloo).

On one GPU an NCCL update group with an engine cannot be formed (NCCL refuses two ranks on one device), so this
checks what one GPU can show, printing one JSON line per check:
  1. nccl_group: an update group built like SGLang's (distributed/update_group.py) on the NCCL backend, a
     broadcast on it, and abort_update_group() (torch's _abort_process_group) returning without killing the process;
  2. device_push: a bf16 learner on cuda:0 pushes to an embedded CPU engine over gloo: the stage gathers and the
     packing run on the device, the send buffer is pinned host memory; the engine's checksums must equal what was
     sent (weight_sync.verify=checksum) and the pack rate (GB/s of HF bytes written on the device) is reported;
  3. pack_rate: packing one 1 GiB bucket of expert tensors on the device (the copy SGLang's receivers wait for).

    python benchmarks/gpu_weight_sync.py [--hidden 1024 --layers 4 --experts 16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]


def _emit(**record: Any) -> None:
    print(json.dumps(record), flush=True)


def check_nccl_group() -> None:
    import torch.distributed as dist

    from megatron_sao.distributed.spawn import find_free_port
    from megatron_sao.distributed.update_group import abort_update_group, host_store, init_update_group

    store, port = host_store("127.0.0.1", find_free_port(), 1, 60.0)
    t0 = time.monotonic()
    group = init_update_group("nccl", "127.0.0.1", port, 1, 0, "gpu_check", 60.0, store=store)
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    dist.broadcast(x, src=0, group=group)
    torch.cuda.synchronize()
    abort_update_group(group)
    _emit(check="nccl_group", ok=bool(x[-1].item() == (1 << 20) - 1), seconds=round(time.monotonic() - t0, 3))


def check_device_push(args: argparse.Namespace) -> None:
    from megatron_sao.config import load_config
    from megatron_sao.distributed import init_distributed
    from megatron_sao.distributed.spawn import find_free_port
    from megatron_sao.engines.client import SGLangClient
    from megatron_sao.learner.learner import Learner
    from megatron_sao.models.tiny import make_tiny_model
    from megatron_sao.weight_sync import WeightSync, hf_dtype_of

    work = Path(tempfile.mkdtemp(prefix="gpu-sync-"))
    hf_dir = str(make_tiny_model("qwen3_moe", work / "model", layers=args.layers, hidden=args.hidden,
                                 experts=args.experts, vocab_size=8192, dtype="bf16"))  # fmt: skip
    port = find_free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    log = open(work / "engine.log", "wb")  # noqa: SIM115 - lives as long as the engine
    engine = subprocess.Popen([sys.executable, "-m", "megatron_sao", "engine", "--model", hf_dir, "--port", str(port)],
                              stdout=log, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        client = SGLangClient(url)
        deadline = time.monotonic() + 300
        while not client.health(timeout_s=1.0):
            assert engine.poll() is None and time.monotonic() < deadline, (work / "engine.log").read_text()[-2000:]
            time.sleep(0.5)
        cfg = load_config(None, ["--model.hf_path", hf_dir, "--model.dtype", "bf16", "--weight_sync.backend", "gloo",
                                 "--weight_sync.verify", "checksum", "--weight_sync.bucket_mb", "64",
                                 "--weight_sync.master_port", str(find_free_port())])  # fmt: skip
        init_distributed(cfg.parallel)
        learner = Learner(cfg, roles={"policy"})
        learner.load_hf(hf_dir)
        sync = WeightSync(learner.policy.model, learner.spec, hf_dtype_of(learner.hf_source, torch.bfloat16),
                          cfg.weight_sync, [url])  # fmt: skip
        with torch.no_grad():
            for p in learner.policy.model.parameters():
                p.add_(0.01)
        metrics = sync.push(1)
        _emit(check="device_push", ok=metrics.get("sync/failed") == 0 and client.weight_version() == 1,
              device=str(sync.gather.device), send_device=str(sync.gather.send_device), **metrics)  # fmt: skip
        sync.close()
    finally:
        engine.kill()
        engine.wait()


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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=16)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: the CPU tiers (tests/weight_sync) cover this code on gloo")
    for check in (check_nccl_group, lambda: check_device_push(args), check_pack_rate):
        try:
            check()
        except Exception as e:  # one failing check must not hide the others' results
            _emit(check=getattr(check, "__name__", "device_push"), ok=False, error=repr(e)[:2000])


if __name__ == "__main__":
    main()

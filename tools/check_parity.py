#!/usr/bin/env python
"""Logit parity of the megatron model converted from an HF checkpoint against transformers (fp32).

Converts --hf on the fly (or loads --ckpt), spawns its own local ranks when a parallel size is above 1 (gloo on
CPU, NCCL on GPU), runs one token batch through both models, prints the largest absolute logit difference and
exits 1 when it is above --tol.

python tools/check_parity.py --hf DIR [--ckpt DIR] [--tp N --ep N --pp N --etp N] [--tol 1e-4]
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf", required=True, help="HF model directory (the reference)")
    p.add_argument("--ckpt", default=None, help="converted megatron checkpoint (default: convert --hf now)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: --tp)")
    p.add_argument("--tol", type=float, default=1e-4, help="largest allowed |logit difference|")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence (a multiple of --tp)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random token batch")
    a = p.parse_args(argv)
    from megatron_sao.config.parallel import ParallelConfig
    from megatron_sao.convert.parity import check_parity

    try:
        parallel = ParallelConfig(tensor=a.tp, expert=a.ep, pipeline=a.pp, expert_tensor=a.etp)
        r = check_parity(a.hf, parallel, ckpt_dir=a.ckpt, tol=a.tol, batch=a.batch, seq=a.seq, seed=a.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    verdict = "OK" if r.ok else "FAIL"
    print(
        f"{verdict}: max |logit diff| = {r.max_abs_diff:.3e} (max |logit| {r.max_abs_logit:.3f}, tol {r.tol:g}) "
        f"at TP={a.tp} EP={a.ep} PP={a.pp} on {r.world_size} rank(s)"
    )
    return 0 if r.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

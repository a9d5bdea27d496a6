#!/usr/bin/env python
"""How much of a push changes from one policy step to the next (issue 48, "measure first"): the fraction of
engine-dtype elements that differ between consecutive steps, by tensor class, for a bf16 engine and a block-FP8
engine (weights quantized as models/fp8.py writes them, 128x128 blocks: its e4m3 bytes and its block scales, each a
changed element when it differs).

A tiny random MoE (qwen3_moe; weights of the usual init scale) is trained `--steps` SAO policy steps (K critic updates
each, fp32 master weights, Adam) on synthetic on-policy batches (the rollout log-probs are the initial model's, so DIS
keeps them); after every step its policy weights are cast to bf16 and block-quantized to FP8, and compared with the
previous step's. Per learning rate (the examples' and the paper's 1e-6), per class (attention, experts, router,
norms, embeddings, output layer), the median over steps of the changed fraction is printed, with the share of the
model's elements in that class and the whole model's fraction (element-weighted).

    python benchmarks/delta_density.py [--steps 24 --lrs 3e-3,5e-4,1e-6 --hidden 256 --layers 4 --json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CLASSES = ("attention", "experts", "router", "norms", "embeddings", "output_layer")


def tensor_class(name: str) -> str:
    """The class of a megatron parameter name (models/mapping.py's names)."""
    if "embedding" in name:
        return "embeddings"
    if "output_layer" in name:
        return "output_layer"
    if "router" in name:
        return "router"
    if "norm" in name:
        return "norms"
    if "experts" in name:
        return "experts"
    return "attention" if ("self_attention" in name or "linear_q" in name or "linear_kv" in name) else "norms"


def fp8_bytes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 engine's view of a 2-D weight: its e4m3 bytes and its per-block scales (models/fp8.py)."""
    from megatron_sao.models.fp8 import quantize

    q, scale = quantize(weight.float(), (128, 128))
    return q.view(torch.uint8), scale


def changed(prev: dict[str, Any], now: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """{name: (elements changed, elements)} between two snapshots of engine-dtype tensors."""
    out = {}
    for name, t in now.items():
        if isinstance(t, tuple):  # fp8: what the engine holds is the bytes and the block scales, both counted
            q, s = t
            pq, ps = prev[name]
            out[name] = (int((q != pq).sum()) + int((s != ps).sum()), q.numel() + s.numel())
        else:
            out[name] = (int((t != prev[name]).sum()), t.numel())
    return out


def _rank(hf_dir: str, lr: float, steps: int, trajectories: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from megatron_sao.config import load_config
    from megatron_sao.distributed import destroy_distributed, init_distributed
    from megatron_sao.learner.learner import Learner
    from megatron_sao.learner.synthetic import make_batch

    torch.set_num_threads(1)
    cfg = load_config(None, [
        "--model.hf_path", hf_dir, "--model.dtype", "fp32", "--launch.nproc_per_node", "1",
        "--learner.max_tokens_per_microbatch", "256", "--learner.policy.lr", str(lr),
        "--learner.policy.warmup_steps", "0", "--learner.value.lr", str(5 * lr),
    ])  # fmt: skip
    ctx = init_distributed(cfg.parallel, seed=0)
    learner = Learner(cfg, layout=ctx)
    learner.load_hf(hf_dir)
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    vocab = int(reference.config.vocab_size)

    def snapshot() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        bf16, fp8 = {}, {}
        for name, p in learner.policy.model.named_parameters():
            w = p.detach()
            bf16[name] = w.to(torch.bfloat16).view(torch.int16).clone()
            fp8[name] = fp8_bytes(w) if w.dim() == 2 and "norm" not in name and "embedding" not in name \
                else w.to(torch.bfloat16).view(torch.int16).clone()  # fmt: skip
        return bf16, fp8

    prev = snapshot()
    per_step: list[dict[str, dict[str, tuple[int, int]]]] = []
    for step in range(steps):
        batch = make_batch(trajectories, seed=step, vocab=vocab)
        with torch.no_grad():  # on-policy log-probs (the initial model's): DIS keeps the tokens
            for t in batch:
                toks = torch.from_numpy(t.tokens.astype("int64")).view(1, -1)
                logp = torch.log_softmax(reference(toks).logits[0, :-1], -1).gather(1, toks[0, 1:].view(-1, 1))
                t.rollout_logprobs[1:] = (logp.view(-1).numpy() * t.action_mask[1:]).astype("float32")
        learner.train_step(batch)
        now = snapshot()
        per_step.append({"bf16": changed(prev[0], now[0]), "fp8": changed(prev[1], now[1])})
        prev = now
    destroy_distributed()
    return {"per_step": per_step}


def summarize(per_step: list[dict[str, dict[str, tuple[int, int]]]]) -> dict[str, dict[str, float]]:
    """{dtype: {class: median fraction changed per step, "model": element-weighted, "<class>_share": share}}"""
    out: dict[str, dict[str, float]] = {}
    for dtype in ("bf16", "fp8"):
        rows: dict[str, list[float]] = {c: [] for c in (*CLASSES, "model")}
        sizes: dict[str, int] = dict.fromkeys(CLASSES, 0)
        for step in per_step:
            by_class = {c: [0, 0] for c in CLASSES}
            for name, (n, total) in step[dtype].items():
                by_class[tensor_class(name)][0] += n
                by_class[tensor_class(name)][1] += total
            for c, (n, total) in by_class.items():
                if total:
                    rows[c].append(n / total)
                sizes[c] = total
            rows["model"].append(sum(n for n, _ in by_class.values()) / sum(t for _, t in by_class.values()))
        whole = sum(sizes.values())
        out[dtype] = {c: statistics.median(v) for c, v in rows.items() if v}
        out[dtype].update({f"{c}_share": sizes[c] / whole for c in CLASSES if sizes[c]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--lrs", default="3e-3,5e-4,1e-6", help="policy learning rates (tiny_cpu, tiny_agentic, paper)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--trajectories", type=int, default=8)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from megatron_sao.distributed import spawn_ranks
    from megatron_sao.models.tiny import make_tiny_model

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(tempfile.mkdtemp(prefix="bench-delta-"))
    hf_dir = str(make_tiny_model("qwen3_moe", work / "model", layers=args.layers, hidden=args.hidden,
                                 experts=args.experts, vocab_size=args.vocab, tokenizer=False))  # fmt: skip
    results: dict[str, Any] = {"steps": args.steps, "layers": args.layers, "hidden": args.hidden}
    for lr in (float(x) for x in args.lrs.split(",")):
        (out,) = spawn_ranks(_rank, 1, hf_dir, lr, args.steps, args.trajectories, timeout_s=3600)
        summary = summarize(out["per_step"])
        results[f"lr={lr:g}"] = summary
        print(f"policy lr {lr:g}, {args.steps} steps: median fraction of engine-dtype elements changed per step")
        print(f"  {'class':14s} {'share':>7s} {'bf16':>9s} {'fp8':>9s}")
        for c in (*CLASSES, "model"):
            share = summary["bf16"].get(f"{c}_share", 1.0 if c == "model" else 0.0)
            if c in summary["bf16"]:
                print(f"  {c:14s} {share:7.3f} {summary['bf16'][c]:9.5f} {summary['fp8'][c]:9.5f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

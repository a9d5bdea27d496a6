#!/usr/bin/env python
"""Tokens/s of a full SAO learner step vs a plain megatron forward+backward over the same packed tokens.

The SAO step runs one value forward, K value forward+backward passes and one policy forward+backward (plus the
optimizer steps); the baseline is one policy forward+backward with a plain token log-likelihood loss through
the same megatron schedule, micro-batches and packing. Both are measured side by side in one process.

    python benchmarks/learner_step.py [--family qwen3_moe --layers 4 --hidden 256 --trajectories 16 --repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="qwen3_moe")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--trajectories", type=int, default=16)
    p.add_argument("--turn-tokens", type=int, default=96, help="generated tokens per turn (2 turns + observation)")
    p.add_argument("--microbatch-tokens", type=int, default=1024)
    p.add_argument("--k", type=int, default=2, help="value updates per policy step")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from megatron_sao.config import load_config
    from megatron_sao.distributed import init_distributed
    from megatron_sao.learner.batch import make_step_batch
    from megatron_sao.learner.forward import run_microbatches, token_logprobs
    from megatron_sao.learner.learner import Learner
    from megatron_sao.learner.synthetic import make_trajectory
    from megatron_sao.models.tiny import make_tiny_model

    hf_dir = make_tiny_model(
        args.family, tempfile.mkdtemp(prefix="bench-"), layers=args.layers, hidden=args.hidden, experts=args.experts
    )
    cfg = load_config(
        None,
        ["--model.hf_path", str(hf_dir), "--model.dtype", "fp32",
         "--learner.max_tokens_per_microbatch", str(args.microbatch_tokens),
         "--algo.value.updates_per_policy_step", str(args.k)],
    )  # fmt: skip
    init_distributed(cfg.parallel)
    learner = Learner(cfg)
    learner.load_hf(str(hf_dir))
    rng = np.random.default_rng(0)
    trajectories = [
        make_trajectory(rng, i, prompt_len=32, turns=(args.turn_tokens, args.turn_tokens), observation=24)
        for i in range(args.trajectories)
    ]
    batch = make_step_batch(trajectories, cfg.model.max_seq_len)
    mbs = learner._microbatches(batch)
    tokens = sum(int(t.numel()) for t in batch.tokens)
    vocab = learner.spec.vocab_size

    def plain_forward_backward() -> None:
        def loss_fn(mb, output):
            logp = token_logprobs(output.reshape(mb.seq_len, -1), mb.targets(), 1.0, vocab)
            mask = mb.pack(batch.action_mask)
            return -(logp * mask).sum(), mask.sum().to(torch.int), {}

        learner.policy.zero_grad()
        run_microbatches(learner.policy.ddp, mbs, loss_fn, forward_only=False)

    def sao_step() -> None:
        learner.train_step(trajectories)

    timings: dict[str, list[float]] = {"plain": [], "sao": []}
    plain_forward_backward()  # warm-up both paths
    sao_step()
    for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
        for name, fn in (("plain", plain_forward_backward), ("sao", sao_step)):
            t0 = time.perf_counter()
            fn()
            timings[name].append(time.perf_counter() - t0)
    plain, sao = statistics.median(timings["plain"]), statistics.median(timings["sao"])
    backward_passes = 1 + args.k
    print(f"model: {args.family} tiny, {args.layers} layers, hidden {args.hidden}, {args.experts} experts, fp32, "
          f"{torch.get_num_threads()} threads; step: {len(trajectories)} trajectories, {tokens} tokens, "
          f"{len(mbs)} micro-batches")  # fmt: skip
    print(f"plain megatron forward+backward: {plain * 1e3:.1f} ms, {tokens / plain:,.0f} tokens/s")
    print(f"full SAO step (1 value fwd + {args.k} value fwd/bwd + 1 policy fwd/bwd + optimizer steps): "
          f"{sao * 1e3:.1f} ms, {tokens / sao:,.0f} tokens/s")  # fmt: skip
    print(f"ratio SAO/plain time: {sao / plain:.2f}x; per backward pass ({backward_passes}): "
          f"{sao / (backward_passes * plain):.2f}x (1.00 = no overhead beyond the extra passes)")  # fmt: skip


if __name__ == "__main__":
    main()

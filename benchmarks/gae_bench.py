"""Is compute_gae a bottleneck? Time it on [64, 32768] next to a tiny-model forward over the same tokens.

    PYTHONPATH=. python benchmarks/gae_bench.py [--batch 64] [--seq 32768] [--forward-microbatches 8]

What it measures, in one process with the same torch thread count:
1. `compute_gae` (policy pass, length-adaptive lambda) and `compute_step_targets` (what the learner calls:
   policy pass + critic pass) on float32 [batch, seq] rows that look like agent trajectories: a prompt,
   turns of 50-1500 generated tokens separated by observations of 10-500 tokens, then padding (each row
   fills 40-100% of seq). Best of --gae-iters runs after one warm-up.
2. One forward pass (torch.no_grad, fp32, logits out) of the tiny megatron-core MoE from megatron_sao/smoke.py
   (2 layers, hidden 64, 4 experts top-2, vocab 256) on micro-batches of [--micro-batch, --micro-seq];
   --forward-microbatches of them are timed after one warm-up, and the mean is scaled to batch * seq tokens.
It prints the timings and their ratio; it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from megatron_sao.algo import compute_gae, compute_step_targets, length_adaptive_lambda, token_rewards
from megatron_sao.config import AlgoConfig, ParallelConfig


def agent_like_mask(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    """bool [batch, seq]: prompt, alternating generated turns and observations, padding after the end."""
    g = torch.Generator().manual_seed(seed)

    def rand(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=g))

    mask = torch.zeros(batch, seq, dtype=torch.bool)
    for b in range(batch):  # a loop over turns while building the input, not in the timed code
        end = rand(int(0.4 * seq), seq + 1)
        pos = rand(200, 2000)
        while pos < end:
            turn = rand(50, 1500)
            mask[b, pos : min(pos + turn, end)] = True
            pos += turn + rand(10, 500)
    return mask


def best_ms(fn: Callable[[], object], iters: int) -> float:
    """Best wall time of `iters` CPU calls of fn after one warm-up, in ms."""
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def forward_ms_per_microbatch(micro_batch: int, micro_seq: int, count: int) -> tuple[float, float, str]:
    """(mean ms, stdev ms) of `count` timed tiny-model forwards on [micro_batch, micro_seq], and the device."""
    from megatron_sao.distributed import destroy_distributed, init_distributed
    from megatron_sao.smoke import VOCAB, build_tiny_gpt, tiny_transformer_config

    ctx = init_distributed(ParallelConfig())
    try:
        model = build_tiny_gpt(tiny_transformer_config(ParallelConfig())).to(ctx.device).eval()
        tokens = torch.randint(0, VOCAB, (micro_batch, micro_seq), device=ctx.device)
        position_ids = torch.arange(micro_seq, device=ctx.device).expand(micro_batch, -1)
        causal = torch.triu(torch.ones(micro_seq, micro_seq, dtype=torch.bool, device=ctx.device), diagonal=1)
        attention_mask = causal.view(1, 1, micro_seq, micro_seq)
        sync = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)
        times = []
        with torch.no_grad():
            for i in range(count + 1):
                t0 = time.perf_counter()
                logits = model(tokens, position_ids, attention_mask)
                sync()
                if i:  # the first call is a warm-up
                    times.append(1e3 * (time.perf_counter() - t0))
        assert logits.shape == (micro_batch, micro_seq, VOCAB)
        spread = statistics.stdev(times) if len(times) > 1 else 0.0
        return statistics.mean(times), spread, str(ctx.device)
    finally:
        destroy_distributed()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--gae-iters", type=int, default=5)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--micro-seq", type=int, default=1024)
    p.add_argument("--forward-microbatches", type=int, default=8, help="timed tiny-model forwards")
    args = p.parse_args(argv)

    mask = agent_like_mask(args.batch, args.seq)
    g = torch.Generator().manual_seed(1)
    rewards = token_rewards(mask, torch.randn(args.batch, generator=g))
    values = torch.randn(args.batch, args.seq, generator=g)
    config = AlgoConfig()
    tokens = args.batch * args.seq
    gae_ms = best_ms(lambda: compute_gae(rewards, values, mask, 1.0, length_adaptive_lambda(mask)), args.gae_iters)
    step_ms = best_ms(lambda: compute_step_targets(rewards, values, mask, config), args.gae_iters)

    mb_ms, mb_sd, device = forward_ms_per_microbatch(args.micro_batch, args.micro_seq, args.forward_microbatches)
    mb_tokens = args.micro_batch * args.micro_seq
    fwd_ms = mb_ms * tokens / mb_tokens

    shape = f"[{args.batch},{args.seq}]"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, forward on {device}")
    print(f"input {shape}: {int(mask.sum()):,} action tokens of {tokens:,} ({mask.float().mean():.0%}), "
          f"{int((mask[:, 1:] & ~mask[:, :-1]).sum()) / args.batch:.1f} turns per row")  # fmt: skip
    print(f"compute_gae {shape} (policy pass): {gae_ms:.1f} ms (best of {args.gae_iters})")
    print(f"compute_step_targets {shape} (policy + critic pass): {step_ms:.1f} ms (best of {args.gae_iters})")
    print(f"tiny-model forward: {args.forward_microbatches} micro-batches of [{args.micro_batch},{args.micro_seq}] "
          f"measured, {mb_ms:.1f} +- {mb_sd:.1f} ms each; x{tokens / mb_tokens:g} for the same {tokens:,} tokens "
          f"= {fwd_ms:.0f} ms")  # fmt: skip
    print(f"compute_gae {shape}: {gae_ms:.1f} ms; tiny-model forward over the same {tokens / 2**20:g}M tokens: "
          f"{fwd_ms:.0f} ms; ratio X/Y = {gae_ms / fwd_ms:.2g} (1/{fwd_ms / gae_ms:.0f})")  # fmt: skip
    print(f"compute_step_targets {shape}: {step_ms:.1f} ms; ratio to the forward = {step_ms / fwd_ms:.2g}")


if __name__ == "__main__":
    main()

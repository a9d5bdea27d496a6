#!/usr/bin/env python
"""GPU check: a Qwen3-30B-A3B-shaped slice (a few layers at the real widths, bf16) trained with megatron-core.

Prepared for sessions lent a GPU (the H200 device tool); prints tokens/s and model FLOPs utilization of a
plain forward+backward and of a full SAO step, as one JSON line per measurement. Random weights (no
download): the widths, not the weights, set the speed.

    python benchmarks/gpu_qwen3_slice.py --layers 4 [--seq 4096 --trajectories 8 --peak-tflops 989]
    python benchmarks/gpu_qwen3_slice.py --cpu-smoke        # a scaled-down run that checks the code path on CPU

Memory (estimate, defaults: 4 layers x 128 experts at EP=1, both roles on one GPU): ~100 GB of weights, grads and
Adam state plus ~15-20 GB of fp32 logits per 8192-token micro-batch; on an out-of-memory error use
--microbatch-tokens 4096 or --layers 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

QWEN3_30B_A3B = dict(  # config.json of Qwen/Qwen3-30B-A3B, except num_hidden_layers
    model_type="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    rms_norm_eps=1e-6,
    rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
    tie_word_embeddings=False,
    max_position_embeddings=40960,
)


def forward_flops_per_token(hf: dict, seq: int) -> tuple[float, float]:
    """Forward FLOPs per token of the transformer layers (active experts only) and of the LM head's logits."""
    h, layers = hf["hidden_size"], hf["num_hidden_layers"]
    q = hf["num_attention_heads"] * hf["head_dim"]
    kv = hf["num_key_value_heads"] * hf["head_dim"]
    attn_proj = h * q + 2 * h * kv + q * h
    attn_scores = q * seq  # QK^T and PV: 2 * q * seq / 2 (causal) multiply-adds
    experts = hf["num_experts_per_tok"] * 3 * h * hf["moe_intermediate_size"] + h * hf["num_experts"]
    return 2 * layers * (attn_proj + attn_scores + experts), 2 * h * hf["vocab_size"]


def step_flops_per_token(hf: dict, seq: int, value_updates: int | None) -> float:
    """Model FLOPs per token (backward = 2x forward). None: one policy forward+backward. Otherwise a SAO step:
    the critic's forward for the old values, `value_updates` critic forward+backward passes (a scalar head, no
    logits; frozen attention still counted, as model FLOPs are), and the policy's forward+backward with logits."""
    layers, logits = forward_flops_per_token(hf, seq)
    policy = 3 * (layers + logits)
    if value_updates is None:
        return policy
    return policy + layers + value_updates * 3 * layers


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096, help="tokens per trajectory")
    p.add_argument("--trajectories", type=int, default=8)
    p.add_argument("--microbatch-tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak of the device (H200: 989)")
    p.add_argument("--cpu-smoke", action="store_true", help="scaled-down widths on CPU, to check the code path")
    args = p.parse_args()
    args.hf = dict(QWEN3_30B_A3B, num_hidden_layers=args.layers)
    if args.cpu_smoke:
        args.hf.update(
            hidden_size=128,
            intermediate_size=256,
            moe_intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            vocab_size=4096,
        )
        args.seq, args.trajectories, args.microbatch_tokens, args.repeats = 256, 4, 512, 1
    return args


def median_seconds(fn: Callable[[], None], repeats: int) -> float:
    """Median wall time of `fn` after one warm-up call, synchronizing the GPU around each call."""

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    args = parse_args()
    from megatron_sao.config import load_config
    from megatron_sao.distributed import init_distributed
    from megatron_sao.learner.batch import make_step_batch
    from megatron_sao.learner.forward import run_microbatches, token_logprobs
    from megatron_sao.learner.learner import Learner
    from megatron_sao.learner.synthetic import make_trajectory
    from megatron_sao.models.builder import ModelSpec, uses_transformer_engine
    from megatron_sao.models.families import get_family

    hf, dtype = args.hf, "bf16"
    cfg = load_config(
        None,
        ["--model.dtype", dtype, "--model.max_seq_len", str(max(args.seq, 4096)),
         "--learner.max_tokens_per_microbatch", str(args.microbatch_tokens),
         "--rollout.max_total_tokens", str(args.seq)],
    )  # fmt: skip
    ctx = init_distributed(cfg.parallel)
    spec = ModelSpec(family=get_family("qwen3_moe"), hf=hf, dtype=dtype, max_seq_len=cfg.model.max_seq_len)
    learner = Learner(cfg, spec, layout=ctx)
    rng = np.random.default_rng(0)
    turn = (args.seq - 64 - 64) // 2
    trajectories = [
        make_trajectory(rng, i, vocab=hf["vocab_size"], prompt_len=64, turns=(turn, turn), observation=64)
        for i in range(args.trajectories)
    ]
    batch = make_step_batch(trajectories, cfg.model.max_seq_len)
    mbs = learner._microbatches(batch)
    tokens = sum(int(t.numel()) for t in batch.tokens)

    def plain() -> None:
        def loss_fn(mb, output):
            logp = token_logprobs(output.reshape(mb.seq_len, -1), mb.targets(), 1.0, hf["vocab_size"],
                                  tp_rank=ctx.tp_rank)
            mask = mb.pack(batch.action_mask).to(logp.device)
            return -(logp * mask).sum(), mask.sum().to(torch.int), {}

        learner.policy.zero_grad()
        run_microbatches(learner.policy.ddp, mbs, loss_fn, forward_only=False)

    for name, fn, value_updates in (
        ("plain_fwd_bwd", plain, None),
        ("sao_step", lambda: learner.train_step(trajectories), cfg.algo.value.updates_per_policy_step),
    ):
        t = median_seconds(fn, args.repeats)
        achieved = step_flops_per_token(hf, args.seq, value_updates) * tokens / t / 1e12
        print(json.dumps({
            "measurement": name, "device": str(ctx.device), "te": uses_transformer_engine(spec),
            "layers": args.layers, "hidden": hf["hidden_size"], "experts": hf["num_experts"], "dtype": dtype,
            "tokens": tokens, "seconds": round(t, 4), "tokens_per_s": round(tokens / t, 1),
            "model_tflops_per_s": round(achieved, 2), "mfu": round(achieved / args.peak_tflops, 4),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else 0,
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

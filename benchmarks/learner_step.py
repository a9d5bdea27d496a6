#!/usr/bin/env python
"""Tokens/s of a full SAO learner step vs a plain megatron forward+backward over the same packed tokens.

The SAO step runs one value forward, K value forward+backward passes and one policy forward+backward (plus the
optimizer steps); the baseline is one policy forward+backward with a plain token log-likelihood loss through
the same megatron schedule, micro-batches and packing. Both are measured side by side in one process.

    python benchmarks/learner_step.py [--family qwen3_moe --layers 4 --hidden 256 --trajectories 16 --repeats 3]

With --critic-layouts it compares where the critic runs instead (each role one thread, pinned to its own core, as
separate accelerators): a policy-only step (one policy update), the serial SAO step (critic, then policy, on the
same core) and the SAO step with the critic on its own ranks (learner.value_on_separate_ranks: the policy job on
core 0, the value job on core 1, bridged as in a run), each batch sent to the value job when the policy job comes for
it and, as a run does when the next batch is waiting, as soon as the advantages of the one before are in (batches
ahead); each as a ratio to the policy-only step, medians of --repeats.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import torch


def _setup(args: argparse.Namespace, hf_dir: str, extra: list[str]) -> tuple[object, list]:
    from megatron_sao.config import load_config
    from megatron_sao.learner.synthetic import make_trajectory

    cfg = load_config(
        None,
        ["--model.hf_path", hf_dir, "--model.dtype", "fp32",
         "--learner.max_tokens_per_microbatch", str(args.microbatch_tokens),
         "--algo.value.updates_per_policy_step", str(args.k), *extra],
    )  # fmt: skip
    rng = np.random.default_rng(0)
    trajectories = [
        make_trajectory(rng, i, prompt_len=32, turns=(args.turn_tokens, args.turn_tokens), observation=24)
        for i in range(args.trajectories)
    ]
    for i, t in enumerate(trajectories):  # rewards that vary: a critic with something to learn
        t.header = type(t.header)(**{**_fields(t.header), "reward": float(i % 3) / 2})
    return cfg, trajectories


def _fields(header: object) -> dict:
    import msgspec

    return msgspec.structs.asdict(header)


def _pin(core: int) -> None:
    import os

    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > core:
        os.sched_setaffinity(0, {core})


def _one_core_steps(args: argparse.Namespace, hf_dir: str) -> dict[str, list[float]]:
    """Core 0: a policy-only step and the serial SAO step, interleaved."""
    from megatron_sao.distributed import init_distributed
    from megatron_sao.learner.learner import Learner

    _pin(0)
    cfg, trajectories = _setup(args, hf_dir, [])
    ctx = init_distributed(cfg.parallel)
    learner = Learner(cfg, layout=ctx)
    learner.load_hf(hf_dir)
    rng = np.random.default_rng(1)
    advantages = {t.trajectory_id: rng.standard_normal(t.header.num_tokens - 1).astype(np.float32)
                  for t in trajectories}  # fmt: skip
    steps = {"policy": lambda: learner.policy_step(trajectories, advantages), "serial": lambda: learner.train_step(
        trajectories)}  # fmt: skip
    out: dict[str, list[float]] = {k: [] for k in steps}
    for fn in steps.values():
        fn()  # warm-up
    for _ in range(args.repeats):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            out[name].append(time.perf_counter() - t0)
    return out


def _separate_job(args: argparse.Namespace, hf_dir: str, role: str, address: str) -> dict[str, list[float]]:
    """The policy job (core 0) or the value job (core 1) of a critic on its own ranks."""
    from megatron_sao.distributed import init_distributed
    from megatron_sao.learner.learner import Learner
    from megatron_sao.learner.value_job import RemoteCritic
    from megatron_sao.run.critic import start_value_job, stop_value_job
    from megatron_sao.run.learn import Steps

    _pin(0 if role == "policy" else 1)
    cfg, trajectories = _setup(args, hf_dir, ["--learner.value_on_separate_ranks", "true"])
    if role == "value":
        job = start_value_job(cfg, address)
        try:
            job.serve()
        finally:
            stop_value_job(job)
        return {}
    ctx = init_distributed(cfg.parallel)
    learner = Learner(cfg, roles={"policy"}, layout=ctx)
    learner.load_hf(hf_dir)
    critic = RemoteCritic(cfg, address, ctx)
    critic.begin(None)
    steps = Steps(learner, critic)
    out: dict[str, list[float]] = {}
    for mode in ("separate", "ahead"):  # each batch sent when the policy job comes for it / as soon as it can go
        for i in range(args.repeats + 1):  # the first is the warm-up
            t0 = time.perf_counter()
            batch = steps.ahead or list(trajectories)
            look_ahead = (lambda: list(trajectories)) if mode == "ahead" and i < args.repeats else None
            metrics = steps.train(batch, look_ahead)
            metrics.update(steps.finish())
            if i:
                out.setdefault(mode, []).append(time.perf_counter() - t0)
                out.setdefault(f"{mode}_critic_wait", []).append(metrics["time/critic_wait"])
                out.setdefault(f"{mode}_critic_tail", []).append(metrics["time/critic_tail"])
                out.setdefault(f"{mode}_critic", []).append(metrics["time/critic"])
    critic.close()
    return out


def critic_layouts(args: argparse.Namespace, hf_dir: str) -> None:
    import threading

    from megatron_sao.distributed import find_free_port, spawn_ranks

    (one_core,) = spawn_ranks(_one_core_steps, 1, args, hf_dir, timeout_s=3600)
    address = f"tcp://127.0.0.1:{find_free_port()}"
    got: dict[str, list] = {}

    def job(role: str) -> None:
        got[role] = spawn_ranks(_separate_job, 1, args, hf_dir, role, address, timeout_s=3600)

    threads = [threading.Thread(target=job, args=(role,)) for role in ("policy", "value")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (separate,) = got["policy"]
    med = {k: statistics.median(v) for k, v in {**one_core, **separate}.items()}
    print(f"model: {args.family} tiny, {args.layers} layers, hidden {args.hidden}, {args.experts} experts, fp32; "
          f"step: {args.trajectories} trajectories; K = {args.k}; each role 1 thread on its own core; medians of "
          f"{args.repeats}")  # fmt: skip
    print(f"policy-only step (1 policy update): {med['policy'] * 1e3:.0f} ms")
    print(f"serial SAO step (critic, then policy, one core): {med['serial'] * 1e3:.0f} ms; "
          f"serial step / policy-only step {med['serial'] / med['policy']:.2f}")  # fmt: skip
    for mode, label in (("separate", "separate critic step"), ("ahead", "separate critic step, batches ahead")):
        print(f"{label} (policy job core 0, value job core 1): {med[mode] * 1e3:.0f} ms (waiting for the "
              f"advantages {med[f'{mode}_critic_wait'] * 1e3:.0f} ms, for the critic after the policy update "
              f"{med[f'{mode}_critic_tail'] * 1e3:.0f} ms); {label} / policy-only step "
              f"{med[mode] / med['policy']:.2f} (goal <= 1.2)")  # fmt: skip
    print(f"floor on these two cores: max(policy update, K critic updates) / policy-only step "
          f"{max(med['policy'], med['separate_critic']) / med['policy']:.2f} (K critic updates "
          f"{med['separate_critic'] * 1e3:.0f} ms)")  # fmt: skip


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
    p.add_argument("--critic-layouts", action="store_true", help="compare the serial critic with one on its own "
                   "ranks, each role on its own core (see above)")  # fmt: skip
    args = p.parse_args()
    if args.critic_layouts:
        from megatron_sao.models.tiny import make_tiny_model

        hf_dir = make_tiny_model(args.family, tempfile.mkdtemp(prefix="bench-"), layers=args.layers,
                                 hidden=args.hidden, experts=args.experts)  # fmt: skip
        critic_layouts(args, str(hf_dir))
        return
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
    ctx = init_distributed(cfg.parallel)
    learner = Learner(cfg, layout=ctx)
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
            logp = token_logprobs(output.reshape(mb.seq_len, -1), mb.targets(), 1.0, vocab, tp_rank=ctx.tp_rank)
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

#!/usr/bin/env python
"""The pipeline simulator (megatron_sao/plan/simulate.py) on the command line.

calibrate: fit the engine's time per decode iteration to the CPU pipeline-efficiency benchmark
(docs/results/pipeline_efficiency.json: its runs' trajectory ledgers), then simulate every arm of it with the
measured learner step and push times and the recorded episodes, and print simulated against measured
trajectories/s, learner busy and engine busy (target: within 15%).

    python tools/simulate.py calibrate [--from docs/results/pipeline_efficiency.json] [--seeds 5] [--out FILE]

project: an example's cluster run, from its capacity plan (layout, learner GPUs, push time) and GPU physics
(decode memory-bound on the weights an engine GPU reads, the learner at a stated MFU), with the recorded episode
distribution scaled to agentic lengths, for synchronous GRPO, one-step-off GRPO and SAO; sensitivity to the
length tail and the push time.

    python tools/simulate.py project examples/qwen3_30b/config.yaml --nodes 6 [--gpu h100] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_sao.plan.simulate import (  # noqa: E402
    ARMS,
    EngineModel,
    EpisodeSource,
    LearnerModel,
    Scenario,
    fit_engine,
    log_grid,
    relative_error,
    simulate,
)

TARGETS = ("trajectories_per_s", "learner_busy", "engine_busy")
FITTED = ("engine_busy", "gen_s_mean")
"""What the engine's four parameters are fitted to; throughput and learner busy are predictions."""
GPUS = {  # bf16 dense peak FLOP/s, HBM bytes/s
    "h100": (989e12, 3.35e12),
    "h200": (989e12, 4.8e12),
}


def _median_runs(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over seeds; histograms summed."""
    out: dict[str, Any] = {}
    for k, v in results[0].items():
        if isinstance(v, dict):
            keys = sorted({b for r in results for b in r[k]}, key=int)
            out[k] = {b: sum(r[k].get(b, 0) for r in results) for b in keys}
        else:
            out[k] = statistics.median(r[k] for r in results)
    return out


def calibration_scenarios(bench: dict[str, Any]) -> dict[str, tuple[Scenario, LearnerModel]]:
    meta = bench["meta"]
    out = {}
    for arm in ARMS:
        runs = [r for r in bench["runs"] if r["arm"] == arm]
        train = statistics.median(r["train_s_mean"] for r in runs)
        sync = statistics.median(r["sync_s_mean"] for r in runs)
        sc = Scenario(arm, engines=1, concurrency=meta["concurrency"],
                      trajectories_per_step=meta["trajectories_per_step"], steps=meta["steps"],
                      group=1 if arm == "sao" else meta["group"], max_staleness=meta["max_staleness"])  # fmt: skip
        out[arm] = (sc, LearnerModel(lambda a, n, tokens, s=train: s, push_s=sync))
    return out


def run_arms(scenarios: dict[str, tuple[Scenario, LearnerModel]], engine: EngineModel, source: EpisodeSource,
             seeds: int) -> dict[str, dict[str, float]]:  # fmt: skip
    out = {}
    for arm, (sc, learner) in scenarios.items():
        runs = [simulate(Scenario(**{**sc.__dict__, "seed": s}), engine, learner, source).summary()
                for s in range(seeds)]  # fmt: skip
        out[arm] = _median_runs(runs)
    return out


def calibrate(args: argparse.Namespace) -> int:
    bench = json.loads(Path(args.source).read_text())
    # the episodes: the synchronous arms train every episode they generate (SAO's stale drops bias its ledger)
    records = tuple(t for r in bench["runs"] if r["arm"] != "sao" for t in r["per_trajectory"])
    source = EpisodeSource(records)
    scenarios = calibration_scenarios(bench)
    measured = {arm: {**bench["medians"][arm], "gen_s_mean": statistics.median(
        statistics.fmean(t["gen_s"] for t in r["per_trajectory"]) for r in bench["runs"] if r["arm"] == arm)}
        for arm in ARMS}  # fmt: skip

    def engine_error(engine: EngineModel) -> float:  # fitted to what the engine measured: busy time, episode seconds
        sim = run_arms(scenarios, engine, source, seeds=1)
        return sum(relative_error(sim[a][k], measured[a][k]) ** 2 for a in ARMS for k in FITTED)

    engine, err = fit_engine(engine_error, log_grid(2e-4, 1e-2, 8), log_grid(2e-5, 2e-3, 8), (0.0, 0.01, 0.05),
                             (0.0, 0.005, 0.01, 0.02))  # fmt: skip
    near = (0.7, 0.85, 1.0, 1.2, 1.4)  # a finer grid around the coarse optimum
    engine, err = fit_engine(engine_error, [engine.tau0 * f for f in near], [engine.tau1 * f for f in near],
                             [engine.prefill_per_token * f for f in (0.5, 1.0, 2.0)],
                             [engine.turn_overhead_s * f for f in near])  # fmt: skip
    sim = run_arms(scenarios, engine, source, seeds=args.seeds)
    rows = []
    print(f"engine fitted on {', '.join(FITTED)}: tau0 {engine.tau0 * 1e3:.2f} ms + tau1 {engine.tau1 * 1e3:.3f} ms "
          f"x batch per decode iteration, a prefilled token = {engine.prefill_per_token:.3f} iterations, "
          f"{engine.turn_overhead_s * 1e3:.1f} ms per turn outside the engine; learner step and push times as "
          f"measured; {args.seeds} seeds, medians")  # fmt: skip
    print(f"{'arm':<11} {'quantity':<19} {'simulated':>9} {'measured':>9} {'error':>7}  ")
    worst = 0.0
    for arm in ARMS:
        for key in (*TARGETS, "gen_s_mean", "staleness_mean"):
            s = sim[arm][key]
            m = measured[arm][key] if key in measured[arm] else _ledger_mean(bench, arm, key)
            e = relative_error(s, m) if m else 0.0
            if key in TARGETS:
                worst = max(worst, e)
            rows.append({"arm": arm, "quantity": key, "simulated": s, "measured": m, "error": e})
            kind = "fitted" if key in FITTED else "predicted"
            rows[-1]["kind"] = kind
            print(f"{arm:<11} {key:<19} {s:9.3f} {m:9.3f} {e:7.1%}  {kind}")
    speedup_sim = sim["sao"]["trajectories_per_s"] / sim["grpo"]["trajectories_per_s"]
    speedup_meas = measured["sao"]["trajectories_per_s"] / measured["grpo"]["trajectories_per_s"]
    print(f"speed-up sao/grpo: simulated {speedup_sim:.2f}, measured {speedup_meas:.2f}")
    print(f"worst error on throughput and busy fractions: {worst:.1%} (target 15%)")
    if args.out:
        Path(args.out).write_text(json.dumps({"engine": engine.__dict__, "fit_error": err, "rows": rows,
                                              "worst_error": worst, "seeds": args.seeds}, indent=1) + "\n")  # fmt: skip
    return 0


def physics(cfg: Any, plan: Any, arch: Any, gpu: str, engine_gpu: str, mfu: float, concurrency_per_engine: int,
            mean_context: float, push_path: str) -> tuple[EngineModel, Any]:  # fmt: skip
    """The engine's decode iteration from the bytes one engine GPU reads (its share of the weights of the experts a
    batch touches, each sequence's KV cache) at 70% of HBM bandwidth, prefill at 50% of peak FLOP/s; the learner's
    step from FLOPs per token at `mfu` over its GPUs."""
    from megatron_sao.plan.simulate import LearnerModel

    peak, hbm = GPUS[engine_gpu]
    r = cfg.rollout
    weight_bytes = 1 if any("fp8" in a for a in r.sglang.extra_args) else 2
    counts = plan.counts
    dense = counts.total - _routed(arch)
    touched = 1 - (1 - arch.topk / arch.experts) ** concurrency_per_engine if arch.experts else 0.0
    per_gpu = (dense + _routed(arch) * touched) * weight_bytes / r.sglang.tp
    tau0 = per_gpu / (0.7 * hbm)
    kv = plan.engine.kv_bytes_per_token if plan.engine else 0.0
    flops_token = 2 * counts.active / r.sglang.tp
    tau1 = mean_context * kv / (0.7 * hbm) + flops_token / (0.5 * peak)
    iteration = tau0 + tau1 * concurrency_per_engine
    prefill = flops_token / (0.5 * peak) / iteration  # iterations per prefilled token
    engine = EngineModel(tau0, tau1, prefill, turn_overhead_s=0.005)
    k = cfg.algo.value.updates_per_policy_step
    fwd_bwd = 4 if cfg.learner.recompute == "full" else 3  # x 2N FLOPs per token: forward, backward (+ recompute)
    # the critic's values come from its first update's forward when lambda_critic = 1 (learner/learner.py)
    values_fwd = 0 if cfg.algo.gae.lambda_critic == 1.0 else 1
    policy_rate = plan.world * GPUS[gpu][0] * mfu
    separate = plan.value_layout is not None  # learner.value_on_separate_ranks: the critic on value_world GPUs
    value_rate = (plan.value_world if separate else plan.world) * GPUS[gpu][0] * mfu

    path = plan.sync.paths[push_path] if plan.sync else None
    every = cfg.weight_sync.interval

    def learner_at(scale: float) -> LearnerModel:
        """The push's transfer and stall scaled by `scale`: the learner busy for the transfer and the commit, the
        engines stopped for the stall only (the whole push on the full path, the commit on the shard-aware one)."""
        push = path.push_s * scale if path else 0.0
        stall = path.stall_s * scale if path else 0.0

        def seconds(tokens: int) -> tuple[float, float, float]:
            """(policy update, one critic update, the critic's values forward) of a step of `tokens`."""
            flops = 2 * counts.active * tokens
            return flops * fwd_bwd / policy_rate, flops * fwd_bwd / value_rate, flops * values_fwd / value_rate

        def step_s(arm: str, n: int, tokens: int) -> float:
            policy, update, values = seconds(tokens)
            if arm != "sao":
                return policy + 0.5  # + optimizer steps and collectives
            if not separate:
                return values + k * update + policy + 0.5
            # the policy job waits for the advantages (the values, or the first update that gives them), then
            # updates and pushes while the value job does the rest of its K updates: the push (added by the
            # simulator after the step) hides that much of the critic's tail
            waited = values if values_fwd else update
            rest = k * update - (0 if values_fwd else update)
            return waited + max(policy, rest - push / every) + 0.5

        def ahead_step_s(arm: str, n: int, tokens: int) -> float:
            # the value job went from the last batch straight to this one: a step costs the longer of the policy
            # job's update + push and the value job's values + K updates
            policy, update, values = seconds(tokens)
            return max(policy, values + k * update - push / every) + 0.5

        return LearnerModel(step_s, push_s=push, engine_pause_s=stall, push_every=every,
                            ahead_step_s=ahead_step_s if separate else None)  # fmt: skip

    return engine, learner_at


def _routed(arch: Any) -> int:
    return 2 * 3 * arch.hidden * arch.moe_ffn * arch.experts * sum(arch.moe_layers) // 2


def project(args: argparse.Namespace) -> int:
    from megatron_sao.config import load_config
    from megatron_sao.models.builder import ModelSpec
    from megatron_sao.models.families import detect_family
    from megatron_sao.plan.plan import Hardware, make_plan, read_hf_config
    from megatron_sao.plan.tensors import Architecture

    cfg = load_config(args.config, args.overrides)
    hf = read_hf_config(cfg, args.config, None)
    arch = Architecture.from_spec(ModelSpec(family=detect_family(hf, cfg.model.family), hf=hf, dtype=cfg.model.dtype))
    plan = make_plan(cfg, hf, Hardware(nodes=args.nodes, engine_gpu_mem_gb=args.engine_gpu_mem_gb), args.delta_density)
    if not plan.fits:
        print("the config does not fit (python -m megatron_sao plan): " + "; ".join(m.message for m in plan.misfits))
        return 1
    bench = json.loads(Path(args.source).read_text())
    records = tuple(t for r in bench["runs"] if r["arm"] != "sao" for t in r["per_trajectory"])
    base = EpisodeSource(records)
    turns = statistics.fmean(int(t["turns"]) for t in records)
    gen = statistics.fmean(t["action_tokens"] / max(1, int(t["turns"])) for t in records)
    prefill = statistics.fmean((t["tokens"] - t["action_tokens"]) / max(1, int(t["turns"])) for t in records)
    tool = statistics.fmean(t["tool_s"] / max(1, int(t["turns"]) - 1) for t in records if int(t["turns"]) > 1)

    def source(tail: float) -> EpisodeSource:
        return EpisodeSource(base.records, gen_scale=args.gen_tokens_per_turn / gen,
                             prefill_scale=args.prefill_tokens_per_turn / prefill, tool_scale=args.tool_s / tool,
                             tail_scale=tail)  # fmt: skip

    engines = cfg.rollout.num_engines
    in_flight = plan.engine_concurrency * engines
    mean_context = turns * (args.gen_tokens_per_turn + args.prefill_tokens_per_turn) / 2
    engine_gpu = args.engine_gpu or args.gpu
    push_path = plan.sync.taken if args.push == "config" or not plan.sync else args.push
    engine, learner_at = physics(cfg, plan, arch, args.gpu, engine_gpu, args.mfu, plan.engine_concurrency,
                                 mean_context, push_path)  # fmt: skip
    path = plan.sync.paths[push_path] if plan.sync else None
    t = cfg.learner.trajectories_per_step
    batch = in_flight // args.group * args.group

    def scenarios(learner: Any, tail: float) -> dict[str, dict[str, float]]:
        out = {}
        for arm in ARMS:
            per_step = t if arm == "sao" else batch
            sc = Scenario(arm, engines=engines, concurrency=in_flight, trajectories_per_step=per_step,
                          steps=max(4, args.trajectories // per_step), group=1 if arm == "sao" else args.group,
                          max_staleness=cfg.bus.max_staleness, seed=0,
                          admission=cfg.bus.admission and cfg.bus.max_staleness is not None)  # fmt: skip
            out[arm] = simulate(sc, engine, learner, source(tail)).summary()
        return out

    base_run = scenarios(learner_at(1.0), 1.0)
    learners = f"{plan.world} x {args.gpu}" + (f" + value job {plan.value_world}" if plan.value_layout else "")
    print(f"{args.config}: {engines} engines x TP={cfg.rollout.sglang.tp} ({in_flight} episodes in flight), learner "
          f"{learners} at MFU {args.mfu}, engines on {engine_gpu}; episodes: {turns:.1f} turns on "
          "average (recorded tail), "
          f"{args.gen_tokens_per_turn} generated + {args.prefill_tokens_per_turn} prefilled tokens and a "
          f"{args.tool_s:g} s tool call per turn; push ({push_path}) {path.transfer_s if path else 0:.1f} s "
          f"transfer + engines stopped {path.stall_s if path else 0:.2f} s, every "
          f"{cfg.weight_sync.interval} step(s); decode iteration {engine.tau0 * 1e3:.1f} ms + "
          f"{engine.tau1 * 1e3:.3f} ms x batch")  # fmt: skip
    print(f"{'arm':<11} {'per step':>8} {'traj/hour':>10} {'learner busy':>12} {'engine busy':>11} "
          f"{'staleness mean/p90/max':>22} {'dropped':>8}")  # fmt: skip
    for arm, r in base_run.items():
        per_step = t if arm == "sao" else batch
        print(f"{arm:<11} {per_step:>8} {r['trajectories_per_hour']:>10,.0f} {r['learner_busy']:>12.2f} "
              f"{r['engine_busy']:>11.2f} {r['staleness_mean']:>10.2f} / {r['staleness_p90']:.0f} / "
              f"{r['staleness_max']:.0f} {r['dropped'] / max(1, r['dropped'] + r['trained']):>8.1%}")  # fmt: skip
    if plan.value_layout is not None:
        sao_steps = max(4, args.trajectories // t)
        print(f"sao steps whose batch the value job took ahead (the next batch waiting): "
              f"{base_run['sao']['ahead_steps']} of {sao_steps}")  # fmt: skip
    sens = []
    for tail in (1.0, 2.0, 4.0):
        for push in (0.25, 1.0, 4.0):
            run = base_run if (tail, push) == (1.0, 1.0) else scenarios(learner_at(push), tail)
            sao = run["sao"]["trajectories_per_hour"]
            per_hour = {a: run[a]["trajectories_per_hour"] for a in ARMS}
            sens.append({"tail_scale": tail, "push_scale": push, "sao_over_grpo": sao / per_hour["grpo"],
                         "sao_over_grpo_async": sao / per_hour["grpo_async"], "per_hour": per_hour})  # fmt: skip
    print(
        "speed-up of SAO (trajectories/hour) by length tail (x turns above the median) and push time (transfer "
        "and stall, x planned):"
    )
    print(f"{'tail':>5} {'push':>5} {'sao/grpo':>9} {'sao/grpo_async':>15}")
    for row in sens:
        print(f"{row['tail_scale']:>5g} {row['push_scale']:>5g} {row['sao_over_grpo']:>9.2f} "
              f"{row['sao_over_grpo_async']:>15.2f}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({"config": args.config, "engine": engine.__dict__, "arms": base_run,
                                              "sensitivity": sens, "args": {k: v for k, v in vars(args).items()
                                              if k != "overrides"}}, indent=1, default=str) + "\n")  # fmt: skip
    return 0


def _ledger_mean(bench: dict[str, Any], arm: str, key: str) -> float:
    return statistics.median(r[key] for r in bench["runs"] if r["arm"] == arm)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("calibrate", help="fit and check against the CPU pipeline-efficiency benchmark")
    c.add_argument("--from", dest="source", default=str(REPO / "docs/results/pipeline_efficiency.json"))
    c.add_argument("--seeds", type=int, default=5)
    c.add_argument("--out", default=None)
    j = sub.add_parser("project", help="an example's cluster run: the three arms, sensitivity to tail and push")
    j.add_argument("config")
    j.add_argument("--nodes", type=int, required=True)
    j.add_argument("--engine-gpu-mem-gb", type=float, default=None)
    j.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="the learner's GPUs")
    j.add_argument("--engine-gpu", choices=sorted(GPUS), default=None, help="the engines' GPUs (default: --gpu)")
    j.add_argument("--mfu", type=float, default=0.25, help="learner model FLOP utilization")
    j.add_argument("--gen-tokens-per-turn", type=int, default=600)
    j.add_argument("--prefill-tokens-per-turn", type=int, default=400)
    j.add_argument("--tool-s", type=float, default=3.0, help="mean seconds of a tool call")
    j.add_argument("--group", type=int, default=8, help="grpo arms: samples per prompt")
    j.add_argument("--trajectories", type=int, default=4096, help="trajectories each arm trains")
    j.add_argument("--from", dest="source", default=str(REPO / "docs/results/pipeline_efficiency.json"))
    j.add_argument(
        "--push",
        choices=("config", "full", "sharded", "agent", "sharded+delta", "agent+delta"),
        default="config",
        help="the push path (plan's table): the one the config's engines take, or another",
    )
    j.add_argument("--delta-density", type=float, default=None, help="engine-dtype units changed per push on the "
                   "+delta paths (default: measured at the paper's lr 1e-6: bf16 0.0114, FP8 0.0017)")  # fmt: skip
    j.add_argument("--out", default=None)
    args, overrides = p.parse_known_args()
    args.overrides = overrides
    if args.command == "calibrate":
        if overrides:
            p.error(f"unknown arguments {overrides}")
        return calibrate(args)
    try:
        return project(args)
    except (FileNotFoundError, ValueError) as e:  # a config error (ConfigError is one), a model config not there
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

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


def _median_runs(results: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in results) for k in results[0]}


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


def _ledger_mean(bench: dict[str, Any], arm: str, key: str) -> float:
    return statistics.median(r[key] for r in bench["runs"] if r["arm"] == arm)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("calibrate", help="fit and check against the CPU pipeline-efficiency benchmark")
    c.add_argument("--from", dest="source", default=str(REPO / "docs/results/pipeline_efficiency.json"))
    c.add_argument("--seeds", type=int, default=5)
    c.add_argument("--out", default=None)
    args = p.parse_args()
    if args.command == "calibrate":
        return calibrate(args)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())

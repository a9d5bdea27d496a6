#!/usr/bin/env python
"""Streaming SAO (rollout admission on, and off: drop what goes stale) vs synchronous GRPO vs one-step-off GRPO on the
same pipeline, side by side in one run.

Each arm runs the real processes on the agentic main task (key_chain: long-tailed multi-turn tool use) from the
same warm-started model (tools/warm_start.py, cached under runs/bench_pipeline/warm_agentic): an embedded engine (one
thread) and the rollout worker pinned to core 0, the learner (one thread) pinned to core 1, the bus between them,
weights pushed over gloo. Every arm trains --steps steps of --trajectories-per-step trajectories (grpo arms: groups
of --group), so all see the same number of trajectories. Measured per arm over the window from the first episode's
start to the last step's end:
  learner busy   (training + weight pushes) / window
  engine busy    time in forward passes (the engine's own count) / window
  trajectories/s trained trajectories / window, and generated tokens (all the engine made, stale ones included)
  trained share  action tokens trained / tokens generated: what dropping stale trajectories throws away (sao_drop is
                 sao with bus.admission false; sao bounds staleness by admission, bus/admission.py)
The arms run one after another, --repeats times (interleaved: sao, grpo, grpo_async, sao, ...), so a noisy
neighbour hits all of them alike. Prints a line per arm and repeat, then the medians and `speed-up sao/grpo X`
(median trajectories/s; goal >= 1.6 on 2 cores) and `speed-up sao/grpo_async Y`, and writes every run's
per-trajectory timings (the learner's trajectories.jsonl: start, finish, generation and tool seconds, turns,
tokens, versions) with the summary to --out, for the cluster simulator to be calibrated on.

    python benchmarks/pipeline_efficiency.py [--repeats 3 --tool-latency 1.0 --out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments.harness import AGENTIC as CONFIG  # noqa: E402
from experiments.harness import pinned, role_env, warm_agentic_model  # noqa: E402

ARMS = ("sao", "sao_drop", "grpo", "grpo_async")
ADMISSION = {"sao_drop": "false"}  # every other arm: the default (on; group arms bound their batches by the gate)


def _arm(arm: str, warm: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from megatron_sao.distributed.spawn import find_free_port
    from megatron_sao.engines.client import SGLangClient

    run_dir = work / arm
    shutil.rmtree(run_dir, ignore_errors=True)
    (run_dir / "logs").mkdir(parents=True)
    port = find_free_port()
    url = f"http://127.0.0.1:{port}"
    overrides = [
        "--model.hf_path", str(warm), "--launch.run_dir", str(run_dir), "--algo.name", arm.removesuffix("_drop"),
        "--bus.admission", ADMISSION.get(arm, "true"),
        "--algo.grpo.group_size", str(args.group), "--algo.value.pretrain_samples", "0",
        "--learner.trajectories_per_step", str(args.trajectories_per_step), "--learner.max_steps", str(args.steps),
        "--learner.save_interval", "1000", "--rollout.concurrency", str(args.concurrency),
        "--bus.bind", f"tcp://127.0.0.1:{find_free_port()}", "--weight_sync.master_port", str(find_free_port()),
        "--rollout.cursor_state", str(run_dir / "cursor.json"), "--bus.max_staleness", str(args.max_staleness),
        "--rollout.env.options", json.dumps({"tool_latency_s": args.tool_latency}),
    ]  # fmt: skip
    py = [sys.executable, "-m", "megatron_sao"]
    logs = {name: open(run_dir / "logs" / f"{name}.log", "wb") for name in ("engine", "learner", "rollout")}  # noqa: SIM115
    engine = subprocess.Popen(pinned(0, [*py, "engine", "--model", str(warm), "--port", str(port), "--threads", "1",
                                          "--max-running-requests", "64"]),
                              stdout=logs["engine"], stderr=subprocess.STDOUT, env=role_env())  # fmt: skip
    procs = [engine]
    try:
        client = SGLangClient(url)
        deadline = time.monotonic() + 300
        while not client.health(timeout_s=1.0):
            if engine.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{arm}: the engine did not start: {(run_dir / 'logs' / 'engine.log').read_text()}")
            time.sleep(0.3)
        learner = subprocess.Popen(pinned(1, [*py, "learn", str(CONFIG), "--engines", url, *overrides]),
                                   stdout=logs["learner"], stderr=subprocess.STDOUT, env=role_env())  # fmt: skip
        procs.append(learner)
        busy0 = client.server_info()["load"]
        worker = subprocess.Popen(pinned(0, [*py, "rollout", str(CONFIG), "--engines", url, *overrides]),
                                  stdout=logs["rollout"], stderr=subprocess.STDOUT, env=role_env())  # fmt: skip
        procs.append(worker)
        if learner.wait(timeout=3000) != 0:
            raise SystemExit(f"{arm}: the learner failed: {(run_dir / 'logs' / 'learner.log').read_text()[-3000:]}")
        busy1 = client.server_info()["load"]
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in logs.values():
            f.close()
    return _measure(arm, run_dir, busy0, busy1)


def _measure(arm: str, run_dir: Path, busy0: dict[str, Any], busy1: dict[str, Any]) -> dict[str, Any]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step/trajectories" in r]
    ledger = [t for t in map(json.loads, (run_dir / "trajectories.jsonl").read_text().splitlines()) if "id" in t]
    start = min(t["started_at"] for t in ledger)
    end = steps[-1]["time"]
    window = end - start
    busy = ("time/critic", "time/policy", "time/sync", "time/checkpoint")
    learner_busy = sum(r.get(k, 0.0) for r in steps for k in busy)
    engine_busy = busy1["busy_s"] - busy0["busy_s"]
    latencies = [t["finished_at"] - t["started_at"] for t in ledger]
    generated = busy1["generated_tokens"] - busy0["generated_tokens"]
    return {
        "arm": arm,
        "window_s": window,
        "trajectories": len(ledger),
        "trajectories_per_s": len(ledger) / window,
        "learner_busy": learner_busy / window,
        "engine_busy": engine_busy / window,
        "generated_tokens": generated,
        "trained_action_tokens": sum(t["action_tokens"] for t in ledger),
        "trained_share": sum(t["action_tokens"] for t in ledger) / max(generated, 1),
        "stale_dropped": max((r.get("bus/stale_dropped", 0.0) for r in steps), default=0.0),
        "staleness_mean": statistics.fmean(r.get("staleness/mean", 0.0) for r in steps),
        "staleness_max": max(r.get("staleness/max", 0.0) for r in steps),
        "reward_mean": statistics.fmean(t["reward"] for t in ledger),
        "turns_mean": statistics.fmean(t["turns"] for t in ledger),
        "episode_s_median": statistics.median(latencies),
        "episode_s_p90": sorted(latencies)[int(0.9 * (len(latencies) - 1))],
        "train_s_mean": statistics.fmean(r.get("time/critic", 0.0) + r.get("time/policy", 0.0) for r in steps),
        "sync_s_mean": statistics.fmean(r.get("time/sync", 0.0) for r in steps),
        "per_trajectory": ledger,
    }


MEDIAN_KEYS = (
    "trajectories_per_s",
    "learner_busy",
    "engine_busy",
    "generated_tokens",
    "window_s",
    "train_s_mean",
    "trained_share",
    "stale_dropped",
    "staleness_max",
)


def _medians(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    arms = dict.fromkeys(r["arm"] for r in results)
    return {arm: {k: statistics.median(r[k] for r in results if r["arm"] == arm) for k in MEDIAN_KEYS} for arm in arms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--trajectories-per-step", type=int, default=16)
    p.add_argument("--group", type=int, default=4, help="G of the grpo arms (trajectories-per-step / G prompts)")
    p.add_argument("--concurrency", type=int, default=16, help="episodes in flight per worker (every arm)")
    p.add_argument("--tool-latency", type=float, default=1.0,
                   help="seconds per lookup: episodes then take 1-6 tool calls' time, long-tailed (0: the tiny "
                   "model's tokens alone, which on a CPU are too cheap to keep the engine busy)")  # fmt: skip
    p.add_argument("--max-staleness", type=int, default=4, help="bus.max_staleness of every arm")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--repeats", type=int, default=3, help="runs of every arm; the medians are reported")
    p.add_argument("--work", default=str(REPO / "runs" / "bench_pipeline"))
    p.add_argument("--out", default=None, help="JSON with the summary and every per-trajectory timing")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    warm = warm_agentic_model(work)
    results: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for arm in args.arms.split(","):
            r = {**_arm(arm, warm, work, args), "repeat": repeat}
            results.append(r)
            print(f"{arm:>10} #{repeat}: {r['trajectories']} trajectories in {r['window_s']:.1f}s = "
                  f"{r['trajectories_per_s']:.2f}/s; learner busy {r['learner_busy']:.2f}, engine busy "
                  f"{r['engine_busy']:.2f}; {r['generated_tokens']} tokens generated, {r['trained_action_tokens']} "
                  f"trained; staleness mean {r['staleness_mean']:.2f} max {r['staleness_max']:.0f}; step "
                  f"{r['train_s_mean']:.2f}s; episode {r['episode_s_median']:.2f}s median, {r['episode_s_p90']:.2f}s "
                  "p90", flush=True)  # fmt: skip
    medians = _medians(results)
    print(f"medians of {args.repeats} run(s):")
    for arm, m in medians.items():
        print(f"{arm:>10}: {m['trajectories_per_s']:.2f} trajectories/s, learner busy {m['learner_busy']:.2f}, "
              f"engine busy {m['engine_busy']:.2f}, {m['generated_tokens']:.0f} tokens generated, "
              f"{m['trained_share']:.2f} of them trained, {m['stale_dropped']:.0f} dropped as stale, staleness max "
              f"{m['staleness_max']:.0f}")  # fmt: skip
    if "sao" in medians and "grpo" in medians:
        print(f"speed-up sao/grpo {medians['sao']['trajectories_per_s'] / medians['grpo']['trajectories_per_s']:.2f}")
    if "sao_drop" in medians and "grpo" in medians:
        ratio = medians["sao_drop"]["trajectories_per_s"] / medians["grpo"]["trajectories_per_s"]
        print(f"speed-up sao_drop/grpo {ratio:.2f}")
    for arm in ("sao", "sao_drop"):
        if arm in medians:
            print(f"share of generated tokens trained, {arm}: {medians[arm]['trained_share']:.2f}")
    if "sao" in medians and "grpo_async" in medians:
        ratio = medians["sao"]["trajectories_per_s"] / medians["grpo_async"]["trajectories_per_s"]
        print(f"speed-up sao/grpo_async {ratio:.2f}")
    if args.out:
        meta = {"command": " ".join(sys.argv), "steps": args.steps, "trajectories_per_step": args.trajectories_per_step,
                "group": args.group, "concurrency": args.concurrency, "tool_latency_s": args.tool_latency,
                "max_staleness": args.max_staleness, "repeats": args.repeats, "cpus": os.cpu_count()}  # fmt: skip
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        summary = {"meta": meta, "medians": medians, "runs": results}
        Path(args.out).write_text(json.dumps(summary, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()

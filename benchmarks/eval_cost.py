#!/usr/bin/env python
"""What held-out evaluation costs training: the main job (examples/tiny_agentic, its warm-started model, value
pre-training off) for --steps policy steps with its eval section on and with eval.interval 0, the two arms
interleaved --repeats times on this machine. Per run: trained trajectories per second over the policy steps
(first step's start to last step's end), the share of trajectories dropped as stale, and the evaluations' own time.
Prints a line per run, the medians, and `trained trajectories/s, eval on / off X`.

    python benchmarks/eval_cost.py [--steps 20 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments.harness import AGENTIC, RUNS, role_env, warm_agentic_model  # noqa: E402


def _run(arm: str, warm: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from megatron_sao.distributed.spawn import find_free_port

    run_dir = work / arm
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "megatron_sao", "run", str(AGENTIC), "--model.hf_path", str(warm),
           "--launch.run_dir", str(run_dir), "--learner.max_steps", str(args.steps), "--learner.save_interval",
           "1000", "--algo.value.pretrain_samples", "0", "--bus.bind", f"tcp://127.0.0.1:{find_free_port()}",
           "--weight_sync.master_port", str(find_free_port()), "--rollout.base_port", str(find_free_port()),
           "--launch.display", "plain"]  # fmt: skip
    if arm == "off":
        cmd += ["--eval.interval", "0"]
    done = subprocess.run(cmd, cwd=REPO, env=role_env(), capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{arm} run failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step/trajectories" in r and r["weight_version"] > 0]
    evals = [r for r in records if "eval/weight_version" in r]
    window = steps[-1]["time"] - steps[0]["time"] + steps[0]["time/step"]
    trained = sum(r["step/trajectories"] for r in steps)
    stale = steps[-1].get("bus/stale_dropped", 0.0)
    return {"arm": arm, "trajectories_per_s": trained / window, "window_s": window,
            "stale_frac": stale / max(stale + trained, 1), "evals": len(evals),
            "eval_s": sum(r["eval/time"] for r in evals),
            "eval_wait_s": sum(r.get("time/eval_wait", 0.0) for r in records)}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", type=Path, default=RUNS / "bench_eval_cost")
    args = p.parse_args()
    warm = warm_agentic_model()
    rows: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    for i in range(args.repeats):
        for arm in ("on", "off"):
            r = _run(arm, warm, args.work, args)
            rows[arm].append(r)
            print(f"repeat {i} {arm:>3}: {r['trajectories_per_s']:.2f} trained trajectories/s over {r['window_s']:.0f} "
                  f"s, stale {r['stale_frac']:.1%}, {r['evals']} evaluations ({r['eval_s']:.0f} s; pushes waited "
                  f"{r['eval_wait_s']:.1f} s)", flush=True)  # fmt: skip
    med = {arm: statistics.median(r["trajectories_per_s"] for r in rs) for arm, rs in rows.items()}
    for arm, rs in rows.items():
        print(f"median {arm:>3}: {med[arm]:.2f} trained trajectories/s, stale "
              f"{statistics.median(r['stale_frac'] for r in rs):.1%}")  # fmt: skip
    print(f"trained trajectories/s, eval on / off {med['on'] / med['off']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

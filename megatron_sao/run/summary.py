"""What a finished run did, from its <run_dir>/metrics.jsonl (printed by `run` at the end; also `summarize()` for
tools and tests).

Reward before: the mean over the value pre-training steps (their rollouts all come from the initial policy), else
over the first `window` policy steps; after: the mean over the last `window` policy steps (both windows shrink to
half the steps on a short run, so they never overlap). Seconds: the steps' own time (`time/step` summed: waiting for
trajectories, training, pushing, saving), so the gap between a stopped run and its resume is not counted.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from megatron_sao.files import METRICS_FILE, read_records


def summarize(run_dir: str | Path, window: int = 10) -> dict[str, Any]:
    path = Path(run_dir) / METRICS_FILE
    records = [r for r in read_records(path) if r.get("event") != "unreadable"]
    rewarded = [r for r in records if "reward/mean" in r]
    pretrain = [r for r in rewarded if r.get("weight_version") == 0 and "pretrain/samples" in r]
    steps = [r for r in rewarded if r.get("weight_version", 0) > 0 and "step/trajectories" in r]
    out: dict[str, Any] = {"run_dir": str(run_dir), "policy_steps": len(steps), "pretrain_steps": len(pretrain)}
    if not steps:
        return out
    window = min(window, max(1, len(steps) // 2)) if not pretrain else min(window, len(steps))
    first = pretrain or steps[:window]
    out["reward_before"] = statistics.fmean(r["reward/mean"] for r in first)
    out["reward_before_from"] = "value pre-training rollouts" if pretrain else f"first {len(first)} steps"
    out["reward_after"] = statistics.fmean(r["reward/mean"] for r in steps[-window:])
    out["window"] = window
    out["trajectories"] = int(sum(r.get("step/trajectories", 0) for r in rewarded))
    out["seconds"] = sum(r.get("time/step", 0.0) for r in rewarded)
    out["tokens_per_s"] = sum(r.get("tokens/generated", 0.0) for r in rewarded) / max(out["seconds"], 1e-9)
    out["first_version"] = steps[0]["weight_version"] - 1
    out["final_version"] = steps[-1]["weight_version"]
    return out


def describe(s: dict[str, Any]) -> str:
    if "reward_after" not in s:
        return f"[run] no policy step recorded in {Path(s['run_dir']) / METRICS_FILE}"
    return (f"[run] reward {s['reward_before']:.3f} ({s['reward_before_from']}) -> {s['reward_after']:.3f} (last "
            f"{s['window']} steps); {s['policy_steps']} policy steps after {s['pretrain_steps']} value "
            f"pre-training steps, {s['trajectories']} trajectories, {s['tokens_per_s']:.0f} generated tokens/s over "
            f"{s['seconds']:.0f}s of steps; versions {s['first_version']} -> {s['final_version']}; run dir "
            f"{s['run_dir']} (metrics.jsonl, tensorboard/, reward.png)")  # fmt: skip

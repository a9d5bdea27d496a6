#!/usr/bin/env python
"""Stability: --steps SAO learner steps on the agentic main task (key_chain), one seed, with every off-policy health
figure peers log, plotted over the steps: reward, DIS masked fraction (low / high), ratio mean / max, the
rollout-vs-learner log-prob gap (mean |Δ log-prob| and the k3 mismatch KL), staleness (mean / max), value loss and
explained variance.

Collapse criterion (stated before the run, checked after it): the run collapsed if the learner died or stopped
on non-finite updates, or any step logged a non-finite loss, or the reward's rolling mean over the last --tail
policy steps fell below half of the best rolling mean over any --tail steps of the run (VAPO's and GRPO's
collapses in the paper are falls of the reward to near zero that do not come back). Smaller warning signs are
reported beside it: the mean masked fraction of the last --tail steps, the largest ratio.

The task runs with a small step (--trajectories-per-step, default 4) so that 1000 steps fit in minutes on 2 CPUs;
each step is still K=2 critic updates, one DIS policy update and a weight push.

    python experiments/stability.py              # 1000 steps, ~25 min on 2 CPUs
    python experiments/stability.py --quick      # 12 steps, ~2 min
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.harness import (
    AGENTIC,
    RUNS,
    Run,
    RunSpec,
    add_common_args,
    apply_quick,
    publish,
    pyplot,
    rolling,
    run_arm,
    save_figure,
    warm_agentic_model,
)

QUICK = {"steps": 12, "tail": 4, "pretrain_samples": 8, "tool_latency": 0.0}
PANELS = (
    ("reward", ("reward/mean",), "reward (rolling)"),
    ("masked", ("dis/masked_low_frac", "dis/masked_high_frac"), "DIS masked fraction"),
    ("ratio", ("dis/ratio_mean", "dis/ratio_max"), "ratio r"),
    ("gap", ("dis/logprob_abs_diff", "dis/mismatch_kl"), "rollout vs learner"),
    ("staleness", ("staleness/mean", "staleness/max"), "staleness (versions)"),
    ("value", ("loss/value",), "value loss"),
    ("ev", ("value/explained_variance",), "explained variance"),
    ("grad", ("policy/grad_norm", "value/grad_norm"), "grad norm"),
)


def series(run: Run, key: str) -> tuple[np.ndarray, np.ndarray]:
    rows = [(r["weight_version"], r[key]) for r in run.steps if key in r]
    return (np.array([v for v, _ in rows], dtype=float), np.array([y for _, y in rows], dtype=float))


def verdict(run: Run, tail: int) -> dict[str, Any]:
    """The collapse criterion of the docstring, and the figures it rests on."""
    _, reward = series(run, "reward/mean")
    smooth = rolling(reward, tail)
    best = float(smooth[tail - 1 :].max()) if smooth.size >= tail else float(smooth.max(initial=0.0))
    last = float(smooth[-1]) if smooth.size else 0.0
    nonfinite = max((r.get("policy/nonfinite_updates", 0.0) + r.get("value/nonfinite_updates", 0.0) for r in run.steps),
                    default=0.0)  # fmt: skip
    losses_finite = all(math.isfinite(r.get(k, 0.0)) for r in run.steps for k in ("loss/policy", "loss/value"))
    tail_rows = run.steps[-tail:]
    masked = float(np.mean([r.get("dis/masked_frac", 0.0) for r in tail_rows])) if tail_rows else 0.0
    reached = len(run.steps)
    collapsed = nonfinite > 0 or not losses_finite or last < 0.5 * best or reached < run_steps(run)
    return {
        "policy_steps": reached,
        "first_reward": float(smooth[tail - 1]) if smooth.size >= tail else None,
        "best_tail_reward": best,
        "last_tail_reward": last,
        "nonfinite_updates": nonfinite,
        "losses_finite": losses_finite,
        "masked_frac_last": masked,
        "ratio_max": max((r.get("dis/ratio_max", 0.0) for r in run.steps), default=0.0),
        "staleness_max": max((r.get("staleness/max", 0.0) for r in run.steps), default=0.0),
        "explained_variance_last": float(np.mean([r.get("value/explained_variance", 0.0) for r in tail_rows]))
        if tail_rows
        else None,
        "collapsed": bool(collapsed),
    }


def run_steps(run: Run) -> int:
    """learner.max_steps the run was asked for."""
    o = run.spec.overrides
    return int(o[o.index("--learner.max_steps") + 1])


def plot(run: Run, tail: int, png: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 4, figsize=(16, 6.5), sharex=True)
    for ax, (_, keys, title) in zip(axes.flat, PANELS, strict=True):
        for key in keys:
            x, y = series(run, key)
            if key == "reward/mean":
                ax.plot(x, y, color="C0", alpha=0.2, lw=0.6)
                y = rolling(y, tail)
            ax.plot(x, y, lw=1, label=key)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if len(keys) > 1 or keys[0] == "reward/mean":
            ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("policy version")
    save_figure(fig, png, f"SAO, {len(run.steps)} learner steps on key_chain")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--trajectories-per-step", type=int, default=4)
    p.add_argument("--tail", type=int, default=100, help="steps in the rolling reward of the collapse criterion")
    p.add_argument("--tool-latency", type=float, default=0.0, help="seconds per lookup")
    p.add_argument("--pretrain-samples", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    add_common_args(p, RUNS / "stability", QUICK)
    args = p.parse_args()
    suffix = apply_quick(args, QUICK)
    overrides = [
        "--learner.max_steps", str(args.steps), "--learner.trajectories_per_step", str(args.trajectories_per_step),
        "--learner.save_interval", "250", "--rollout.concurrency", "8", "--bus.max_staleness", "4",
        "--algo.value.pretrain_samples", str(args.pretrain_samples), "--launch.display", "plain",
    ]  # fmt: skip
    model, env = warm_agentic_model(), {"tool_latency_s": args.tool_latency}
    spec = RunSpec("sao", AGENTIC, model, tuple(overrides), args.seed, env_options=env, timeout_s=4 * 3600)
    run = run_arm(spec, args.runs / f"sao-{args.steps}-s{args.seed}", log=lambda m: print(m, flush=True))
    result = verdict(run, args.tail)
    png = args.figures / f"stability{suffix}.png"
    plot(run, args.tail, png)
    rows = "\n".join(f"| {k} | {_fmt(v)} |" for k, v in result.items())
    text = f"| figure | value |\n|---|---|\n| wall time (s) | {run.wall_s:.0f} |\n{rows}"
    held = "**did not collapse**" if not result["collapsed"] else "**collapsed**"
    note = (
        f"Seed {args.seed}; {args.trajectories_per_step} trajectories per step; tool latency {args.tool_latency} s. "
        f"Criterion: collapsed if non-finite updates or losses, fewer steps than asked, or the last {args.tail} "
        f"steps' mean reward below half the best {args.tail}-step mean. The run {held}."
    )
    publish(f"stability{suffix}", args.results, png, text, note, {"wall_s": run.wall_s, **result})


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    main()

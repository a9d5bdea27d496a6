#!/usr/bin/env python
"""Learning efficiency: sao, grpo (synchronous), grpo_async (one-step-off) and running_mean on the agentic main
task, the same generated-token budget per run, seeds paired across arms.

Every run starts from the main job's warm-started tiny MoE (cached under runs/experiments/warm_agentic) on
key_chain (1-6 lookups, long-tailed; each lookup takes --tool-latency seconds), through the real engine, worker,
bus and learner (experiments/harness.py). Settings common to the arms: 16 trajectories per step (grpo arms: 4
prompts x G=4), concurrency 16, bus.max_staleness 4 with rollout admission (the default: nothing generated is
dropped as stale), weights pushed after every step; sao pre-trains its critic on --pretrain-samples trajectories
first (their tokens and time count). Seeds interleave (sao, grpo, ... for seed 0, then seed 1, ...) so a noisy
neighbour hits every arm alike.

The measure (primary, issue 47): the on-policy held-out success of the checkpoint each run stops at when its budget
is spent, on --eval-prompts prompts never trained on, sampled (4 samples each, temperature 1), greedy pass@1 beside
it; not charged to the budget. Secondary: the reward of trained trajectories (rolling mean), the wall time to the
budget, the share of generated tokens trained.

Pre-registered criteria (written 2026-12-07 before the runs with admission and held-out evaluation; differences are
95% paired bootstrap intervals over seeds, experiments/stats.py):
  E1  sao - grpo (held-out) > -0.03: SAO no worse per generated token than synchronous GRPO, value pre-training
      charged (the interval's lower end above -0.03).
  E2  sao - running_mean (held-out) > 0: the critic adds to a streaming baseline of the last rewards.
  E3  grpo - sao (wall seconds to the budget) > 0: streaming spends the same tokens sooner.
With 3 seeds (the pilot) the script also prints the seeds a power-0.8 test of each effect needs (0.03, 0.04, 10 s).

Prints a table, writes the raw runs under runs/experiments/agentic/, the figure and JSON under docs/results/, and
the table into docs/results.md.

    python experiments/learning_efficiency.py            # 4 arms x 3 seeds x 10000 tokens, ~70 min on 2 CPUs
    python experiments/learning_efficiency.py --quick    # 1 seed, 2500 tokens, 16 eval prompts: the pipeline
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.harness import (
    AGENTIC,
    PRIMARY,
    RUNS,
    Run,
    RunSpec,
    add_common_args,
    apply_quick,
    first_reach,
    mean_spread,
    measured,
    on_grid,
    publish,
    pyplot,
    rolling,
    run_arm,
    save_figure,
    warm_agentic_model,
)
from experiments.stats import Criterion, judge, verdict_lines

ARMS = {
    "sao": (),
    "grpo": ("--algo.name", "grpo"),
    "grpo_async": ("--algo.name", "grpo_async"),
    "running_mean": ("--algo.name", "running_mean"),
}
COLORS = {"sao": "C0", "grpo": "C1", "grpo_async": "C2", "running_mean": "C3"}
CRITERIA = (
    Criterion("E1", "sao", "grpo", margin=-0.03, effect=0.03),
    Criterion("E2", "sao", "running_mean", margin=0.0, effect=0.04),
    Criterion("E3", "grpo", "sao", margin=0.0, effect=10.0, measure="wall_s"),
)


def agentic_spec(label: str, arm_overrides: tuple[str, ...], seed: int, args: argparse.Namespace) -> RunSpec:
    """One arm on the agentic task with the settings every arm (and every ablation) shares."""
    common = (
        "--algo.grpo.group_size", "4", "--learner.trajectories_per_step", "16", "--rollout.concurrency", "16",
        "--bus.max_staleness", "4", "--algo.value.pretrain_samples", str(args.pretrain_samples),
    )  # fmt: skip
    return RunSpec(
        label=label,
        config=AGENTIC,
        model=args.model,
        overrides=(*common, *arm_overrides),
        seed=seed,
        token_budget=args.tokens,
        env_options={"tool_latency_s": args.tool_latency},
        eval_prompts=args.eval_prompts,
    )


def add_agentic_args(p: argparse.ArgumentParser, quick: dict[str, Any]) -> None:
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=10_000, help="generated-token budget of every run")
    p.add_argument("--tool-latency", type=float, default=1.0, help="seconds per lookup (key_chain tool_latency_s)")
    p.add_argument("--pretrain-samples", type=int, default=96, help="sao's value pre-training trajectories")
    p.add_argument("--window", type=int, default=64, help="trajectories in the rolling reward mean")
    p.add_argument("--eval-prompts", type=int, default=128, help="held-out prompts of the primary measure (0: none)")
    add_common_args(p, RUNS / "agentic", quick)


QUICK = {"seeds": 1, "tokens": 2500, "tool_latency": 0.1, "pretrain_samples": 16, "window": 8, "eval_prompts": 16}


def curves(runs: list[Run], x: str, window: int, points: int = 200) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rolling reward of each seed on one grid of `x` ("time" or "tokens"): (grid, mean, [seeds, points])."""
    series = [r.reward_series() for r in runs]
    end = max((s[x][-1] for s in series if s[x].size), default=1.0)
    grid = np.linspace(0.0, end, points)
    ys = np.stack([on_grid(s[x], full_windows(rolling(s["reward"], window), window), grid) for s in series])
    with warnings.catch_warnings():  # past a seed's last trajectory its curve is NaN; all-NaN columns stay NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(ys, axis=0)
    return grid, mean, ys


def full_windows(smooth: np.ndarray, window: int) -> np.ndarray:
    """A rolling mean with its first window - 1 points (means of fewer trajectories) blanked."""
    out = smooth.astype(float).copy()
    out[: window - 1] = np.nan
    return out


def summarize(label: str, runs: list[Run], window: int, target: float) -> dict[str, Any]:
    """Per arm: what every seed reached, and when."""
    per_seed = []
    for r in runs:
        s = r.reward_series()
        smooth = rolling(s["reward"], window)
        per_seed.append({
            "seed": r.spec.seed,
            "wall_s": r.wall_s,
            "generated_tokens": float(r.engine[-1, 1]),
            "trajectories": int(s["reward"].size),
            "policy_steps": len(r.steps),
            "first_reward": float(smooth[min(window, smooth.size) - 1]) if smooth.size else None,
            "final_reward": float(smooth[-1]) if smooth.size else None,
            "best_reward": float(smooth.max()) if smooth.size else None,
            "time_to_target_s": first_reach(s["time"], smooth, target, skip=window - 1),
            "tokens_to_target": first_reach(s["tokens"], smooth, target, skip=window - 1),
            "staleness_mean": float(np.mean([st.get("staleness/mean", 0.0) for st in r.steps])) if r.steps else None,
            "staleness_max": max((st.get("staleness/max", 0.0) for st in r.steps), default=None),
            "held_out": r.evals.get("sampled", {}).get(PRIMARY),
            "held_out_greedy": r.evals.get("greedy", {}).get("eval/pass@1"),
            "trained_share": trained_share(r),
            "stale_dropped": max((st.get("bus/stale_dropped", 0.0) for st in r.records), default=0.0),
        })  # fmt: skip
    return {"arm": label, "seeds": per_seed}


def trained_share(run: Run) -> float:
    """Action tokens of trained trajectories (value pre-training's included) over the tokens the engine generated:
    what staleness threw away, with admission close to 1 (the rest: episodes in flight at the budget)."""
    trained = sum(t.get("action_tokens", 0) for t in run.trajectories)
    return trained / max(float(run.engine[-1, 1]), 1.0)


def table(summaries: list[dict[str, Any]], target: float) -> str:
    rows = [
        f"| arm | seeds | held-out success (sampled) | greedy pass@1 | reward first {{w}} → last {{w}} | "
        f"time to {target:g} (s) | tokens to {target:g} | trajectories trained | policy steps | wall (s) | "
        "tokens generated | share trained | staleness mean / max |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        col = {k: [seed[k] for seed in s["seeds"]] for k in s["seeds"][0]}
        rows.append(
            f"| `{s['arm']}` | {len(s['seeds'])} | **{measured(col['held_out'])}** | "
            f"{measured(col['held_out_greedy'])} | "
            f"{mean_spread(col['first_reward'])} → "
            f"{mean_spread(col['final_reward'])} | {mean_spread(col['time_to_target_s'])} | "
            f"{mean_spread(col['tokens_to_target'])} | {mean_spread(col['trajectories'])} | "
            f"{mean_spread(col['policy_steps'])} | {mean_spread(col['wall_s'])} | "
            f"{mean_spread(col['generated_tokens'])} | {mean_spread(col['trained_share'])} | "
            f"{mean_spread(col['staleness_mean'])} / {measured(col['staleness_max'])} |"
        )
    return "\n".join(rows)


def plot(by_arm: dict[str, list[Run]], window: int, target: float, png: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, x, xlabel in ((axes[0], "time", "wall time (s)"), (axes[1], "tokens", "generated tokens")):
        for label, runs in by_arm.items():
            grid, mean, ys = curves(runs, x, window)
            color = COLORS.get(label)
            ax.plot(grid, mean, color=color, label=f"{label} ({len(runs)} seeds)")
            if len(runs) > 1:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    ax.fill_between(grid, np.nanmin(ys, axis=0), np.nanmax(ys, axis=0), color=color, alpha=0.15)
        ax.axhline(target, color="grey", lw=0.8, ls="--")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"reward (mean of the last {window} trained trajectories)")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right")
    save_figure(fig, png, "key_chain (agentic, long-tailed): mean over seeds, band = min..max")


def run_arms(arms: dict[str, tuple[str, ...]], args: argparse.Namespace) -> dict[str, list[Run]]:
    by_arm: dict[str, list[Run]] = {label: [] for label in arms}
    for seed in range(args.seeds):
        for label, overrides in arms.items():
            spec = agentic_spec(label, overrides, seed, args)
            by_arm[label].append(run_arm(spec, args.runs / f"{label}-s{seed}", log=lambda m: print(m, flush=True)))
    return by_arm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_agentic_args(p, QUICK)
    p.add_argument("--target", type=float, default=0.6, help="the reward level whose time and tokens are reported")
    p.add_argument("--arms", default=",".join(ARMS))
    args = p.parse_args()
    suffix = apply_quick(args, QUICK)
    args.model = warm_agentic_model()
    arms = {a: ARMS[a] for a in args.arms.split(",")}
    by_arm = run_arms(arms, args)
    summaries = [summarize(label, runs, args.window, args.target) for label, runs in by_arm.items()]
    png = args.figures / f"learning_efficiency{suffix}.png"
    plot(by_arm, args.window, args.target, png)
    found = judge(CRITERIA, {s["arm"]: s["seeds"] for s in summaries})
    lines = verdict_lines(found) or ["- (no pre-registered comparison among the arms run)"]
    text = table(summaries, args.target).replace("{w}", str(args.window)) + "\n\n" + "\n".join(lines)
    note = (
        f"Seeds {', '.join(map(str, range(args.seeds)))} paired across arms; budget {args.tokens} generated tokens per "
        f"run (sao's value pre-training included); tool latency {args.tool_latency} s per lookup; held-out success = "
        f"the checkpoint at the budget on {args.eval_prompts} held-out prompts x 4 samples at temperature 1 (greedy "
        f"pass@1 beside it), not charged to the budget; reward = rolling mean of {args.window} trained trajectories "
        f"(first {args.window} → last {args.window}); mean ± std over seeds; intervals: 95% paired bootstrap over "
        f"seeds (experiments/stats.py)."
    )
    data = {"args": _jsonable(args), "arms": summaries, "criteria": found}
    publish(f"learning_efficiency{suffix}", args.results, png, text, note, data)


def _jsonable(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Online adaptation: the style reward switches cute -> chuunibyou -> classical during training (every --period
weight versions: the style_preference environment's schedule="version", so a trajectory is scored for the style of
the weights that generated it, and a resumed run goes on with the style of its checkpoint's version), per arm and
seed; per switch, the versions and the wall time each arm needs to recover 90% of its pre-switch reward.

The style example (./launch.sh style: a tiny MoE, one-turn writing, 8 trajectories per step), warm-started on
sentences in all three styles alike (harness.warm_style_model: a model that can write each, as an LLM can),
through the real engine, worker, bus and learner (experiments/harness.py). Reward by generating version: the mean
reward of the trajectories whose newest weight version is v. Pre-switch level of the switch at version s: the mean over
versions [s - period/4, s). Recovered at the first version v >= s whose mean over versions [v - 2, v] (within
the phase) is >= 0.9 x that level; versions to recover = v - s, wall time = from the first trajectory of version
>= s finishing to the first of version v finishing. An arm that never learned the first style (pre-switch level
below --min-level) is reported as such, not as recovered.

    python experiments/online_adaptation.py           # sao, running_mean, grpo x 3 seeds, period 30, ~15 min
    python experiments/online_adaptation.py --quick   # 1 seed, period 3, ~3 min
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.harness import (
    RUNS,
    STYLE,
    STYLES,
    Run,
    RunSpec,
    add_common_args,
    apply_quick,
    mean_spread,
    publish,
    pyplot,
    run_arm,
    save_figure,
    warm_style_model,
)

ARMS = {
    "sao": ("--algo.value.pretrain_samples", "32"),
    "running_mean": ("--algo.name", "running_mean"),
    "grpo": ("--algo.name", "grpo", "--algo.grpo.group_size", "4"),
    "grpo_async": ("--algo.name", "grpo_async", "--algo.grpo.group_size", "4"),
}
COLORS = {"sao": "C0", "grpo": "C1", "grpo_async": "C2", "running_mean": "C3"}
QUICK = {"seeds": 1, "period": 3, "max_new_tokens": 16}


def by_version(run: Run) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(versions, mean reward, first finish time since start) of the trajectories each version generated."""
    s = run.reward_series()
    versions = np.unique(s["version"]).astype(int)
    reward = np.array([s["reward"][s["version"] == v].mean() for v in versions])
    first = np.array([s["time"][s["version"] == v].min() for v in versions])
    return versions, reward, first


def recoveries(run: Run, period: int, min_level: float) -> list[dict[str, Any]]:
    versions, reward, first = by_version(run)
    out = []
    for k in range(1, len(STYLES)):
        switch = k * period
        pre_mask = (versions >= switch - max(1, period // 4)) & (versions < switch)
        phase = (versions >= switch) & (versions < switch + period)
        pre = float(reward[pre_mask].mean()) if pre_mask.any() else float("nan")
        row: dict[str, Any] = {"switch": f"{STYLES[k - 1]} -> {STYLES[k]}", "at_version": switch, "pre_level": pre,
                               "versions": None, "wall_s": None, "post_min": None, "best_fraction": None}  # fmt: skip
        if not phase.any():
            row["status"] = "not reached"
        elif not pre >= min_level:
            row["status"] = "first style not learned"
        else:
            v, r, t = versions[phase], reward[phase], first[phase]
            row["post_min"] = float(r.min())
            smooth = np.array([r[(v >= x - 2) & (v <= x)].mean() for x in v])
            row["best_fraction"] = float(smooth.max() / pre)
            hit = np.flatnonzero(smooth >= 0.9 * pre)
            if hit.size:
                row.update(status="recovered", versions=int(v[hit[0]] - switch), wall_s=float(t[hit[0]] - t[0]))
            else:
                row["status"] = "not recovered"
        out.append(row)
    return out


def table(rows: dict[str, list[list[dict[str, Any]]]]) -> str:
    out = [
        "| arm | switch (at version) | seeds recovered | pre-switch reward | lowest after the switch | "
        "best 3-version mean after it / pre-switch | versions to 90% | wall time to 90% (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm, seeds in rows.items():
        for k in range(len(seeds[0])):
            col = [s[k] for s in seeds]
            ok = sum(c["status"] == "recovered" for c in col)
            notes = sorted({c["status"] for c in col} - {"recovered"})
            out.append(
                f"| `{arm}` | {col[0]['switch']} ({col[0]['at_version']}) | {ok}/{len(col)}"
                f"{' (' + ', '.join(notes) + ')' if notes else ''} | {mean_spread([c['pre_level'] for c in col])} | "
                f"{mean_spread([c['post_min'] for c in col])} | {mean_spread([c['best_fraction'] for c in col])} | "
                f"{mean_spread([c['versions'] for c in col])} | "
                f"{mean_spread([c['wall_s'] for c in col])} |"
            )
    return "\n".join(out)


def plot(by_arm: dict[str, list[Run]], period: int, png: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    for label, runs in by_arm.items():
        for j, run in enumerate(runs):
            versions, reward, first = by_version(run)
            kw = {"color": COLORS.get(label), "lw": 1, "alpha": 0.8, "label": label if j == 0 else None}
            axes[0].plot(versions, reward, **kw)
            axes[1].plot(first, reward, **kw)
            if label == next(iter(by_arm)) and j == 0:  # the switch points in wall time, from the first arm's run
                for k in range(1, len(STYLES)):
                    after = first[versions >= k * period]
                    if after.size:
                        axes[1].axvline(after[0], color="grey", ls="--", lw=0.8)
    for k in range(1, len(STYLES)):
        axes[0].axvline(k * period, color="grey", ls="--", lw=0.8)
    for k, style in enumerate(STYLES):
        axes[0].text((k + 0.5) * period, 1.02, style, ha="center", fontsize=9)
    axes[0].set_xlabel("weight version that generated the trajectory")
    axes[1].set_xlabel("wall time (s); dashed: the first sao run's switches")
    for ax in axes:
        ax.set_ylabel("mean reward")
        ax.set_ylim(-0.02, 1.08)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower left", fontsize=8)
    save_figure(fig, png, "style switches cute -> chuunibyou -> classical (every line a seed)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--period", type=int, default=30, help="weight versions per style")
    p.add_argument("--arms", default="sao,running_mean,grpo")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--lr", type=float, default=5e-4, help="policy learning rate (the warm model's; every arm)")
    p.add_argument("--min-level", type=float, default=0.3, help="a pre-switch reward below this: style not learned")
    add_common_args(p, RUNS / "style", QUICK)
    args = p.parse_args()
    suffix = apply_quick(args, QUICK)
    model = warm_style_model()
    arms = {a: ARMS[a] for a in args.arms.split(",")}
    by_arm: dict[str, list[Run]] = {a: [] for a in arms}
    for seed in range(args.seeds):
        for label, overrides in arms.items():
            steps = ("--learner.max_steps", str(len(STYLES) * args.period))
            tokens = ("--rollout.sampling.max_new_tokens", str(args.max_new_tokens))
            tokens += ("--learner.policy.lr", str(args.lr), "--learner.value.lr", str(5 * args.lr))  # critic 5x
            schedule = {"styles": STYLES, "period": args.period, "schedule": "version"}
            spec = RunSpec(label, STYLE, model, (*overrides, *steps, *tokens), seed, env_options=schedule)
            by_arm[label].append(run_arm(spec, args.runs / f"{label}-s{seed}", log=lambda m: print(m, flush=True)))
    rows = {label: [recoveries(r, args.period, args.min_level) for r in runs] for label, runs in by_arm.items()}
    png = args.figures / f"online_adaptation{suffix}.png"
    plot(by_arm, args.period, png)
    text = table(rows)
    walls = {label: [r.wall_s for r in runs] for label, runs in by_arm.items()}
    note = (
        f"Seeds {', '.join(map(str, range(args.seeds)))}; a switch every {args.period} versions "
        f"({len(STYLES) * args.period} versions per run); policy lr {args.lr}, critic lr {5 * args.lr} (5x), value "
        "clip 0.5 (algo.value.clip, rewards in [0, 1]); run wall times (s): "
        + "; ".join(f"{label} {mean_spread(w)}" for label, w in walls.items())
        + "."
    )
    data = {"period": args.period, "lr": args.lr, "recoveries": rows, "wall_s": walls}
    publish(f"online_adaptation{suffix}", args.results, png, text, note, data)


if __name__ == "__main__":
    main()

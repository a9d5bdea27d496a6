#!/usr/bin/env python
"""Where a critic can matter: key_chain with its difficulty in the prompt. Does SAO's learned value beat a running
mean there, and how close does it get to an oracle that knows the difficulty?

The task: chains of 1..6 lookups drawn alike, the prompt ending with the chain's length (`(hops: 3)`), and a model
warm-started on a demonstrator that errs more the longer the chain (key_chain `mistakes_by_hops`), so success falls
with the length. A prompt-level baseline can only help when the difficulty explains a good part of the reward's
variance: the script first measures that share (R^2 of reward on difficulty, from the ledger of a probe of the
initial policy's rollouts) and goes on only at >= --min-r2 (printed, and in the JSON).

Arms, the same settings for all (16 trajectories per step, concurrency 16, bus.max_staleness 4, weights pushed
every step, the same generated-token budget; value pre-training's tokens and time count for the sao arms):
  running_mean   one stream of the last 8 rewards
  oracle_mean    a running mean of 8 per difficulty (algo.running_mean.group_by hops): the ceiling of any prompt-level
                 baseline
  sao            the fixed critic (zero head + mean-return bias, honest pre-training stop, critic lr 5x, clip 0.5)
  sao_whiten     the same, advantages whitened over each step's action tokens
  grpo           synchronous, G = 4
Reported per arm (mean ± std over seeds): final reward against policy steps, generated tokens and wall time, the
share of trajectories dropped as stale, the honest explained variance (all tokens, first action token) and how
well the first action token's value tracks the success rate of each difficulty (over the run's second half).

    python experiments/critic_matters.py            # probe + 5 arms x 3 seeds x 20000 tokens, ~90 min on 2 CPUs
    python experiments/critic_matters.py --quick    # probe + 1 seed x 1500 tokens: the pipeline end to end
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections import defaultdict
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
    mean_spread,
    on_grid,
    publish,
    pyplot,
    rolling,
    run_arm,
    save_figure,
    warm_agentic_model,
)

MISTAKES_BY_HOPS = [0.0, 0.01, 0.05, 0.25, 0.4, 0.5]
"""The demonstrator's per-turn mistake rate by chain length: its success (1 - m)^(h + 1) is 1, 0.97, 0.81, 0.24,
0.05, 0.01 (the first table tried, 0.02 .. 0.35, gave the warm model success 0.73 .. 0.07 and R^2 = 0.25)."""
WARM = ("--steps", "1200", "--demos", "4000")
"""A longer warm start than the main job's, so the model imitates the demonstrator's rates more closely."""
TASK = {"hops": "uniform", "show_hops": True, "mistakes_by_hops": MISTAKES_BY_HOPS}
ARMS = {
    "running_mean": ("--algo.name", "running_mean"),
    "oracle_mean": ("--algo.name", "running_mean", "--algo.running_mean.group_by", "hops"),
    "sao": (),
    "sao_whiten": ("--algo.gae.whiten_advantages", "true"),
    "grpo": ("--algo.name", "grpo"),
}
COLORS = {"running_mean": "C3", "oracle_mean": "C5", "sao": "C0", "sao_whiten": "C4", "grpo": "C1"}
CRITIC_ARMS = ("sao", "sao_whiten")
QUICK = {"seeds": 1, "tokens": 2500, "tool_latency": 0.1, "pretrain_samples": 16, "window": 8, "probe": 64,
         "min_r2": 0.0, "eval_prompts": 16}  # fmt: skip


def common(args: argparse.Namespace) -> tuple[str, ...]:
    """What every arm shares (the sao arms' pre-training settings are stated here once, for both)."""
    return (
        "--algo.grpo.group_size", "4", "--learner.trajectories_per_step", "16", "--rollout.concurrency", "16",
        "--bus.max_staleness", "4", "--algo.value.pretrain_samples", str(args.pretrain_samples),
        "--algo.value.pretrain_buffer_batches", "4", "--algo.value.pretrain_passes", "2",
        "--algo.value.pretrain_plateau_steps", "3",
    )  # fmt: skip


def spec(label: str, overrides: tuple[str, ...], seed: int, args: argparse.Namespace, **kw: Any) -> RunSpec:
    env = {**TASK, "tool_latency_s": args.tool_latency}
    return RunSpec(label, AGENTIC, args.model, (*common(args), *overrides), seed, env_options=env, **kw)


# ------------------------------------------------------------------------------------------------- the probe


def probe(args: argparse.Namespace) -> dict[str, Any]:
    """The initial policy's rollouts (a run that only pre-trains its critic on --probe trajectories and takes one
    policy step): per difficulty the success rate, and the share of the reward's variance the difficulty explains."""
    overrides = ("--algo.value.pretrain_samples", str(args.probe), "--algo.value.pretrain_plateau_steps", "0",
                 "--algo.value.pretrain_passes", "1", "--algo.value.pretrain_buffer_batches", "1",
                 "--learner.max_steps", "1")  # fmt: skip
    run = run_arm(spec("probe", overrides, 0, args), args.runs / "probe", log=lambda m: print(m, flush=True))
    rows = [(t["metadata"]["hops"], t["reward"]) for t in run.trajectories if t.get("pretrain")]
    by_hops: dict[int, list[float]] = defaultdict(list)
    for hops, reward in rows:
        by_hops[int(hops)].append(float(reward))
    rewards = np.array([r for _, r in rows])
    means = {h: float(np.mean(v)) for h, v in sorted(by_hops.items())}
    fitted = np.array([means[int(h)] for h, _ in rows])
    total = float(np.var(rewards))
    r2 = float(np.var(fitted) / total) if total > 0 else 0.0  # between-difficulty share of the variance
    return {"trajectories": len(rows), "success_by_hops": means, "count_by_hops": {h: len(v) for h, v in
            sorted(by_hops.items())}, "r2": r2, "reward_mean": float(rewards.mean())}  # fmt: skip


# --------------------------------------------------------------------------------------------- the summaries


def _second_half(run: Run) -> list[dict[str, Any]]:
    trained = [t for t in run.trajectories if not t.get("pretrain")]
    return trained[len(trained) // 2 :]


def value_tracking(run: Run) -> dict[str, Any] | None:
    """Over the run's second half: per difficulty the mean first-action-token value and the success rate; their
    correlation across difficulties and mean absolute gap (a critic that tracks difficulty: r near 1, gap small)."""
    rows = [t for t in _second_half(run) if "value_first" in t]
    if not rows:
        return None
    by: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for t in rows:
        by[int(t["metadata"]["hops"])].append((t["value_first"], t["reward"]))
    hops = sorted(by)
    value = np.array([np.mean([v for v, _ in by[h]]) for h in hops])
    success = np.array([np.mean([r for _, r in by[h]]) for h in hops])
    corr = float(np.corrcoef(value, success)[0, 1]) if len(hops) > 2 and value.std() > 0 else None
    return {"hops": hops, "value": value.tolist(), "success": success.tolist(), "corr": corr,
            "gap": float(np.abs(value - success).mean())}  # fmt: skip


def stale_fraction(run: Run) -> float | None:
    """Of the trajectories that reached the learner, the share it dropped as too stale."""
    from megatron_sao.run.ledger import check_ledger

    report = check_ledger(run.run_dir)
    arrived = report.consumed + report.stale_dropped  # what reached the learner before the budget stopped the run
    return report.stale_dropped / arrived if arrived else None


def summarize(label: str, runs: list[Run], window: int) -> dict[str, Any]:
    per_seed = []
    for r in runs:
        s = r.reward_series()
        smooth = rolling(s["reward"], window)
        tail = r.steps[len(r.steps) // 2 :]
        ev = [st["value/explained_variance"] for st in tail if "value/explained_variance" in st]
        ev_first = [st["value/explained_variance_first_token"] for st in tail
                    if "value/explained_variance_first_token" in st]  # fmt: skip
        pretrain = [t for t in r.trajectories if t.get("pretrain")]
        per_seed.append({
            "seed": r.spec.seed, "held_out": r.evals.get("sampled", {}).get(PRIMARY),
            "held_out_greedy": r.evals.get("greedy", {}).get("eval/pass@1"),
            "wall_s": r.wall_s, "generated_tokens": float(r.engine[-1, 1]),
            "policy_steps": len(r.steps), "trajectories": int(s["reward"].size),
            "pretrain_trajectories": len(pretrain),
            "pretrain_tokens": float(r.tokens_at(np.array([max((t["finished_at"] - r.start for t in pretrain),
                                                               default=0.0)]))[0]),
            "final_reward": float(smooth[-1]) if smooth.size else None,
            "best_reward": float(smooth[window - 1 :].max()) if smooth.size >= window else None,  # full windows
            "second_half_reward": float(np.mean([t["reward"] for t in _second_half(r)])) if smooth.size else None,
            "stale_fraction": stale_fraction(r),
            "explained_variance": float(np.mean(ev)) if ev else None,
            "explained_variance_first_token": float(np.mean(ev_first)) if ev_first else None,
            "value_tracking": value_tracking(r),
        })  # fmt: skip
    return {"arm": label, "seeds": per_seed}


def table(summaries: list[dict[str, Any]]) -> str:
    rows = [
        "| arm | seeds | held-out success (sampled) | greedy pass@1 | final reward | best reward | 2nd-half reward | "
        "policy steps | tokens (pre-training) | wall (s) | stale dropped | EV (2nd half) | EV first token | "
        "V(first) vs success: r / gap |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(values: list[Any]) -> str:
        return "–" if all(v is None for v in values) else mean_spread(values)

    for s in summaries:
        col = {k: [seed[k] for seed in s["seeds"]] for k in s["seeds"][0]}
        track = [t for t in col["value_tracking"] if t is not None]
        tracking = "–"
        if track:
            corr = mean_spread([t["corr"] for t in track])
            tracking = f"{corr} / {mean_spread([t['gap'] for t in track])}"
        stale = [f * 100 for f in col["stale_fraction"] if f is not None]
        rows.append(
            f"| `{s['arm']}` | {len(s['seeds'])} | **{cell(col['held_out'])}** | {cell(col['held_out_greedy'])} | "
            f"{cell(col['final_reward'])} | {cell(col['best_reward'])} | "
            f"{cell(col['second_half_reward'])} | {cell(col['policy_steps'])} | "
            f"{cell(col['generated_tokens'])} ({cell(col['pretrain_tokens'])}) | "
            f"{cell(col['wall_s'])} | {cell(stale)}% | {cell(col['explained_variance'])} | "
            f"{cell(col['explained_variance_first_token'])} | {tracking} |"
        )
    return "\n".join(rows)


def _steps_series(run: Run) -> tuple[np.ndarray, np.ndarray]:
    """Reward of the trained trajectories against the policy version that trained them."""
    rows = [t for t in run.trajectories if not t.get("pretrain")]
    return np.array([t["step_version"] for t in rows], dtype=float), np.array([t["reward"] for t in rows], float)


def plot(by_arm: dict[str, list[Run]], window: int, png: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    for ax, x, xlabel in ((axes[0], "steps", "policy steps"), (axes[1], "tokens", "generated tokens (all)"),
                          (axes[2], "time", "wall time (s)")):  # fmt: skip
        for label, runs in by_arm.items():
            series = []
            for r in runs:
                if x == "steps":
                    xs, ys = _steps_series(r)
                else:
                    s = r.reward_series()
                    xs, ys = s[x], s["reward"]
                series.append((xs, rolling(ys, window)))
            end = max((xs[-1] for xs, _ in series if xs.size), default=1.0)
            grid = np.linspace(0.0, end, 200)
            stack = np.stack([on_grid(xs, ys, grid) for xs, ys in series])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                ax.plot(grid, np.nanmean(stack, axis=0), color=COLORS.get(label), label=f"{label} ({len(runs)})")
                if len(runs) > 1:
                    ax.fill_between(grid, np.nanmin(stack, axis=0), np.nanmax(stack, axis=0), color=COLORS.get(label),
                                    alpha=0.12)  # fmt: skip
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"reward (rolling {window})")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    ax = axes[3]
    for label in CRITIC_ARMS:
        for i, r in enumerate(by_arm.get(label, [])):
            track = value_tracking(r)
            if track:
                ax.plot(track["hops"], track["value"], "o-", color=COLORS[label], alpha=0.7,
                        label=f"{label}: V(first token)" if i == 0 else None)  # fmt: skip
                ax.plot(track["hops"], track["success"], "x--", color=COLORS[label], alpha=0.5,
                        label=f"{label}: success rate" if i == 0 else None)  # fmt: skip
    ax.set_xlabel("chain length (hops, shown in the prompt)")
    ax.set_ylabel("2nd half of each run")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, png, "key_chain with visible difficulty: mean over seeds, band = min..max")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=20_000, help="generated-token budget of every run")
    p.add_argument("--tool-latency", type=float, default=0.5, help="seconds per lookup")
    p.add_argument("--pretrain-samples", type=int, default=96, help="the sao arms' value pre-training budget")
    p.add_argument("--window", type=int, default=64, help="trajectories in the rolling reward mean")
    p.add_argument("--probe", type=int, default=256, help="initial-policy trajectories the probe measures")
    p.add_argument("--min-r2", type=float, default=0.4, help="go on only if difficulty explains this much")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--eval-prompts", type=int, default=128, help="held-out prompts of the primary measure (0: none)")
    add_common_args(p, RUNS / "critic_matters", QUICK)
    args = p.parse_args()
    suffix = apply_quick(args, QUICK)
    args.model = warm_agentic_model(env_options=TASK, name="warm_hops", warm_args=WARM)
    found = probe(args)
    print(f"probe: {found['trajectories']} rollouts of the initial policy; success by hops "
          + ", ".join(f"{h}: {v:.2f}" for h, v in found["success_by_hops"].items())
          + f"; difficulty explains R^2 = {found['r2']:.3f} of the reward variance", flush=True)  # fmt: skip
    if found["r2"] < args.min_r2:
        raise SystemExit(f"R^2 = {found['r2']:.3f} < --min-r2 {args.min_r2}: a prompt-level baseline has too little "
                         "to explain on this task; change MISTAKES_BY_HOPS (or the task) until it does")  # fmt: skip
    arms = {a: ARMS[a] for a in args.arms.split(",")}
    by_arm: dict[str, list[Run]] = {label: [] for label in arms}
    for seed in range(args.seeds):
        for label, overrides in arms.items():
            run_spec = spec(label, overrides, seed, args, token_budget=args.tokens, eval_prompts=args.eval_prompts)
            by_arm[label].append(run_arm(run_spec, args.runs / f"{label}-s{seed}", log=lambda m: print(m, flush=True)))
    summaries = [summarize(label, runs, args.window) for label, runs in by_arm.items()]
    png = args.figures / f"critic_matters{suffix}.png"
    plot(by_arm, args.window, png)
    text = table(summaries)
    note = (
        f"Probe: {found['trajectories']} rollouts of the initial policy, success by hops "
        + ", ".join(f"{h}: {v:.2f}" for h, v in found["success_by_hops"].items())
        + f"; the difficulty explains **R^2 = {found['r2']:.2f}** of the reward variance. Seeds "
        f"{', '.join(map(str, range(args.seeds)))}; budget {args.tokens} generated tokens per run (pre-training's "
        f"included, shown in brackets); tool latency {args.tool_latency} s per lookup; final / best reward = rolling "
        f"mean of {args.window} trained trajectories (best: over full windows), 2nd-half reward = mean over each run's "
        "second half of its trained trajectories; EV and V(first) over that half too; held-out success (the primary "
        f"measure) = the checkpoint at the budget on {args.eval_prompts} held-out prompts x 4 samples at temperature "
        "1, greedy pass@1 beside it, not charged to the budget; mean ± std over seeds."
    )
    data = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "probe": found,
            "arms": summaries}  # fmt: skip
    publish(f"critic_matters{suffix}", args.results, png, text, note, data)


if __name__ == "__main__":
    main()

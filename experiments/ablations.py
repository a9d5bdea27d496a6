#!/usr/bin/env python
"""Ablations: SAO with one of its four mechanisms off at a time, on the learning-efficiency task and budget, several
seeds: final reward and the stability figures side by side.

    plain_is                  algo.dis.mask=false: plain importance sampling instead of the DIS mask
    k1                        algo.value.updates_per_policy_step=1 instead of K=2
    critic_attention          the critic's attention trainable (moved from learner.value.frozen to .trainable)
    gae_through_observations  algo.gae.skip_observations=false: GAE (and the critic) over observation tokens too

The `sao` row is the learning-efficiency `sao` arm: the same runs (runs/experiments/agentic/sao-s*), trained once
(experiments/harness.py reads a finished run back), with the same settings (rollout admission, seeds paired). The
measure (primary, issue 47): the held-out success of the checkpoint at the budget (sampled, 4 samples of each of
--eval-prompts prompts; greedy beside it), as in experiments/learning_efficiency.py. Stability figures per run, over
its policy steps: DIS masked fraction, mean |learner - rollout| log-prob, largest ratio, explained variance and value
loss over the last half, non-finite updates, and the final trained reward (secondary).

Pre-registered (written 2026-12-07 before the rerun; 95% paired bootstrap over seeds, experiments/stats.py): for each
variant V, "the mechanism V turns off helps at this scale" holds when sao - V (held-out) has its interval above 0
(effect for the power analysis: 0.04). An interval across 0 says the seeds cannot tell, not that it does not help.

Prints the table, writes the figure and JSON under docs/results/ and the table into docs/results.md.

    python experiments/ablations.py            # 4 ablations x 3 seeds x 10000 tokens (+ the sao arm), ~60 min
    python experiments/ablations.py --quick    # 1 seed, 2500 tokens, 16 eval prompts
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.harness import (
    PRIMARY,
    Run,
    apply_quick,
    mean_spread,
    measured,
    publish,
    pyplot,
    rolling,
    save_figure,
    warm_agentic_model,
)
from experiments.learning_efficiency import QUICK, add_agentic_args, full_windows, run_arms
from experiments.stats import Criterion, judge, verdict_lines

CRITIC_MLPS = '"*.mlp.experts.*", "*.mlp.shared_experts.*", "*.mlp.linear_fc*", "output_layer.*"'
VARIANTS: dict[str, tuple[str, ...]] = {
    "sao": (),
    "plain_is": ("--algo.dis.mask", "false"),
    "k1": ("--algo.value.updates_per_policy_step", "1"),
    "critic_attention": (
        "--learner.value.trainable",
        f'[{CRITIC_MLPS}, "*.self_attention.*"]',
        "--learner.value.frozen",
        '["*.router.*", "*norm*", "embedding.*"]',
    ),
    "gae_through_observations": ("--algo.gae.skip_observations", "false"),
}
CRITERIA = tuple(Criterion(v, "sao", v, margin=0.0, effect=0.04) for v in VARIANTS if v != "sao")
WHAT = {
    "sao": "SAO (DIS, K=2, frozen critic attention, GAE skipping observations)",
    "plain_is": "plain IS instead of the DIS mask",
    "k1": "K=1 critic update per policy step",
    "critic_attention": "critic attention trainable",
    "gae_through_observations": "GAE through observation tokens",
}


def stability(run: Run, window: int) -> dict[str, Any]:
    steps = run.steps
    half = steps[len(steps) // 2 :] or steps

    def mean(key: str, rows: list[dict[str, Any]] = steps) -> float | None:
        got = [r[key] for r in rows if key in r and np.isfinite(r[key])]
        return float(statistics.fmean(got)) if got else None

    smooth = rolling(run.reward_series()["reward"], window)[window - 1 :]  # full windows only
    nonfinite = max((r.get("policy/nonfinite_updates", 0.0) + r.get("value/nonfinite_updates", 0.0) for r in steps),
                    default=0.0)  # fmt: skip
    return {
        "seed": run.spec.seed,
        "held_out": run.evals.get("sampled", {}).get(PRIMARY),
        "held_out_greedy": run.evals.get("greedy", {}).get("eval/pass@1"),
        "final_reward": float(smooth[-1]) if smooth.size else None,
        "best_reward": float(smooth.max()) if smooth.size else None,
        "masked_frac": mean("dis/masked_frac"),
        "logprob_gap": mean("dis/logprob_abs_diff"),
        "ratio_max": max((r.get("dis/ratio_max", 0.0) for r in steps), default=None),
        "explained_variance": mean("value/explained_variance", half),
        "value_loss": mean("loss/value", half),
        "nonfinite_updates": nonfinite,
        "policy_steps": len(steps),
        "wall_s": run.wall_s,
    }


def table(rows: dict[str, list[dict[str, Any]]]) -> str:
    out = [
        "| variant | seeds | held-out success (sampled) | greedy pass@1 | final trained reward | DIS masked frac | "
        "\\|Δ log-prob\\| | max ratio | explained var (2nd half) | value loss (2nd half) | non-finite updates | "
        "wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, seeds in rows.items():
        col = {k: [s[k] for s in seeds] for k in seeds[0]}
        out.append(
            f"| `{label}`: {WHAT[label]} | {len(seeds)} | **{measured(col['held_out'])}** | "
            f"{measured(col['held_out_greedy'])} | {mean_spread(col['final_reward'])} | "
            f"{mean_spread(col['masked_frac'])} | "
            f"{mean_spread(col['logprob_gap'])} | {mean_spread(col['ratio_max'])} | "
            f"{mean_spread(col['explained_variance'])} | {mean_spread(col['value_loss'])} | "
            f"{mean_spread(col['nonfinite_updates'])} | {mean_spread(col['wall_s'])} |"
        )
    return "\n".join(out)


def plot(by_variant: dict[str, list[Run]], rows: dict[str, list[dict[str, Any]]], window: int, png: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    labels = list(rows)
    x = np.arange(len(labels))
    for ax, key, title in (
        (axes[1], "held_out", "held-out success (sampled)"),
        (axes[2], "masked_frac", "DIS masked fraction"),
        (axes[3], "explained_variance", "explained variance (2nd half)"),
    ):
        vals = [[s[key] for s in rows[label] if s[key] is not None] for label in labels]
        ax.bar(x, [np.mean(v) if v else 0.0 for v in vals], color=[f"C{i}" for i in range(len(labels))], alpha=0.7)
        for i, v in enumerate(vals):
            ax.scatter([i] * len(v), v, color="k", s=10, zorder=3)
        ax.set_xticks(x, labels, rotation=30, ha="right")
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
    for i, label in enumerate(labels):
        for j, run in enumerate(by_variant[label]):
            s = run.reward_series()
            axes[0].plot(s["tokens"], full_windows(rolling(s["reward"], window), window), color=f"C{i}", lw=1,
                         label=label if j == 0 else None)  # fmt: skip
    axes[0].set_xlabel("generated tokens")
    axes[0].set_ylabel(f"reward (rolling {window})")
    axes[0].legend(fontsize=7)
    axes[0].grid(alpha=0.3)
    save_figure(fig, png, "SAO ablations on key_chain: one mechanism off at a time (dots = seeds)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_agentic_args(p, QUICK)
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args()
    suffix = apply_quick(args, QUICK)
    args.model = warm_agentic_model()
    variants = {v: VARIANTS[v] for v in args.variants.split(",")}
    by_variant = run_arms(variants, args)
    rows = {label: [stability(r, args.window) for r in runs] for label, runs in by_variant.items()}
    png = args.figures / f"ablations{suffix}.png"
    plot(by_variant, rows, args.window, png)
    found = judge(CRITERIA, rows)
    text = table(rows) + "\n\n" + "\n".join(verdict_lines(found) or ["- (no pre-registered comparison run)"])
    note = (
        f"Seeds {', '.join(map(str, range(args.seeds)))} paired across variants; budget {args.tokens} generated "
        f"tokens per run (the learning-efficiency budget); held-out success = the checkpoint at the budget on "
        f"{args.eval_prompts} held-out prompts x 4 samples at temperature 1; trained reward = rolling mean of "
        f"{args.window} trained trajectories; mean ± std over seeds; intervals: 95% paired bootstrap over seeds."
    )
    publish(f"ablations{suffix}", args.results, png, text, note, {"variants": rows, "criteria": found})


if __name__ == "__main__":
    main()

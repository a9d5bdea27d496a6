"""`python -m megatron_sao plot RUN_DIR [RUN_DIR ...] [--out DIR] [--labels A,B]`: PNGs of runs from their
metrics.jsonl -- reward (held-out evaluations beside it, when the run had them), DIS masked fraction, staleness,
losses, explained variance, throughput -- several runs overlaid, each labelled (its directory name unless --labels).
The main job writes <run_dir>/reward.png at its end."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_sao.files import read_records

FIGURES: dict[str, tuple[str, tuple[str, ...]]] = {
    # file stem -> (title, metric keys drawn against the step)
    "reward": ("reward (mean of the step's trajectories)", ("reward/mean",)),
    "masked_fraction": ("DIS masked fraction", ("dis/masked_frac", "dis/masked_low_frac", "dis/masked_high_frac")),
    "staleness": ("staleness (versions behind the learner)", ("staleness/mean", "staleness/max")),
    "losses": ("losses", ("loss/policy", "loss/value")),
    "explained_variance": ("critic explained variance", ("value/explained_variance",)),
    "throughput": ("throughput (generated tokens / s)", ("throughput/tokens_per_s",)),
}
EVAL_OVERLAYS: dict[str, tuple[str, ...]] = {"reward": ("eval/reward/mean", "eval/pass@1")}
"""Evaluation records (eval/*) drawn as markers beside a figure's step curves, at the step each was written."""


def _records(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run directory (launch.run_dir)?")
    return [r for r in read_records(path) if r.get("event") != "unreadable"]


def read_steps(run_dir: str | Path) -> list[dict[str, Any]]:
    """The step records of a run (pushes between steps and evaluations left out)."""
    return [r for r in _records(run_dir) if "step/trajectories" in r]


def read_evals(run_dir: str | Path) -> list[dict[str, Any]]:
    """The evaluation records of a run (eval.interval > 0)."""
    return [r for r in _records(run_dir) if "eval/weight_version" in r]


def plot_runs(
    run_dirs: Sequence[str | Path], out_dir: str | Path, labels: Sequence[str] | None = None,
    figures: Sequence[str] | None = None,
) -> list[Path]:  # fmt: skip
    """Write one PNG per figure that any run has data for; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(labels) if labels else [Path(d).name for d in run_dirs]
    if len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} runs: give one label per run")
    runs = [(label, read_steps(d)) for label, d in zip(labels, run_dirs, strict=True)]
    evals = [read_evals(d) for d in run_dirs]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for stem in figures or list(FIGURES):
        title, keys = FIGURES[stem]
        fig, ax = plt.subplots(figsize=(7, 4))
        drawn = 0
        for label, steps in runs:
            for key in keys:
                points = [(r.get("step", i + 1), r[key]) for i, r in enumerate(steps) if key in r]  # old: no step
                if points:
                    xs, ys = zip(*points, strict=True)
                    name = label if len(keys) == 1 else f"{label}: {key}"
                    ax.plot(xs, ys, label=name, linewidth=1.2)
                    drawn += 1
        for (label, _), records in zip(runs, evals, strict=True):
            for key in EVAL_OVERLAYS.get(stem, ()):
                points = [(r["step"], r[key]) for r in records if key in r]
                if points:
                    xs, ys = zip(*points, strict=True)
                    ax.plot(xs, ys, marker="o", linestyle="--", linewidth=0.8, label=f"{label}: held-out {key}")
        if drawn:
            ax.set_title(title)
            ax.set_xlabel("learner step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            path = out / f"{stem}.png"
            fig.savefig(path, dpi=100)
            written.append(path)
        plt.close(fig)
    return written

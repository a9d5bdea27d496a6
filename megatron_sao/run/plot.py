"""`python -m megatron_sao plot RUN_DIR [RUN_DIR ...] [--out DIR] [--labels A,B]`: PNGs of runs from their
metrics.jsonl -- reward (held-out evaluations beside it, when the run had them), DIS masked fraction, staleness,
losses, explained variance, throughput per step and per wall second -- several runs overlaid, each labelled (its
directory name unless --labels), each curve's raw points faint under its rolling mean, both axes labelled. The main
job writes <run_dir>/reward.png at its end."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_sao.files import METRICS_FILE, read_records

FIGURES: dict[str, tuple[str, tuple[str, ...], str]] = {
    # file stem -> (title, metric keys drawn against the step, the y axis)
    "reward": ("reward (mean of the step's trajectories)", ("reward/mean",), "reward"),
    "masked_fraction": ("DIS masked fraction", ("dis/masked_frac", "dis/masked_low_frac", "dis/masked_high_frac"),
                        "fraction of action tokens"),
    "staleness": ("staleness (versions behind the learner)", ("staleness/mean", "staleness/max"), "versions"),
    "losses": ("losses", ("loss/policy", "loss/value"), "loss"),
    "explained_variance": ("critic explained variance", ("value/explained_variance",), "explained variance"),
    "throughput": ("throughput per step (generated tokens / step seconds)", ("throughput/tokens_per_s",),
                   "tokens / s"),
    "throughput_wall": ("throughput per wall second (all of a step's tokens / seconds since the last step)",
                        ("step/tokens",), "tokens / s"),
}  # fmt: skip
WALL = {"throughput_wall"}
"""Figures drawn against wall-clock minutes since the run's first record, as a rate over the time between records."""
EVAL_OVERLAYS: dict[str, tuple[str, ...]] = {"reward": ("eval/reward/mean", "eval/pass@1")}
"""Evaluation records (eval/*) drawn as markers beside a figure's step curves, at the step each was written."""


def rolling_mean(ys: Sequence[float], window: int) -> list[float]:
    """The mean of each point and the (up to) window - 1 before it: the smoothed curve drawn over the raw points."""
    import numpy as np

    values = np.asarray(ys, dtype=float)
    sums = np.cumsum(np.insert(values, 0, 0.0))
    lo = np.maximum(np.arange(1, len(values) + 1) - window, 0)
    return list((sums[1:] - sums[lo]) / (np.arange(1, len(values) + 1) - lo))


def smoothing_window(n: int) -> int:
    """About a tenth of the points, at least 1 (nothing smoothed) and at most 50."""
    return max(1, min(50, n // 10))


def _records(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
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
        fig = figure(stem, runs, evals)
        if fig is not None:
            path = out / f"{stem}.png"
            fig.savefig(path, dpi=100)
            written.append(path)
            plt.close(fig)
    return written


def _points(stem: str, key: str, steps: list[dict[str, Any]]) -> list[tuple[float, float]]:
    if stem not in WALL:
        return [(r.get("step", i + 1), r[key]) for i, r in enumerate(steps) if key in r]  # old records: no step
    timed = [r for r in steps if key in r and "time" in r]
    t0 = timed[0]["time"] - timed[0].get("time/step", 0.0) if timed else 0.0
    out, last = [], t0
    for r in timed:
        if r["time"] > last:
            out.append(((r["time"] - t0) / 60, r[key] / (r["time"] - last)))
        last = r["time"]
    return out


def figure(stem: str, runs: Sequence[tuple[str, list[dict[str, Any]]]],
           evals: Sequence[list[dict[str, Any]]]) -> Any:  # fmt: skip
    """One figure (matplotlib) of `runs` [(label, step records)], or None when none has its data: each curve's raw
    points faint, its rolling mean (smoothing_window) drawn over them; axes labelled."""
    import matplotlib.pyplot as plt

    title, keys, ylabel = FIGURES[stem]
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = 0
    for label, steps in runs:
        for key in keys:
            points = _points(stem, key, steps)
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            name = label if len(keys) == 1 else f"{label}: {key}"
            window = smoothing_window(len(ys))
            if window > 1:
                raw = ax.plot(xs, ys, linewidth=0.6, alpha=0.3)[0]
                ax.plot(xs, rolling_mean(ys, window), color=raw.get_color(), linewidth=1.5,
                        label=f"{name} (mean of {window})")  # fmt: skip
            else:
                ax.plot(xs, ys, linewidth=1.2, label=name)
            drawn += 1
    for (label, _), records in zip(runs, evals, strict=True):
        for key in EVAL_OVERLAYS.get(stem, ()):
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", linestyle="--", linewidth=0.8, label=f"{label}: held-out {key}")
    if not drawn:
        plt.close(fig)
        return None
    ax.set_title(title)
    ax.set_xlabel("wall-clock minutes" if stem in WALL else "learner step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig

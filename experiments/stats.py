"""The statistics every experiment reports (docs/results.md, ../shared/notes/experiments.md): arms compared on the
same seeds, the difference per seed resampled (paired bootstrap) for a 95% interval, and the number of seeds a
comparison needs for a stated power, from a pilot's spread of those differences.

Owned here: `paired_bootstrap` (the interval of the mean paired difference), `seeds_needed` (a pilot's power
analysis), `smallest_detectable` (what n seeds can tell apart) and the pre-registered comparisons (`Criterion`,
`judge`, `verdict_lines`). Called by the experiment scripts; numpy and the
standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist, fmean, stdev
from typing import Any

import numpy as np


@dataclass(frozen=True)
class PairedDifference:
    """Arm a minus arm b over the seeds both ran: the mean difference and its bootstrap interval."""

    mean: float
    low: float
    high: float
    n: int
    level: float

    def above_zero(self) -> bool:
        return self.low > 0

    def __str__(self) -> str:
        return f"{self.mean:+.3f} [{self.low:+.3f}, {self.high:+.3f}] ({self.level:.0%}, {self.n} paired seeds)"


def paired_bootstrap(
    a: Sequence[float], b: Sequence[float], resamples: int = 20000, level: float = 0.95, seed: int = 0
) -> PairedDifference:
    """The mean of a[i] - b[i] (seed i ran both arms) and its percentile interval over `resamples` resamples of the
    seeds with replacement."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_bootstrap needs the same seeds in both arms: {len(a)} and {len(b)} values")
    diff = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), size=(resamples, len(diff)))].mean(axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail], method="inverted_cdf")
    return PairedDifference(float(diff.mean()), float(low), float(high), len(diff), level)


def _z(alpha: float, power: float) -> float:
    return NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)


def seeds_needed(pilot_differences: Sequence[float], effect: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Seeds a paired comparison needs to detect a mean difference of `effect` (two-sided `alpha`, `power`), from the
    spread of a pilot's per-seed differences (normal approximation; at least 2)."""
    if len(pilot_differences) < 2:
        raise ValueError("a power analysis needs a pilot of at least 2 seeds")
    sd = stdev(pilot_differences)
    return max(2, math.ceil((_z(alpha, power) * sd / effect) ** 2))


def smallest_detectable(sd_difference: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest mean paired difference n seeds detect with `power` at two-sided `alpha`."""
    return _z(alpha, power) * sd_difference / math.sqrt(n)


def pilot_summary(pilot_differences: Sequence[float], effect: float) -> str:
    """One line for a results table: the pilot's spread and the seeds it asks for."""
    n = seeds_needed(pilot_differences, effect)
    mean, sd = fmean(pilot_differences), stdev(pilot_differences)
    return (f"pilot of {len(pilot_differences)} seeds: mean difference {mean:+.3f}, sd {sd:.3f} -> {n} seeds "
            f"detect {effect:.2f} with power 0.8 at alpha 0.05")  # fmt: skip


@dataclass(frozen=True)
class Criterion:
    """A comparison written into a script before it runs: arm `a` minus arm `b` on `measure`, paired by seed.

    It holds when the interval's lower end clears `margin` (and, with `min_mean`, the mean reaches it); `effect` is
    the difference a power analysis sizes the seeds for."""

    name: str
    a: str
    b: str
    margin: float
    effect: float
    min_mean: float | None = None
    measure: str = "held_out"

    def clause(self) -> str:
        floor = f"mean >= {self.min_mean:.2f} and " if self.min_mean is not None else ""
        return f"{floor}interval above {self.margin:+.2f}"


def judge(
    criteria: Sequence[Criterion], by_arm: dict[str, list[dict[str, Any]]], min_seeds: int = 3
) -> list[dict[str, Any]]:
    """Each criterion on the seeds both its arms ran (rows keyed by "seed"): the paired difference, its interval,
    whether it holds (None from fewer than `min_seeds` seeds: one or two seeds' interval is no interval), and the
    seeds a power-0.8 test of its effect needs from these seeds' spread."""
    out = []
    for c in criteria:
        if c.a not in by_arm or c.b not in by_arm:
            continue
        mine = {s["seed"]: s[c.measure] for s in by_arm[c.a] if s[c.measure] is not None}
        both = [(mine[s["seed"]], s[c.measure]) for s in by_arm[c.b] if s["seed"] in mine and s[c.measure] is not None]
        if not both:
            continue
        diff = paired_bootstrap([x for x, _ in both], [y for _, y in both])
        need = seeds_needed([x - y for x, y in both], c.effect) if len(both) >= 2 else None
        holds = None
        if diff.n >= min_seeds:
            holds = diff.low > c.margin and (c.min_mean is None or diff.mean >= c.min_mean)
        out.append({"name": c.name, "a": c.a, "b": c.b, "measure": c.measure, "margin": c.margin, "effect": c.effect,
                    "clause": c.clause(), "mean": diff.mean, "low": diff.low, "high": diff.high, "n": diff.n,
                    "holds": holds, "seeds_needed": need})  # fmt: skip
    return out


def verdict_lines(found: Sequence[dict[str, Any]], min_seeds: int = 3) -> list[str]:
    """One markdown line per judged criterion (from `judge`)."""
    said = {True: "holds", False: "does not hold", None: f"no verdict (fewer than {min_seeds} seeds)"}
    lines = []
    for c in found:
        need = f"; power 0.8 for {c['effect']:.2f} needs {c['seeds_needed']} seeds" if c["seeds_needed"] else ""
        lines.append(f"- **{c['name']}** `{c['a']}` - `{c['b']}` ({c['measure']}) = {c['mean']:+.3f} "
                     f"[{c['low']:+.3f}, {c['high']:+.3f}] over {c['n']} paired seeds ({c['clause']}): "
                     f"**{said[c['holds']]}**{need}")  # fmt: skip
    return lines

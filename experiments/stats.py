"""The statistics every experiment reports (docs/results.md, ../shared/notes/experiments.md): arms compared on the
same seeds, the difference per seed resampled (paired bootstrap) for a 95% interval, and the number of seeds a
comparison needs for a stated power, from a pilot's spread of those differences.

Owned here: `paired_bootstrap` (the interval of the mean paired difference), `seeds_needed` (a pilot's power
analysis) and `smallest_detectable` (what n seeds can tell apart). Called by the experiment scripts; numpy and the
standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist, fmean, stdev

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

"""The experiments' statistics on hand-computed cases: the paired bootstrap's interval, the power analysis and the
pre-registered comparisons' verdicts."""

from __future__ import annotations

import pytest

from experiments.stats import Criterion, judge, paired_bootstrap, seeds_needed, smallest_detectable, verdict_lines


def test_the_paired_bootstrap_of_three_seeds_matches_the_exact_resampling_distribution() -> None:
    # differences 1, 2, 3: the 27 equally likely resamples have means 1 (1 of them), 4/3 (3), 5/3 (6), 2 (7), 7/3
    # (6), 8/3 (3), 3 (1); 1/27 = 3.7% > 2.5% at each end, so the 95% interval is [1, 3]
    d = paired_bootstrap([1.5, 2.5, 3.5], [0.5, 0.5, 0.5])
    assert d.mean == pytest.approx(2.0) and (d.low, d.high) == (pytest.approx(1.0), pytest.approx(3.0))
    assert d.above_zero() and d.n == 3
    # at 80% (10% each end) the interval is [4/3, 8/3]: P(mean <= 1) = 3.7% < 10% <= P(mean <= 4/3) = 14.8%
    d80 = paired_bootstrap([1, 2, 3], [0, 0, 0], level=0.8)
    assert (d80.low, d80.high) == (pytest.approx(4 / 3), pytest.approx(8 / 3))


def test_a_constant_difference_has_no_spread_and_the_pairing_removes_the_seed_effect() -> None:
    # seed effects of 0, 10, 20 in both arms: paired, the difference is exactly 0.5 every time
    d = paired_bootstrap([10.5, 20.5, 0.5, 5.5], [10, 20, 0, 5])
    assert (d.mean, d.low, d.high) == (pytest.approx(0.5), pytest.approx(0.5), pytest.approx(0.5))
    with pytest.raises(ValueError, match="same seeds"):
        paired_bootstrap([1, 2], [1])


def test_the_power_analysis_asks_for_eight_seeds_when_the_effect_equals_the_spread() -> None:
    # n = ((z_0.975 + z_0.8) * sd / effect)^2 = (1.960 + 0.842)^2 = 7.85 -> 8
    assert seeds_needed([0.0, 0.1], effect=0.0707, alpha=0.05, power=0.8) == 8  # sd of (0, 0.1) = 0.0707
    assert smallest_detectable(0.05, 3) == pytest.approx(2.8016 * 0.05 / 3**0.5, rel=1e-3)  # 0.081
    with pytest.raises(ValueError, match="pilot"):
        seeds_needed([0.1], effect=0.05)


def test_a_criterion_is_judged_on_the_seeds_both_arms_ran_and_needs_three_for_a_verdict() -> None:
    by_arm = {
        "sao": [{"seed": 0, "held_out": 0.6}, {"seed": 1, "held_out": 0.7}, {"seed": 2, "held_out": 0.8},
                {"seed": 3, "held_out": None}],
        "base": [{"seed": 1, "held_out": 0.5}, {"seed": 2, "held_out": 0.6}, {"seed": 0, "held_out": 0.5},
                 {"seed": 3, "held_out": 0.9}],
        "two": [{"seed": 0, "held_out": 0.5}, {"seed": 1, "held_out": 0.5}],
    }  # fmt: skip
    found = judge(
        [Criterion("H1", "sao", "base", margin=0.0, effect=0.1), Criterion("G", "sao", "base", 0.0, 0.1, min_mean=0.3),
         Criterion("H2", "sao", "two", margin=0.0, effect=0.1), Criterion("X", "sao", "absent", 0.0, 0.1)],
        by_arm,
    )  # fmt: skip
    h1, gate, h2 = found  # an arm that did not run: no row
    # paired by seed, not by position: differences 0.1, 0.2, 0.2 (seed 3 has no sao value): mean 0.1667, and the
    # 27 resamples' 95% interval is [0.1, 0.2] (1/27 of them all 0.1, 8/27 all 0.2)
    assert (h1["n"], h1["mean"], h1["low"], h1["high"]) == (
        3,
        pytest.approx(1 / 6),
        pytest.approx(0.1),
        pytest.approx(0.2),
    )
    assert h1["holds"] is True and gate["holds"] is False  # the interval clears 0; the mean misses the floor 0.3
    assert h2["n"] == 2 and h2["holds"] is None  # two seeds: shown, not judged
    lines = verdict_lines(found)
    assert "**holds**" in lines[0] and "mean >= 0.30" in lines[1] and "no verdict" in lines[2]

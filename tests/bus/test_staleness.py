"""Staleness gate: histogram, drop or keep over the bound, never silently (counted, listed, logged)."""

from __future__ import annotations

import json

import pytest

from megatron_sao.bus.staleness import LOG_NAME, StalenessGate
from tests.bus.helpers import traj


def test_over_stale_trajectories_are_dropped_counted_and_logged(tmp_path) -> None:
    version = {"v": 10}
    gate = StalenessGate(lambda: version["v"], 2, "drop", str(tmp_path), recent_cap=2)
    kept = [gate.admit(traj(i, version=v)) for i, v in enumerate((10, 9, 8, 7, 3))]
    assert kept == [True, True, True, False, False]
    m = gate.metrics()
    assert m["stale_dropped"] == 2 and m["staleness_max"] == 7
    assert (m["staleness_le_0"], m["staleness_le_1"], m["staleness_le_2"], m["staleness_le_4"]) == (1, 1, 1, 1)
    assert m["staleness_le_8"] == 1
    assert list(gate.recent) == ["w-3", "w-4"]
    lines = [json.loads(x) for x in (tmp_path / LOG_NAME).read_text().splitlines()]
    records = [(x["trajectory_id"], x["staleness"], x["action"]) for x in lines]
    assert records == [("w-3", 3, "dropped"), ("w-4", 7, "dropped")]


def test_keep_policy_keeps_but_records() -> None:
    gate = StalenessGate(lambda: 5, 1, "keep", None, recent_cap=10)
    t = traj(0, version=1)
    assert gate.admit(t) and t.extras["staleness"] == 4
    assert gate.metrics()["stale_kept"] == 1 and list(gate.recent) == ["w-0"]


def test_a_bound_without_a_version_source_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="current_version"):
        StalenessGate(None, 3, "drop", None, recent_cap=1)


def test_a_trajectory_from_a_version_the_learner_does_not_hold_is_never_negatively_stale() -> None:
    """After a resume that fell back to an older checkpoint, tokens of the abandoned versions come back: staleness
    0, counted in ahead_of_learner, never negative."""
    from megatron_sao.bus.staleness import StalenessGate
    from tests.bus.helpers import traj

    gate = StalenessGate(lambda: 4, 2, "drop", None, 8)
    t = traj(0, version=8)
    assert gate.admit(t) and t.extras["staleness"] == 0
    m = gate.metrics()
    assert m["ahead_of_learner"] == 1 and m["staleness_max"] == 0


def test_a_trajectory_further_ahead_than_any_fallback_can_explain_is_refused_and_logged(tmp_path) -> None:
    """Issue 46's probe: a producer claiming version 1,000,000 was accepted with staleness 0. Past `max_ahead` (the
    learner passes (fallback_checkpoints + 1) x save_interval) no version of the run made it: refused, counted,
    logged with what it was; within the bound a fallback's trajectories still train."""
    gate = StalenessGate(lambda: 4, 2, "drop", str(tmp_path), 8, max_ahead=100)
    assert gate.admit(traj(0, version=104))
    assert not gate.admit(traj(1, version=1_000_000))
    m = gate.metrics()
    assert (m["ahead_of_learner"], m["ahead_refused"], m["staleness_max"]) == (1, 1, 0)
    (line,) = [json.loads(x) for x in (tmp_path / LOG_NAME).read_text().splitlines()]
    assert (line["trajectory_id"], line["action"], line["oldest_version"]) == ("w-1", "refused_ahead", 1_000_000)
    assert list(gate.recent) == ["w-1"]

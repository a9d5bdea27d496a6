"""Value pre-training's schedule: the new batch first, passes over a bounded buffer, and the stopping rule (a critic
that explains enough and stopped improving, or the sample budget), resumable from its state."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_sao.bus.synthetic import make_trajectory
from megatron_sao.config import load_config
from megatron_sao.run.pretrain import ValuePretraining


def _pretraining(state=None, **value) -> ValuePretraining:
    overrides = ["--algo.value.pretrain_samples", "1000"]
    for key, v in value.items():
        overrides += [f"--algo.value.{key}", str(v)]
    cfg = load_config(None, overrides)
    return ValuePretraining(cfg.algo, state, version=0, bus=cfg.bus, seed=1)


def _batch(start: int, n: int = 4) -> list:
    return [make_trajectory(f"t{start + i}", num_tokens=16 + i) for i in range(n)]


def _ids(batches) -> list[list[str]]:
    return [[t.trajectory_id for t in b] for b in batches]


def test_each_step_trains_the_new_batch_first_then_passes_over_the_buffer() -> None:
    p = _pretraining(pretrain_buffer_batches=3, pretrain_passes=2)
    first = p.batches(_batch(0))
    assert _ids(first)[0] == ["t0", "t1", "t2", "t3"] and len(first) == 2  # pass 1: the new batch; pass 2: again
    p.record(4, {})
    for step in range(1, 5):
        p.batches(_batch(4 * step))
        p.record(4, {})
    steps = p.batches(_batch(20))
    ids = _ids(steps)
    assert ids[0] == ["t20", "t21", "t22", "t23"]
    # the buffer holds the newest 3 batches (t12..t23): pass 1 = new + 2 older, pass 2 = all 3 reshuffled
    assert len(steps) == 6 and all(len(b) == 4 for b in steps)
    pass1, pass2 = sorted(sum(ids[:3], [])), sorted(sum(ids[3:], []))
    assert pass1 == pass2 == sorted(f"t{i}" for i in range(12, 24))


def test_a_larger_pretraining_batch_is_one_critic_step_and_the_passes_go_in_steps_of_the_policys() -> None:
    cfg = load_config(None, ["--algo.value.pretrain_samples", "1000", "--algo.value.pretrain_batch", "8",
                             "--algo.value.pretrain_buffer_batches", "2", "--algo.value.pretrain_passes", "2",
                             "--learner.trajectories_per_step", "4"])  # fmt: skip
    p = ValuePretraining(cfg.algo, None, version=0, bus=cfg.bus, seed=1, step_trajectories=4)
    assert p.batch == 8
    assert ValuePretraining(load_config(None, []).algo, None, 0, step_trajectories=16).batch == 16  # 0: the policy's
    p.batches(_batch(0, 8))
    p.record(8, {})
    ids = _ids(p.batches(_batch(8, 8), 4))
    assert ids[0] == [f"t{i}" for i in range(8, 16)]  # the new batch whole: its explained variance covers all 8
    assert [len(b) for b in ids[1:]] == [4] * 6  # the older batch, then a pass over both, in steps of 4
    assert sorted(sum(ids[1:3], [])) == sorted(f"t{i}" for i in range(8))
    assert sorted(sum(ids[3:], [])) == sorted(f"t{i}" for i in range(16))


def test_one_batch_one_pass_trains_each_batch_once() -> None:
    p = _pretraining()
    for step in range(3):
        assert _ids(p.batches(_batch(4 * step))) == [[f"t{4 * step + i}" for i in range(4)]]
        p.record(4, {})


def _metrics(loss: float, ev: float) -> dict[str, float]:
    return {"loss/value_first": loss, "value/explained_variance": ev}


def test_pretraining_stops_once_the_critic_explains_enough_and_its_loss_is_flat() -> None:
    p = _pretraining(pretrain_plateau_steps=2, pretrain_min_explained_variance=0.3)
    for loss, ev in [(1.0, 0.0), (0.5, 0.1), (0.3, 0.35), (0.29, 0.4)]:
        assert p.active
        p.record(4, _metrics(loss, ev))
    # the last two steps: mean explained variance 0.375 >= 0.3, loss 0.295 vs 0.75 before: still improving
    assert p.active
    p.record(4, _metrics(0.3, 0.4))
    p.record(4, _metrics(0.29, 0.45))
    assert not p.active and "critic ready" in p.reason and "0.425" in p.reason


def test_a_flat_loss_on_a_critic_that_explains_little_does_not_stop_pretraining() -> None:
    p = _pretraining(pretrain_plateau_steps=2, pretrain_min_explained_variance=0.3, pretrain_samples=40)
    for _ in range(9):
        p.record(4, _metrics(0.2, 0.05))
        assert p.active, p.reason
    p.record(4, _metrics(0.2, 0.05))  # 40 trajectories: the budget ends it
    assert not p.active and p.reason == "40 trajectories (budget 40)"


def test_pretraining_resumes_with_its_buffer_and_history() -> None:
    p = _pretraining(pretrain_buffer_batches=2, pretrain_plateau_steps=2)
    for step in range(3):
        p.batches(_batch(4 * step))
        p.record(4, _metrics(0.5, 0.1))
    back = _pretraining(p.state_dict(), pretrain_buffer_batches=2, pretrain_plateau_steps=2)
    assert (back.samples, back.steps, back.losses, back.evs) == (12, 3, [0.5] * 3, [0.1] * 3)
    assert _ids(back.buffer) == _ids(p.buffer) == [["t4", "t5", "t6", "t7"], ["t8", "t9", "t10", "t11"]]
    assert np.array_equal(back.buffer[0][0].tokens, p.buffer[0][0].tokens)
    assert _ids(back.batches(_batch(12))) == _ids(p.batches(_batch(12)))  # the same order as without the stop


def test_a_finished_phase_keeps_no_buffer() -> None:
    p = _pretraining(pretrain_buffer_batches=4, pretrain_samples=8)
    p.batches(_batch(0))
    p.record(4, {})
    p.batches(_batch(4))
    p.record(4, {})
    assert not p.active and p.buffer == [] and p.state_dict()["buffer"] == []


def test_restoring_a_buffer_needs_the_bus_limits() -> None:
    p = _pretraining(pretrain_buffer_batches=2)
    p.batches(_batch(0))
    cfg = load_config(None, ["--algo.value.pretrain_samples", "1000"])
    with pytest.raises(ValueError, match="bus limits"):
        ValuePretraining(cfg.algo, p.state_dict(), version=0)

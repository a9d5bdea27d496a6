"""The pipeline simulator: hand-computed timelines of the three arms on fixed episodes, SAO's staleness bound, the
engine's batching (one iteration serves the whole batch), and tools/simulate.py: its calibration on the recorded
CPU benchmark meets the 15% target and its projection of an example prints every arm."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_sao.plan.simulate import EngineModel, EpisodeSource, LearnerModel, Scenario, simulate

REPO = Path(__file__).resolve().parents[2]
ONE_TURN = (dict(prompt_id="p", turns=1, tokens=10, action_tokens=10, tool_s=0.0),)
FLAT = EngineModel(tau0=0.1, tau1=0.0)  # 0.1 s per decode iteration whatever the batch
LEARNER = LearnerModel(step_s=lambda arm, n, tokens: 2.0, push_s=0.5)


def test_synchronous_grpo_timeline() -> None:
    """Each step: 10 iterations of generation (1 s), a 2 s step, a 0.5 s push (not after the last)."""
    r = simulate(Scenario("grpo", engines=1, concurrency=4, trajectories_per_step=4, steps=3, max_staleness=4, group=4),
                 FLAT, LEARNER, EpisodeSource(ONE_TURN))  # fmt: skip
    assert r.window_s == pytest.approx(3 * (1.0 + 2.0) + 2 * 0.5)
    assert r.trained == 12 and r.generated_tokens == 120 and r.staleness == [0] * 12
    assert r.engine_busy_s == pytest.approx(3.0) and r.learner_busy_s == pytest.approx(3 * 2.0 + 2 * 0.5)


def test_one_step_off_grpo_overlaps_generation_with_training() -> None:
    """b0 0-1; b0 trains 1-3 while b1 generates 1-2 (weights v0); push 3-3.5; b1 trains 3.5-5.5 while b2 generates
    3.5-4.5 with v1; push 5.5-6; b2 trains 6-8."""
    r = simulate(Scenario("grpo_async", engines=1, concurrency=4, trajectories_per_step=4, steps=3, max_staleness=4,
                          group=4), FLAT, LEARNER, EpisodeSource(ONE_TURN))  # fmt: skip
    assert r.window_s == pytest.approx(8.0)
    assert r.staleness == [0] * 4 + [1] * 8


def test_a_push_that_stops_the_engines_only_for_its_commit_keeps_them_decoding() -> None:
    """A shard-aware push: the learner busy for the whole push, the engines stopped only for `engine_pause_s` (the
    commit). Same learner, same push length: with a 0.05 s stall the engines are busier and SAO trains faster than
    with the engines stopped for the whole 1.5 s push."""
    records = tuple(dict(prompt_id=f"p{i}", turns=1, tokens=30, action_tokens=30, tool_s=0.0) for i in range(8))
    sc = Scenario("sao", engines=2, concurrency=16, trajectories_per_step=8, steps=20, max_staleness=4)
    stopped = simulate(sc, FLAT, LearnerModel(step_s=lambda arm, n, tokens: 0.5, push_s=1.5), EpisodeSource(records))
    decoding = simulate(sc, FLAT, LearnerModel(step_s=lambda arm, n, tokens: 0.5, push_s=1.5, engine_pause_s=0.05),
                        EpisodeSource(records))  # fmt: skip
    assert decoding.engine_busy > stopped.engine_busy
    assert decoding.summary()["trajectories_per_hour"] > stopped.summary()["trajectories_per_hour"]
    assert decoding.learner_busy_s == pytest.approx(stopped.learner_busy_s)  # the learner pushes as long


def test_sao_streams_and_bounds_staleness() -> None:
    records = tuple(dict(prompt_id=f"p{i}", turns=1 + i % 6, tokens=20 + 10 * i, action_tokens=10 + 5 * (i % 6),
                         tool_s=float(i % 6)) for i in range(30))  # fmt: skip
    fast = LearnerModel(step_s=lambda arm, n, tokens: 0.05, push_s=0.01)
    r = simulate(Scenario("sao", engines=2, concurrency=64, trajectories_per_step=4, steps=50, max_staleness=2), FLAT,
                 fast, EpisodeSource(records))  # fmt: skip
    assert r.trained == 200 and max(r.staleness) <= 2 and r.dropped > 0  # 64 in flight, 4 per step: many age out
    assert 0 < r.engine_busy <= 1 and 0 < r.learner_busy <= 1


def test_one_iteration_serves_the_whole_batch() -> None:
    """8 episodes at once on one engine take as long as one when the iteration does not grow with the batch, and
    longer when each sequence adds to it."""

    def window(engine: EngineModel, batch: int) -> float:
        sc = Scenario("grpo", engines=1, concurrency=batch, trajectories_per_step=batch, steps=1, max_staleness=4,
                      group=batch)  # fmt: skip
        return simulate(sc, engine, LEARNER, EpisodeSource(ONE_TURN)).window_s

    assert window(FLAT, 8) == pytest.approx(window(FLAT, 1))
    growing = EngineModel(tau0=0.1, tau1=0.01)
    assert window(growing, 8) - 2.0 == pytest.approx(10 * (0.1 + 0.08))


@pytest.mark.multiproc
def test_calibration_meets_the_target(tmp_path: Path) -> None:
    out = tmp_path / "calibration.json"
    done = subprocess.run([sys.executable, "tools/simulate.py", "calibrate", "--seeds", "3", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    predicted = [r for r in result["rows"] if r["kind"] == "predicted" and r["quantity"] != "staleness_mean"]
    assert {r["arm"] for r in predicted} == {"sao", "grpo", "grpo_async"}
    assert result["worst_error"] <= 0.15, done.stdout
    assert "speed-up sao/grpo: simulated" in done.stdout


@pytest.mark.slow  # default tier: the arms' timeline unit tests above and the calibration run through the same CLI
@pytest.mark.multiproc
def test_projection_prints_every_arm(tmp_path: Path) -> None:
    out = tmp_path / "qwen.json"
    done = subprocess.run([sys.executable, "tools/simulate.py", "project", "examples/qwen3_30b/config.yaml", "--nodes",
                           "6", "--trajectories", "1024", "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["arms"]) == {"sao", "grpo", "grpo_async"}
    assert len(result["sensitivity"]) == 9
    sharded = tmp_path / "qwen_sharded.json"
    done = subprocess.run([sys.executable, "tools/simulate.py", "project", "examples/qwen3_30b/config.yaml", "--nodes",
                           "6", "--trajectories", "1024", "--push", "sharded", "--out", str(sharded)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0 and "push (sharded)" in done.stdout, done.stderr[-2000:]
    sao = json.loads(sharded.read_text())["arms"]["sao"]
    assert sao["engine_busy"] > result["arms"]["sao"]["engine_busy"]  # engines decode through the transfer
    for arm in result["arms"].values():
        assert arm["trajectories_per_hour"] > 0 and 0 < arm["engine_busy"] <= 1
    bad = subprocess.run([sys.executable, "tools/simulate.py", "project", "examples/qwen3_30b/config.yaml", "--nodes",
                          "6", "--parallel.tensor", "2", "--learner.recompute", "none"], cwd=REPO, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert bad.returncode == 1 and "does not fit" in bad.stdout


def test_a_critic_taking_batches_ahead_shortens_the_steps_only_while_a_batch_is_waiting() -> None:
    """The critic on its own ranks (`ahead_step_s`): 16 episodes finish at 1 s, 4 per step. Step 1 starts on the
    first 4 to finish (nothing else waiting yet) and step 2 costs its full 2 s too; at step 2's start a whole batch
    waits, so steps 3 and 4 find theirs already with the value job and cost 1 s. With one batch in flight nothing
    waits (each step ends before the next 4 finish), and every step costs `step_s`."""
    slow, fast = (lambda arm, n, tokens: 2.0), (lambda arm, n, tokens: 1.0)
    sc = Scenario("sao", engines=1, concurrency=16, trajectories_per_step=4, steps=4, max_staleness=100)
    serial = simulate(sc, FLAT, LearnerModel(step_s=slow, push_s=0.0), EpisodeSource(ONE_TURN))
    ahead = simulate(sc, FLAT, LearnerModel(step_s=slow, push_s=0.0, ahead_step_s=fast), EpisodeSource(ONE_TURN))
    assert serial.window_s == pytest.approx(1.0 + 4 * 2.0) and serial.ahead_steps == 0
    assert ahead.window_s == pytest.approx(1.0 + 2 * 2.0 + 2 * 1.0) and ahead.ahead_steps == 2
    one_batch = Scenario("sao", engines=1, concurrency=4, trajectories_per_step=4, steps=4, max_staleness=100)
    learner = LearnerModel(step_s=lambda arm, n, tokens: 0.05, push_s=0.0, ahead_step_s=lambda arm, n, tokens: 0.01)
    r = simulate(one_batch, FLAT, learner, EpisodeSource(ONE_TURN))
    assert r.ahead_steps == 0 and r.window_s == pytest.approx(4 * 1.0 + 0.05)  # each step ends before the next batch


def test_admission_bounds_staleness_without_dropping_and_wastes_no_generation() -> None:
    """bus.admission in the simulator: the same streaming run as above with admission starts only what the rule
    grants, so nothing is dropped, staleness stays within the bound, and every generated episode is trained or
    still open at the end (without admission 64 in flight at 4 per step age out and are dropped)."""
    records = tuple(dict(prompt_id=f"p{i}", turns=1 + i % 6, tokens=20 + 10 * i, action_tokens=10 + 5 * (i % 6),
                         tool_s=float(i % 6)) for i in range(30))  # fmt: skip
    fast = LearnerModel(step_s=lambda arm, n, tokens: 0.05, push_s=0.01)
    sc = Scenario("sao", engines=2, concurrency=64, trajectories_per_step=4, steps=50, max_staleness=2)
    free = simulate(sc, FLAT, fast, EpisodeSource(records))
    gated = simulate(Scenario(**{**sc.__dict__, "admission": True}), FLAT, fast, EpisodeSource(records))
    assert free.dropped > 0
    assert gated.trained == 200 and gated.dropped == 0 and max(gated.staleness) <= 2

"""Evaluation during asynchronous training and of checkpoints (run/evaluate.py): a local run with --eval.interval 5
writes an evaluation record at versions 0, 5 and 10, each measuring one version, while training goes on between
them; `python -m megatron_sao eval` on the finished run prints pass@1 and pass@k and exits 0, and names a missing
checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.run.test_arms import REPO, _cmd, _env, _records, assert_ledger_ok

EVAL = ("--eval.interval", "5", "--eval.num_prompts", "4", "--eval.samples_per_prompt", "2",
        "--eval.sampling.max_new_tokens", "10")  # fmt: skip


@pytest.fixture(scope="module")
def run_dir(tiny_hf_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("eval") / "run"
    cmd = _cmd(tiny_hf_dir("qwen3_moe"), run_dir, "--learner.max_steps", "10", "--learner.trajectories_per_step",
               "4", "--learner.save_interval", "5", "--algo.value.pretrain_samples", "0", *EVAL)  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir


@pytest.mark.multiproc
def test_a_run_evaluates_every_interval_one_version_each_and_trains_between(run_dir: Path) -> None:
    records = _records(run_dir)
    evals = [r for r in records if "eval/weight_version" in r]
    assert [r["eval/weight_version"] for r in evals] == [0.0, 5.0, 10.0]
    for r in evals:
        assert r["eval/samples"] == 8 and r["eval/prompts"] == 4 and not r["eval/given_up"] and r["eval/restarts"] == 0
        assert 0.0 <= r["eval/pass@1"] <= r["eval/pass@2"] <= 1.0 and "eval/avg@2" in r
    steps = [r for r in records if "step/trajectories" in r]
    assert [r["weight_version"] for r in steps] == list(range(1, 11))
    for a, b in zip(evals, evals[1:]):  # training went on between two evaluations
        assert sum(a["step"] < s["step"] <= b["step"] for s in steps) >= 4
    assert_ledger_ok(run_dir)  # evaluation samples never reach the bus


@pytest.mark.multiproc
def test_the_eval_command_evaluates_a_finished_run_and_names_a_missing_checkpoint(
    run_dir: Path, tiny_hf_dir: Any
) -> None:
    config = str(REPO / "examples" / "tiny_cpu" / "config.yaml")
    args = ["--model.hf_path", str(tiny_hf_dir("qwen3_moe")), "--launch.run_dir", str(run_dir), *EVAL]

    def evaluate(checkpoint: Path, timeout: float) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "megatron_sao", "eval", config, "--checkpoint", str(checkpoint), *args]
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=_env())

    done = evaluate(run_dir, 600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "iter_0000010" in done.stdout and "eval/pass@1" in done.stdout and "eval/pass@2" in done.stdout
    assert (run_dir / "eval" / "results.jsonl").is_file()
    missing = run_dir / "no_such_checkpoint"
    done = evaluate(missing, 120)
    assert done.returncode == 2 and f"--checkpoint {missing}: no such file or directory" in done.stderr
    assert "Traceback" not in done.stderr


class _SlowEvaluator:
    """An Evaluator stand-in whose evaluation runs until cancelled (an engine that stopped answering)."""

    k = 2

    def __init__(self) -> None:
        import threading

        self.cancelled = threading.Event()

    def cancel_now(self) -> None:
        self.cancelled.set()

    def run(self, version: int) -> Any:
        from megatron_sao.rollout.evaluate import Evaluation

        self.cancelled.wait(60)
        self.cancelled.clear()
        return Evaluation(version, self.k, given_up=True)


def test_a_push_waits_for_an_evaluation_no_longer_than_a_stop_or_its_timeout() -> None:
    """The learner's next push holds for the evaluation in flight, but a stop request (or eval.timeout_s) cancels it
    at once: a stuck evaluation can never keep the other learner ranks waiting in the push, nor a stop from its
    checkpoint; its record says given up."""
    import time

    from megatron_sao.config import load_config
    from megatron_sao.run.evaluate import EvalSchedule

    stop, records = [False], []
    cfg = load_config(None, ["--eval.interval", "5", "--eval.timeout_s", "2"])
    schedule = EvalSchedule(cfg, _SlowEvaluator(), records.append, should_stop=lambda: stop[0])  # type: ignore[arg-type]
    schedule.start(5)
    stop[0] = True
    t0 = time.monotonic()
    schedule.hold()
    assert time.monotonic() - t0 < 5 and records[-1]["eval/given_up"] == 1.0 and "eval/reward/mean" not in records[-1]
    stop[0] = False
    schedule.start(10)
    t0 = time.monotonic()
    schedule.hold()  # nobody asked to stop: eval.timeout_s (2 s) cancels it
    assert 1.5 < time.monotonic() - t0 < 8 and records[-1]["eval/weight_version"] == 10.0
    assert records[-1]["eval/given_up"] == 1.0 and 10 not in schedule.done

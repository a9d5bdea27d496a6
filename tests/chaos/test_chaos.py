"""Chaos over the real local launcher (`python -m megatron_sao run`, the tiny style example), seeded: SIGKILL the
rollout worker, then the engine (the run restarts each), then the run itself -- the learner, whose engine and worker
must die with it --, resume, SIGTERM it mid-run (clean stop), resume to the end. At the end the run reached its
steps and the trajectory ledger's check passes: every trajectory trained exactly once, dropped as stale, or pending.
The default tier runs one seed; the slow tier several."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.run.test_arms import REPO, _cmd, _env, assert_ledger_ok

MAX_STEPS = 24


def _version(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    steps = [r for r in map(json.loads, lines) if "step/trajectories" in r]
    return steps[-1]["weight_version"] if steps else 0


def _wait_version(run_dir: Path, proc: subprocess.Popen[bytes], at_least: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while _version(run_dir) < at_least:
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before version {at_least}"
        assert time.monotonic() < deadline, f"no version {at_least} after {timeout_s}s"
        time.sleep(0.1)


def _child(proc: subprocess.Popen[bytes], role: str) -> psutil.Process:
    """The run's engine or rollout worker process."""
    for _ in range(100):
        for c in psutil.Process(proc.pid).children(recursive=True):
            cmd = c.cmdline()
            if "megatron_sao" in cmd and role in cmd:
                return c
        time.sleep(0.1)
    raise AssertionError(f"no {role} child of the run")


def _chaos(hf_dir: Path, run_dir: Path, seed: int) -> None:
    rng = random.Random(seed)
    ports = _cmd(hf_dir, run_dir)  # fixed ports for every restart of this run
    cmd = [*ports, "--learner.max_steps", str(MAX_STEPS), "--learner.save_interval", "2"]
    start = lambda: subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,  # noqa: E731
                                     env=_env())  # fmt: skip
    proc = start()
    kill_worker_at = rng.randint(2, 4)
    _wait_version(run_dir, proc, kill_worker_at)
    _child(proc, "rollout").kill()  # the supervisor restarts it; it resumes from its cursor and spool
    _wait_version(run_dir, proc, kill_worker_at + rng.randint(2, 3))
    _child(proc, "engine").kill()  # restarted on its launch weights, pushed to at the next step
    kill_learner_at = _version(run_dir) + rng.randint(2, 4)
    _wait_version(run_dir, proc, kill_learner_at)
    children = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGKILL)  # the learner dies mid-run, no checkpoint
    proc.wait()
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"left behind by the killed run: {[c.cmdline() for c in alive]}"
    proc = start()  # resumes from the last checkpoint; what it consumed after it comes again
    _wait_version(run_dir, proc, _version(run_dir) + rng.randint(2, 4))
    proc.send_signal(signal.SIGTERM)  # mid-run: finish the step, checkpoint, exit 0
    assert proc.wait(timeout=120) == 0
    proc = start()
    assert proc.wait(timeout=600) == 0
    assert _version(run_dir) == MAX_STEPS
    assert_ledger_ok(run_dir)


@pytest.mark.multiproc
def test_a_run_killed_and_stopped_at_random_points_loses_nothing(tiny_hf_dir: Any, tmp_path: Path) -> None:
    _chaos(Path(tiny_hf_dir("qwen3_moe")), tmp_path / "run", seed=1)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("seed", [2, 3, 4])
def test_chaos_more_seeds(tiny_hf_dir: Any, tmp_path: Path, seed: int) -> None:
    _chaos(Path(tiny_hf_dir("qwen3_moe")), tmp_path / "run", seed=seed)

"""Chaos over the real local launcher (`python -m megatron_sao run`, the tiny style example), seeded: SIGKILL the
rollout worker, then the engine (the run restarts each), then the run itself -- the learner, whose engine and worker
must die with it --, cut a spooled trajectory in half (a torn write), resume, SIGKILL the worker or the engine
again, SIGTERM it mid-run (clean stop), resume to the end. At the end the run reached its steps and the trajectory
ledger's check passes: every trajectory trained exactly once, dropped as stale, pending, or -- the torn one -- its
prompt generated again. The default tier runs one seed; the slow tier several. With SAO_CHAOS_REPORT_DIR set, each
run writes what it injected, the time to recover from each fault and the ledger's counts there
(tools/reliability_report.py)."""

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

from tests.chaos.report import write_report
from tests.run.test_arms import REPO, _cmd, _env

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


class _Faults:
    """What was injected when, and how long the run took to train its next step after it (the suite's report)."""

    def __init__(self, run_dir: Path, seed: int) -> None:
        self.run_dir, self.seed, self.t0 = run_dir, seed, time.monotonic()
        self.faults: list[dict[str, Any]] = []

    def injected(self, fault: str, **facts: Any) -> dict[str, Any]:
        record = {"fault": fault, "at_version": _version(self.run_dir), "at_s": round(time.monotonic() - self.t0, 1),
                  **facts}  # fmt: skip
        self.faults.append(record)
        return record

    def recovered(self, record: dict[str, Any], proc: subprocess.Popen[bytes], since: float) -> None:
        """Wait for the next trained step; record the seconds from `since`."""
        _wait_version(self.run_dir, proc, _version(self.run_dir) + 1)
        record["recovered_s"] = round(time.monotonic() - since, 1)

    def worker_back(self, record: dict[str, Any], proc: subprocess.Popen[bytes], killed_at: float) -> None:
        """Wait until a worker started after `killed_at` (wall time) produced a trajectory; record the seconds."""
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the worker did not come back"
            path = self.run_dir / "ledger" / "rollout-0.jsonl"
            lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
            started = [i for i, x in enumerate(lines) if x["event"] == "start" and x["time"] > killed_at]
            produced = [x for x in lines[started[0] :] if x["event"] == "produced"] if started else []
            if produced:
                record["recovered_s"] = round(produced[0]["time"] - killed_at, 1)
                return
            time.sleep(0.1)

    def engine_back(self, record: dict[str, Any], proc: subprocess.Popen[bytes], url: str, since: float) -> None:
        """Wait until the restarted engine answers /health; record the seconds from `since`."""
        from megatron_sao.engines.client import SGLangClient

        client, deadline = SGLangClient(url), time.monotonic() + 120
        while not client.health(timeout_s=1.0):
            assert proc.poll() is None and time.monotonic() < deadline, "the engine did not come back"
            time.sleep(0.1)
        record["recovered_s"] = round(time.monotonic() - since, 1)

    def write(self, name: str, report: Any) -> None:
        write_report(f"{name}-seed{self.seed}", {
            "seed": self.seed, "seconds": round(time.monotonic() - self.t0, 1), "faults": self.faults,
            "ledger": {k: v for k, v in vars(report).items() if k != "violations"}, "ok": report.ok,
        })  # fmt: skip


def _kill_worker(faults: _Faults, proc: subprocess.Popen[bytes]) -> None:
    killed_at = time.time()
    _child(proc, "rollout").kill()
    faults.worker_back(faults.injected("SIGKILL rollout worker", until="a new worker produced"), proc, killed_at)


def _kill_engine(faults: _Faults, proc: subprocess.Popen[bytes], url: str) -> None:
    record, since = faults.injected("SIGKILL engine", until="the restarted engine answered /health"), time.monotonic()
    victim = _child(proc, "engine")
    victim.kill()
    victim.wait(30)
    faults.engine_back(record, proc, url, since)


def _damage_a_spool_file(run_dir: Path, rng: random.Random) -> str | None:
    """Cut one spooled trajectory in half (a torn write that survived its rename): lost; its prompt is redone."""
    files = sorted((run_dir / "spool").glob("*/*.traj"))
    if not files:
        return None
    victim = rng.choice(files)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    return victim.name


def _chaos(hf_dir: Path, run_dir: Path, seed: int, spool: bool = True) -> None:
    from megatron_sao.run.ledger import check_ledger

    rng = random.Random(seed)
    faults = _Faults(run_dir, seed)
    ports = _cmd(hf_dir, run_dir)  # fixed ports for every restart of this run
    cmd = [*ports, "--learner.max_steps", str(MAX_STEPS), "--learner.save_interval", "2"]
    cmd += [] if spool else ["--bus.spool_dir", "null"]  # what a killed worker sent is lost: its prompts come again
    start = lambda: subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,  # noqa: E731
                                     env=_env())  # fmt: skip
    proc = start()
    kill_worker_at = rng.randint(2, 4)
    _wait_version(run_dir, proc, kill_worker_at)
    _kill_worker(faults, proc)  # the supervisor restarts it; it resumes from its cursor and spool
    _wait_version(run_dir, proc, kill_worker_at + rng.randint(2, 3))
    engine = f"http://127.0.0.1:{ports[ports.index('--rollout.base_port') + 1]}"
    _kill_engine(faults, proc, engine)  # restarted on its launch weights, pushed to at once
    kill_learner_at = _version(run_dir) + rng.randint(1, 3)
    _wait_version(run_dir, proc, kill_learner_at)
    children = psutil.Process(proc.pid).children(recursive=True)
    killed = faults.injected("SIGKILL learner (the run)", until="its restart trained a step")
    os.kill(proc.pid, signal.SIGKILL)  # the learner dies mid-run, no checkpoint
    proc.wait()
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"left behind by the killed run: {[c.cmdline() for c in alive]}"
    torn = _damage_a_spool_file(run_dir, rng)
    if torn:
        faults.injected("spool file cut in half", file=torn)
    restarted = time.monotonic()
    proc = start()  # resumes from the last checkpoint; what it consumed after it comes again
    faults.recovered(killed, proc, restarted)
    if rng.random() < 0.5:  # a second kill in the resumed run: the worker or the engine, by the seed
        _kill_worker(faults, proc)
    else:
        _kill_engine(faults, proc, engine)
    _wait_version(run_dir, proc, _version(run_dir) + rng.randint(1, 3))
    stopping = faults.injected("SIGTERM mid-run", until="it checkpointed, stopped all, exited 0")
    proc.send_signal(signal.SIGTERM)  # mid-run: finish the step, checkpoint, exit 0
    assert proc.wait(timeout=120) == 0
    stopping["recovered_s"] = round(time.monotonic() - faults.t0 - stopping["at_s"], 1)  # the clean stop's duration
    proc = start()
    assert proc.wait(timeout=600) == 0
    assert _version(run_dir) == MAX_STEPS
    report = check_ledger(run_dir)
    faults.write("chaos" if spool else "chaos-nospool", report)
    assert report.ok and report.produced > 0, report.describe()
    assert not torn or report.spool_lost == 1, report.describe()  # found, named, and its prompt generated again


@pytest.mark.multiproc
def test_a_run_killed_and_stopped_at_random_points_loses_nothing(tiny_hf_dir: Any, tmp_path: Path) -> None:
    _chaos(Path(tiny_hf_dir("qwen3_moe")), tmp_path / "run", seed=1)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("seed", [2, 3, 4])
def test_chaos_more_seeds(tiny_hf_dir: Any, tmp_path: Path, seed: int) -> None:
    _chaos(Path(tiny_hf_dir("qwen3_moe")), tmp_path / "run", seed=seed)


@pytest.mark.slow
@pytest.mark.multiproc
def test_without_a_spool_what_a_crash_loses_is_generated_again(tiny_hf_dir: Any, tmp_path: Path) -> None:
    """bus.spool_dir null: a killed worker's and a killed run's unsent or uncommitted trajectories are gone, but
    the worker's cursor kept their prompts pending until the learner committed them, so they are generated again."""
    _chaos(Path(tiny_hf_dir("qwen3_moe")), tmp_path / "run", seed=5, spool=False)

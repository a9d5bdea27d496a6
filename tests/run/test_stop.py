"""Stopping a local run: SIGTERM to `run` (what a supervisor or Ctrl-C sends) and a stop request (<run_dir>/STOP,
what the Slurm launcher writes) both end the step in progress, checkpoint at the version reached, stop the engine
and the rollout worker, and exit 0; the request file is consumed, and running again resumes from the checkpoint."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.run.test_arms import REPO, _cmd, _env, assert_ledger_ok


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [r for r in map(json.loads, lines) if "step/trajectories" in r]


@pytest.mark.multiproc
# slow tier; the default tier covers both paths elsewhere: SIGTERM mid-run, checkpoint and resume in
# tests/chaos/test_chaos.py's seed, the STOP file (checkpoint and stop) in tests/run/test_errors.py
@pytest.mark.parametrize(
    "how", [pytest.param("sigterm", marks=pytest.mark.slow), pytest.param("stop_file", marks=pytest.mark.slow)]
)
def test_a_stopped_run_checkpoints_and_resumes(tiny_hf_dir: Any, tmp_path: Path, how: str) -> None:
    run_dir = tmp_path / "run"
    cmd = _cmd(tiny_hf_dir("qwen3_moe"), run_dir, "--learner.max_steps", "500")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env())
    deadline = time.monotonic() + 300
    while len(_steps(run_dir)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-3000:]  # type: ignore[union-attr]
        time.sleep(0.2)
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)
    else:
        (run_dir / "STOP").write_text("test\n")
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 0, out[-3000:]
    last = _steps(run_dir)[-1]["weight_version"]
    assert f"stopped by SIGTERM at version {last}" in out and "Traceback" not in out, out[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"iter_{last:07d}"
    assert not (run_dir / "STOP").exists()
    for name in ("engine_0", "rollout"):  # the children were stopped on the way out
        assert (run_dir / "logs" / f"{name}.log").is_file()
    again = subprocess.run([*cmd[:-1], str(last + 1)], cwd=REPO, capture_output=True, text=True, timeout=300,
                           env=_env())  # fmt: skip
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert [r["weight_version"] for r in _steps(run_dir)][-2:] == [last, last + 1]
    assert_ledger_ok(run_dir)  # across the stop and the resume: every trajectory trained once, dropped or pending


@pytest.mark.multiproc
def test_a_run_refuses_to_start_next_to_a_leftover_on_its_ports(tiny_hf_dir: Any, tmp_path: Path) -> None:
    import os
    import socket

    leftover = socket.socket()
    leftover.bind(("127.0.0.1", 0))
    leftover.listen()
    port = leftover.getsockname()[1]
    try:
        cmd = _cmd(tiny_hf_dir("qwen3_moe"), tmp_path / "run", engine_port=port)
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=_env())
    finally:
        leftover.close()
    assert done.returncode == 2
    assert f"port {port} for engine 0 (rollout.base_port) is already taken by pid {os.getpid()}" in done.stderr
    assert f"kill {os.getpid()}" in done.stderr

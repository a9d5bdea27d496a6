"""Reliability round three (issue 31, item 3), end to end: the run dir on a small tmpfs fills up mid-run; the run
stops naming `no space left on <run_dir> (launch.run_dir)`, every JSON-lines file ends in a whole line, and after
the space is freed a rerun trains on and the ledger passes without artefacts (a checkpoint never covers a step whose
ledger lines were not written). Needs root to mount the tmpfs; skipped otherwise, saying so."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.run.test_arms import REPO, _cmd, _env, assert_ledger_ok


@pytest.fixture
def small_disk(tmp_path: Path):
    where = tmp_path / "small"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a 40 MiB tmpfs for the run dir needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_text().count("step/trajectories") if path.is_file() else 0


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_full_run_dir_is_named_leaves_whole_files_and_the_rerun_passes_the_ledger(
    tiny_hf_dir: Any, tmp_path: Path, small_disk: Path
) -> None:
    run_dir = small_disk / "run"
    common = ("--learner.save_interval", "2", "--learner.trajectories_per_step", "4",
              "--learner.save_dir", str(tmp_path / "checkpoints"))  # fmt: skip
    cmd = _cmd(tiny_hf_dir("qwen3_moe"), run_dir, *common, "--learner.max_steps", "500")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env())
    deadline = time.monotonic() + 300
    while _steps(run_dir) < 4:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-3000:]  # type: ignore[union-attr]
        time.sleep(0.2)
    filler = small_disk / "filler"
    with filler.open("wb") as f:  # fill the disk
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
    out = proc.communicate(timeout=240)[0].decode()
    assert proc.returncode != 0, out[-3000:]
    assert f"no space left on {run_dir} (launch.run_dir)" in out, out[-3000:]
    for path in run_dir.rglob("*.jsonl"):
        data = path.read_bytes()
        assert not data or data.endswith(b"\n"), f"{path} ends in a torn line"
    filler.unlink()  # space back: the rerun resumes and the ledger has no artefacts
    reached = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1]).get("weight_version", 0)
    again = subprocess.run([*cmd[:-1], str(int(reached) + 4)], cwd=REPO, capture_output=True, text=True, timeout=300,
                           env=_env())  # fmt: skip
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert_ledger_ok(run_dir)

"""One run per run dir (distributed/dirlock.py): a second `run` on a run dir in use is refused at once, naming the
first's pid, and the first finishes untouched; the lock names its holder, a lock left by a dead holder is taken
over with a warning, and a clean exit leaves nothing to take over."""

from __future__ import annotations

import json
import logging
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from megatron_sao.distributed.dirlock import DirLock, DirLocked
from tests.run.test_arms import REPO, _cmd, _env, assert_ledger_ok


def test_a_held_lock_refuses_a_second_holder_naming_the_first(tmp_path: Path, caplog: Any) -> None:
    first = DirLock(tmp_path, "run").acquire()
    with pytest.raises(DirLocked, match=rf"in use by another run: pid {first_pid()} .*kill {first_pid()}"):
        DirLock(tmp_path, "run").acquire()
    DirLock(tmp_path, "learn").acquire().release()  # another role's lock is another file
    first.release()
    assert (tmp_path / ".run.lock").read_text() == ""  # a clean exit: nobody to take over from
    (tmp_path / ".run.lock").write_text(json.dumps({"pid": 999999, "host": "gone", "started": "earlier"}))
    with caplog.at_level(logging.WARNING), DirLock(tmp_path, "run"):
        assert json.loads((tmp_path / ".run.lock").read_text())["pid"] == first_pid()
    assert "taking over the lock of run pid 999999 on gone" in caplog.text


def first_pid() -> int:
    import os

    return os.getpid()


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_second_run_on_a_run_dir_in_use_is_refused_and_the_first_finishes(tiny_hf_dir: Any, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    model = tiny_hf_dir("qwen3_moe")
    cmd = _cmd(model, run_dir, "--learner.max_steps", "6", "--algo.value.pretrain_samples", "0")
    first = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").is_file():  # the first is training
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.5)
        t0 = time.monotonic()
        second = subprocess.run(_cmd(model, run_dir, "--learner.max_steps", "6"), cwd=REPO, env=_env(),
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        assert second.returncode == 2 and time.monotonic() - t0 < 10 + 10, second.stderr  # (+ interpreter start)
        assert f"is in use by another run: pid {first.pid}" in second.stderr and f"kill {first.pid}" in second.stderr
        out, err = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, out[-2000:] + err[-2000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["weight_version"] for r in steps if "step/trajectories" in r] == [1, 2, 3, 4, 5, 6]
    assert_ledger_ok(run_dir)

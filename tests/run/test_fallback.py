"""Reliability round three (issue 31, item 2): a run whose newest checkpoint is damaged resumes from the one before,
keeps the damaged one aside (`*.damaged`), saves the versions again, trains the abandoned steps' trajectories again
(the bus committed one checkpoint late), never reports a negative staleness, and its ledger is clean."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.run.test_arms import REPO, _cmd, _env, assert_ledger_ok


def _data_file(ckpt: Path) -> Path:
    return max((p for p in ckpt.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_run_falls_back_from_a_damaged_checkpoint_and_loses_nothing(tiny_hf_dir: Any, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    hf_dir = tiny_hf_dir("qwen3_moe")
    common = ("--learner.save_interval", "2", "--learner.trajectories_per_step", "4")
    first = subprocess.run(_cmd(hf_dir, run_dir, *common, "--learner.max_steps", "4"), cwd=REPO,
                           capture_output=True, text=True, timeout=400, env=_env())  # fmt: skip
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "iter_0000004"
    data = _data_file(ckpts / "iter_0000004")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 16] = bytes(b ^ 0xFF for b in raw[len(raw) // 2 : len(raw) // 2 + 16])
    data.write_bytes(bytes(raw))

    again = subprocess.run(_cmd(hf_dir, run_dir, *common, "--learner.max_steps", "6"), cwd=REPO,
                           capture_output=True, text=True, timeout=400, env=_env())  # fmt: skip
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-4000:]
    assert "iter_0000004, which is damaged" in out and "already holds a checkpoint" not in out, out[-4000:]
    names = sorted(p.name for p in ckpts.iterdir())
    assert "iter_0000004.damaged" in names and "iter_0000004" in names and "iter_0000006" in names, names
    assert (ckpts / "latest").read_text().strip() == "iter_0000006"
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step/trajectories" in r]
    assert [r["weight_version"] for r in steps][-4:] == [3, 4, 5, 6]  # versions 3 and 4 trained again
    assert all(r.get("staleness/min", 0) >= 0 for r in steps)
    assert_ledger_ok(run_dir)  # the abandoned steps' trajectories: voided, then trained again -- never lost

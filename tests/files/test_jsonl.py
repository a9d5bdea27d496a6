"""files/jsonl.py: the run's JSON-lines logs are written in whole lines or not at all, a full disk is named with its
directory and config field, a torn last line is tolerated and reported once by readers and repaired by the next
writer; and the ledger check reads a run dir with a torn line without inventing violations."""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import pytest

from megatron_sao.files import jsonl
from megatron_sao.files.jsonl import DiskFull, JsonlAppender, read_records


def test_a_full_disk_mid_write_leaves_whole_lines_and_names_dir_and_field(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "run" / "trajectories.jsonl"
    log = JsonlAppender(path, "launch.run_dir")
    log.write({"id": "a"})
    real_write = os.write
    calls = {"n": 0}

    def half_then_full(fd: int, data) -> int:  # what a filling disk does: a short write, then ENOSPC
        calls["n"] += 1
        if calls["n"] == 1:
            return real_write(fd, bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(jsonl.os, "write", half_then_full)
    with pytest.raises(DiskFull) as e:
        log.write_many([{"id": "b"}, {"id": "c", "pad": "x" * 100}])
    monkeypatch.setattr(jsonl.os, "write", real_write)
    assert f"no space left on {path.parent} (launch.run_dir)" in str(e.value) and "trajectories.jsonl" in str(e.value)
    assert path.read_text() == '{"id": "a"}\n'  # the batch went in whole or not at all: not at all
    log.write({"id": "d"})  # space back: appends go on
    log.close()
    assert [r["id"] for r in read_records(path)] == ["a", "d"]


def test_dev_full_is_named_as_a_full_disk(tmp_path: Path) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this machine")
    link = tmp_path / "stale.jsonl"
    link.symlink_to("/dev/full")
    log = JsonlAppender(link, "bus.stale_log_dir")
    with pytest.raises(DiskFull, match=r"no space left on .* \(bus.stale_log_dir\)"):
        log.write({"x": 1})
    log.close()


def test_a_torn_last_line_is_left_out_reported_once_and_repaired_by_the_next_writer(tmp_path: Path, caplog) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "rew')  # a write cut by a crash (older release)
    with caplog.at_level(logging.WARNING):
        assert [r["step"] for r in read_records(path)] == [1, 2]
        assert [r["step"] for r in read_records(path)] == [1, 2]
    assert sum("last line is torn" in r.message for r in caplog.records) == 1
    assert path.read_text().endswith('"rew')  # a reader never changes a file a live run may append to
    log = JsonlAppender(path, "launch.run_dir")  # the rerun: cuts the torn tail, then appends whole lines
    log.write({"step": 3})
    log.close()
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    assert [r["step"] for r in read_records(path)] == [1, 2, 3]


def test_a_whole_last_record_without_its_newline_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}')
    assert [r["step"] for r in read_records(path)] == [1, 2]
    log = JsonlAppender(path, "launch.run_dir")
    log.write({"step": 3})
    log.close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]


def test_an_unreadable_line_inside_the_file_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"st\n{"step": 2}\n')
    assert read_records(path)[1] == {"event": "unreadable", "where": f"{path}:2"}


def _produced(tid: str, prompt: str) -> list[dict]:
    return [{"event": "sending", "id": tid, "prompt": prompt, "worker": "rollout-0", "time": 1.0},
            {"event": "produced", "id": tid, "prompt": prompt, "worker": "rollout-0", "time": 1.0}]  # fmt: skip


def test_the_ledger_reads_a_run_with_a_torn_line_without_artefacts(tmp_path: Path) -> None:
    """A learner cut by a full disk mid-line (older release), then a rerun from the checkpoint at version 1: the
    rerun's writer repairs the file, the voided step is trained again, and the ledger is clean."""
    from megatron_sao.run.ledger import check_ledger

    (tmp_path / "ledger").mkdir()
    worker = [{"event": "start", "worker": "rollout-0", "time": 0.0}, *_produced("t1", "p1"), *_produced("t2", "p2")]
    (tmp_path / "ledger" / "rollout-0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in worker))

    def step(tid: str, v: int) -> str:
        return json.dumps({"id": tid, "worker": "rollout-0", "step_version": v, "pretrain_steps": 0}) + "\n"

    learner = tmp_path / "trajectories.jsonl"
    learner.write_text(json.dumps({"event": "start", "version": 0}) + "\n" + step("t1", 1) + step("t2", 2)[:30])
    log = JsonlAppender(learner, "launch.run_dir")  # the rerun (resumed at version 1)
    log.write({"event": "start", "version": 1})
    log.write_many([json.loads(step("t2", 2))])
    log.close()
    report = check_ledger(tmp_path)
    assert report.ok, report.describe()
    assert report.consumed == 2


def test_held_marks_of_checkpoints_a_fallback_abandoned_do_not_count(tmp_path: Path) -> None:
    from megatron_sao.run.ledger import held_ids

    lines = [{"event": "start", "version": 0}, {"event": "held", "ids": ["a"], "version": 4},
             {"event": "held", "ids": ["b"], "version": 8}, {"event": "start", "version": 4}]  # fmt: skip
    assert held_ids(lines) == {"a"}
    assert held_ids([*lines, {"event": "held", "ids": ["c"], "version": 6}]) == {"c"}

"""The ledger checker (run/ledger.py) on hand-written ledgers: each fate a trajectory can have, and each violation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from megatron_sao.run.ledger import check_ledger

REPO = Path(__file__).resolve().parents[2]


def _write(path: Path, lines: list[dict[str, Any]]) -> None:
    """A ledger file; a worker's (ledger/<worker>.jsonl) opens with the start its worker process writes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.parent.name == "ledger" and (not lines or lines[0].get("event") != "start"):
        lines = [{"event": "start", "worker": path.stem, "pid": 1}, *lines]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def _sent(tid: str, prompt: str, t: float, worker: str = "w0") -> list[dict[str, Any]]:
    return [{"event": "sending", "id": tid, "prompt": prompt, "worker": worker, "time": t},
            {"event": "produced", "id": tid, "prompt": prompt, "worker": worker, "time": t + 0.1}]  # fmt: skip


def _done(prompt: str, t: float, worker: str = "w0") -> dict[str, Any]:
    return {"event": "prompt_done", "prompt": prompt, "worker": worker, "time": t}


def _trained(tid: str, version: int, worker: str = "w0") -> dict[str, Any]:
    return {"id": tid, "step_version": version, "worker": worker}


def test_a_clean_run_with_a_restart_a_stale_drop_and_a_spooled_trajectory_is_ok(tmp_path: Path) -> None:
    lines = [x for i, tid in enumerate("abcd") for x in (*_sent(tid, f"0:{i}", i + 1), _done(f"0:{i}", i + 1.2))]
    _write(tmp_path / "ledger" / "w0.jsonl", lines)
    # a trained at step 1 (checkpointed); b trained at step 2, then the learner died before saving step 2: the
    # restart from version 1 voids it and b comes again; c was too stale; d waits in the spool
    _write(tmp_path / "trajectories.jsonl", [{"event": "start", "version": 0}, _trained("a", 1), _trained("b", 2),
           {"event": "start", "version": 1}, _trained("b", 2)])  # fmt: skip
    _write(tmp_path / "stale.jsonl", [{"trajectory_id": "c", "action": "dropped"}])
    spool = tmp_path / "spool" / "w0"
    spool.mkdir(parents=True)
    (spool / "7.traj").write_bytes(b"SAOSPOOL1\n" + (7).to_bytes(8, "little") + (0).to_bytes(4, "little")
                                   + (1).to_bytes(4, "little") + b"d")  # fmt: skip
    report = check_ledger(tmp_path)
    assert report.ok, report.describe()
    assert (report.produced, report.consumed, report.voided, report.stale_dropped, report.pending) == (4, 2, 1, 1, 1)


@pytest.mark.multiproc
def test_lost_and_twice_trained_trajectories_and_empty_prompts_are_violations(tmp_path: Path) -> None:
    _write(tmp_path / "ledger" / "w0.jsonl", [*_sent("a", "0:0", 1), _done("0:0", 1.2), *_sent("b", "0:1", 2),
           _done("0:1", 2.2), _done("0:2", 3)])  # fmt: skip
    _write(tmp_path / "trajectories.jsonl", [_trained("a", 1), _trained("a", 2), _trained("zz", 2)])
    report = check_ledger(tmp_path)
    text = "\n".join(report.violations)
    assert not report.ok and len(report.violations) == 4, text
    assert "trajectory a trained 2 times" in text and "zz was trained but its worker never sent it" in text
    assert "trajectory b (prompt 0:1, worker w0) was produced and then lost" in text
    assert "prompt 0:2 marked done by w0 without a trajectory" in text
    cli = subprocess.run([sys.executable, "-m", "megatron_sao", "ledger", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert cli.returncode == 1 and "VIOLATIONS: 4" in cli.stdout + cli.stderr


def test_a_spoolless_workers_crash_is_ok_when_its_prompts_were_generated_again(tmp_path: Path) -> None:
    """No spool: b was sent (in memory only), the worker died, its cursor had b's prompt pending (not committed),
    and the next life generated it again as b2. e was being handed to the bus when the worker died."""
    _write(tmp_path / "ledger" / "w0.jsonl", [*_sent("a", "0:0", 1), _done("0:0", 1.2), *_sent("b", "0:1", 2),
           _done("0:1", 2.2), {"event": "sending", "id": "e", "prompt": "0:2", "worker": "w0", "time": 2.5},
           *_sent("b2", "0:1", 5), _done("0:1", 5.2), *_sent("e2", "0:2", 6), _done("0:2", 6.2)])  # fmt: skip
    _write(tmp_path / "trajectories.jsonl", [_trained("a", 1), _trained("b2", 2), _trained("e2", 3)])
    report = check_ledger(tmp_path)
    assert report.ok, report.describe()
    assert (report.regenerated, report.cut, report.consumed) == (1, 1, 3)
    _write(tmp_path / "trajectories.jsonl", [_trained("a", 1), _trained("e2", 3)])  # b2 lost too: nothing came after
    assert [v for v in check_ledger(tmp_path).violations if "b2" in v]


def test_a_lost_trajectory_whose_prompt_waits_in_the_cursor_is_ok(tmp_path: Path) -> None:
    """b's spool file was torn; the worker re-opened its prompt, and the run ended before generating it again."""
    _write(tmp_path / "ledger" / "w0.jsonl", [*_sent("a", "0:0", 1), _done("0:0", 1.2), *_sent("b", "0:1", 2),
           _done("0:1", 2.2), {"event": "rejected", "id": "b", "reason": "spool_corrupt", "detail": "size",
                               "worker": "w0", "reopened": "0:1", "time": 3}])  # fmt: skip
    _write(tmp_path / "trajectories.jsonl", [_trained("a", 1)])
    assert not check_ledger(tmp_path).ok  # the cursor does not have it: lost for good
    (tmp_path / "rollout_cursor_w0.json").write_text(json.dumps({"pending": ["0:1"]}))
    report = check_ledger(tmp_path)
    assert report.ok and (report.requeued, report.spool_lost) == (1, 1), report.describe()


def test_a_trajectory_from_a_producer_that_never_started_is_a_violation(tmp_path: Path) -> None:
    """What a process outside the run that got onto the bus would leave: trained, from no worker of the run."""
    _write(tmp_path / "ledger" / "w0.jsonl", [*_sent("a", "0:0", 1), _done("0:0", 1.2)])
    _write(
        tmp_path / "trajectories.jsonl",
        [
            {"event": "start", "version": 0},
            _trained("a", 1),
            _trained("x", 1, worker="intruder"),
            _trained("y", 2, worker="intruder"),
        ],
    )
    report = check_ledger(tmp_path)
    assert not report.ok
    assert report.violations == [
        "trajectory x was trained from producer 'intruder', which never registered a start "
        "in ledger/<worker>.jsonl: not one of this run's rollout workers"
    ]


def test_the_ledger_summary_adds_up_for_a_reader() -> None:
    """produced = consumed + stale + waiting; the spool's count names the part of it already trained (kept until a
    checkpoint covers it), which is why consumed + pending may exceed produced."""
    from megatron_sao.run.ledger import LedgerReport

    r = LedgerReport(produced=115, consumed=96, stale_dropped=0, pending=67, pending_trained=48)
    first = r.describe().splitlines()[0]
    assert first.startswith("produced 115 = consumed 96 + dropped as stale 0 + waiting 19 (sent, not yet trained);")
    assert "pending in spools 67: the 19 waiting and 48 trained after the last checkpoint" in first
    assert "otherwise accounted" in LedgerReport(produced=10, consumed=5, pending=2).describe()


def test_the_ledger_compares_what_was_dropped_as_stale_with_what_was_trained(tmp_path) -> None:
    import json

    from megatron_sao.run.ledger import dropped_vs_trained

    (tmp_path / "stale.jsonl").write_text("".join(json.dumps(x) + "\n" for x in [
        {"trajectory_id": "a", "action": "dropped", "reward": 1.0, "turns": 6, "tokens": 600},
        {"trajectory_id": "b", "action": "kept", "reward": 0.0, "turns": 1, "tokens": 100},
        {"trajectory_id": "c", "action": "dropped", "reward": 0.0, "turns": 4, "tokens": 400}]))  # fmt: skip
    (tmp_path / "trajectories.jsonl").write_text("".join(json.dumps(x) + "\n" for x in [
        {"event": "start", "version": 0},
        {"id": "d", "reward": 0.0, "turns": 1, "tokens": 100, "pretrain": False},
        {"id": "e", "reward": 1.0, "turns": 3, "tokens": 300, "pretrain": False}]))  # fmt: skip
    assert dropped_vs_trained(tmp_path) == ("dropped as stale 2 (50.0%): reward 0.500, turns 5.00, tokens 500; "
                                            "trained 2: reward 0.500, turns 2.00, tokens 200")  # fmt: skip
    (tmp_path / "stale.jsonl").write_text("")
    assert dropped_vs_trained(tmp_path) is None


def test_garbage_ledger_lines_are_named_violations_not_a_traceback(tmp_path: Path) -> None:
    """A line that is not JSON, JSON that is not an object, or an object without the fields the checker reads is
    reported by its file and line (or left out), and the rest of the ledger is still checked."""
    lines = [x for i, tid in enumerate("ab") for x in (*_sent(tid, f"0:{i}", i + 1), _done(f"0:{i}", i + 1.2))]
    _write(tmp_path / "ledger" / "w0.jsonl", lines)
    _write(tmp_path / "trajectories.jsonl", [{"event": "start", "version": 0}, _trained("a", 1), _trained("b", 2)])
    assert check_ledger(tmp_path).ok
    with open(tmp_path / "ledger" / "w0.jsonl", "a") as f:
        f.write('not json at all\n{"event": "produced"}\n')
    with open(tmp_path / "trajectories.jsonl", "a") as f:
        f.write("[1, 2]\n")
    report = check_ledger(tmp_path)
    assert not report.ok and report.consumed == 2 and report.produced == 2
    assert report.violations == [f"unreadable ledger line {tmp_path / 'ledger' / 'w0.jsonl'}:8",
                                 f"unreadable ledger line {tmp_path / 'trajectories.jsonl'}:4"]  # fmt: skip

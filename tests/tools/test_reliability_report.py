"""tools/reliability_report.py renders docs/reliability.md from the chaos suite's records and pytest's JUnit XML."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.multiproc
def test_the_document_is_rendered_from_the_records(tmp_path: Path) -> None:
    chaos = tmp_path / "records" / "chaos"
    chaos.mkdir(parents=True)
    faults = [{"fault": "SIGKILL engine", "recovered_s": 4.0, "until": "it answered /health"},
              {"fault": "spool file cut in half"}]  # fmt: skip
    ledger = {"produced": 10, "consumed": 8, "voided": 1, "stale_dropped": 2, "pending": 0, "regenerated": 0}
    (chaos / "chaos-seed1.json").write_text(json.dumps({"test": "chaos-seed1", "faults": faults, "ledger": ledger,
                                                        "ok": True, "seconds": 60.0}))  # fmt: skip
    again = [{**faults[0], "recovered_s": 6.0}]
    (chaos / "chaos-seed2.json").write_text(json.dumps({"test": "chaos-seed2", "faults": again, "ledger": ledger,
                                                        "ok": False, "seconds": 61.0}))  # fmt: skip
    (tmp_path / "records" / "junit.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.run.test_stop" name="test_a[sigterm]" time="3"/>'
        '<testcase classname="tests.run.test_stop" name="test_a[stop_file]" time="4"><failure/></testcase>'
        "</testsuite></testsuites>"
    )
    out = tmp_path / "reliability.md"
    done = subprocess.run([sys.executable, "tools/reliability_report.py", "--from", str(tmp_path / "records"),
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert "| chaos-seed1 | SIGKILL engine; spool file cut in half | 10 | 8 | 1 | 2 | 0 | 0 | OK | 60.0 |" in text
    assert "| chaos-seed2 | SIGKILL engine | 10 | 8 | 1 | 2 | 0 | 0 | VIOLATIONS | 61.0 |" in text
    assert "| SIGKILL engine | 2 | 5.0 | 6.0 | it answered /health |" in text  # median and max of 4.0 and 6.0
    assert "| SIGTERM / SIGINT / STOP file; a leftover engine on the run's ports | 1 | failed | 7 |" in text  # 1 test
    cmd = [sys.executable, "tools/reliability_report.py", "--from", str(tmp_path / "no"), "--out", str(tmp_path / "x")]
    empty = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert empty.returncode != 0 and "no chaos records" in empty.stderr

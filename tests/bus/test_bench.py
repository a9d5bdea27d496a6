"""tools/bus_bench.py runs end to end and prints one line per size (the throughput itself is machine-dependent)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

LINE = re.compile(
    r"^(\d+) tokens: bus ([\d.]+) GB/s, raw ([\d.]+) GB/s, ratio ([\d.]+) \(bus \d+ traj/s, raw \d+ traj/s; .*\)$"
)


@pytest.mark.slow
@pytest.mark.multiproc
def test_bench_prints_one_line_per_size() -> None:
    cmd = [sys.executable, str(REPO / "tools" / "bus_bench.py"), "--sizes", "1024", "32768", "--target-mb", "16"]
    out = subprocess.run(
        [*cmd, "--repeats", "1", "--timeout-s", "30"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=True,
    ).stdout
    matches = [LINE.match(line) for line in out.splitlines()]
    assert [int(m.group(1)) for m in matches if m] == [1024, 32768], out
    assert all(float(m.group(2)) > 0 and float(m.group(3)) > 0 for m in matches if m)

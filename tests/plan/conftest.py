"""Fixtures of the planner tests: tiny random HF models of each family with three layers (an uneven PP=2 split)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_sao.models.tiny import make_tiny_model

FAMILIES = ("qwen3_moe", "glm4_moe", "glm_moe_dsa")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plan-hf")
    return {f: make_tiny_model(f, root / f, layers=3, seed=2, tokenizer=False) for f in FAMILIES}

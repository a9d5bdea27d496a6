"""Fixtures of the learner tests: tiny random HF models of each family, made once per session."""

from __future__ import annotations

import pytest

from megatron_sao.models.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """tiny_hf_dir(family) -> a tiny random HF model directory (made once per session and family)."""
    made = {}

    def make(family: str):
        if family not in made:
            made[family] = make_tiny_model(family, tmp_path_factory.mktemp(f"tiny-{family}"), seed=1)
        return made[family]

    return make

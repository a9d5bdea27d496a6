"""fp32 logit parity of converted checkpoints with transformers at TP=1 (one process) and at TP=2, EP=2, PP=2
(2 gloo ranks, one spawn switching layouts), and layout independence of a checkpoint converted once."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import DENSE, FAMILIES, INIT_STD
from conversion_helpers import TOOLS

PARITY_TOL = 1e-5
"""Observed max |diff| is ~2e-6 with logits up to ~4 (fp32, init_std=0.1); 1e-5 leaves 5x room."""


def _max_diff(logits: np.ndarray, reference: torch.Tensor) -> float:
    return float((torch.from_numpy(logits) - reference).abs().max())


def test_reference_logits_are_large_enough_for_parity_to_mean_something(hf_reference_logits):
    for name, logits in hf_reference_logits.items():
        assert float(logits.abs().max()) > 1.0, name  # init_std=INIT_STD, not transformers' 0.02
        assert float(logits.std()) > 0.1, name
    assert INIT_STD == 0.1


@pytest.mark.parametrize("name", [*FAMILIES, "qwen3_moe_tied", "glm4_moe_mtp", *DENSE])
def test_tp1_logits_match_transformers(name, conversions, hf_reference_logits):
    assert _max_diff(conversions["tp1"][name], hf_reference_logits[name]) <= PARITY_TOL


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["tp2", "ep2", "pp2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_multi_rank_logits_match_transformers(family, layout, multi_rank_logits, hf_reference_logits):
    produced = [rank[family][layout] for rank in multi_rank_logits]
    if layout == "pp2":
        assert produced[0] is None and produced[1] is not None  # only the last stage has logits
    produced = [p for p in produced if p is not None]
    assert produced
    for logits in produced:
        assert _max_diff(logits, hf_reference_logits[family]) <= PARITY_TOL


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["tp2", "pp2", "tp2nosp"])
@pytest.mark.parametrize("name", DENSE)
def test_dense_models_logits_match_transformers_at_tp2_with_and_without_sequence_parallel_and_pp2(
    name, layout, multi_rank_logits, hf_reference_logits
):  # fmt: skip
    """The dense families (issue 49): Qwen3 (q/k norms) and Llama with tied embeddings, at TP=2 (with and without
    sequence parallelism: the default at TP > 1) and PP=2 (the tied output layer on the last stage)."""
    produced = [p for p in (rank[name][layout] for rank in multi_rank_logits) if p is not None]
    assert produced
    for logits in produced:
        assert _max_diff(logits, hf_reference_logits[name]) <= PARITY_TOL


@pytest.mark.multiproc
def test_tied_embeddings_reach_the_last_pipeline_stage(multi_rank_logits, hf_reference_logits):
    last_stage = multi_rank_logits[1]["qwen3_moe_tied"]["pp2"]
    assert _max_diff(last_stage, hf_reference_logits["qwen3_moe_tied"]) <= PARITY_TOL


@pytest.mark.multiproc
@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_converted_once_gives_identical_logits_under_two_layouts(family, conversions, multi_rank_logits):
    """EP=2 and PP=2 do the TP=1 arithmetic (experts and layers only move), so the logits are bitwise equal;
    TP=2 splits matmul reductions and agrees to float rounding."""
    tp1 = conversions["tp1"][family]
    ep2, pp2 = multi_rank_logits[0][family]["ep2"], multi_rank_logits[1][family]["pp2"]
    np.testing.assert_array_equal(ep2, pp2)
    np.testing.assert_array_equal(ep2, tp1)
    np.testing.assert_allclose(multi_rank_logits[0][family]["tp2"], tp1, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.multiproc
def test_check_parity_cli_converts_spawns_its_ranks_and_sets_the_exit_code(tiny_models):
    cmd = [sys.executable, str(TOOLS / "check_parity.py"), "--hf", str(tiny_models["glm4_moe"]), "--tp", "2"]
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert ok.stdout.startswith("OK: max |logit diff| = ") and "on 2 rank(s)" in ok.stdout
    strict = subprocess.run([*cmd[:-2], "--pp", "2", "--tol", "1e-12"], capture_output=True, text=True, timeout=600)
    assert strict.returncode == 1, strict.stderr[-3000:]
    assert strict.stdout.startswith("FAIL")

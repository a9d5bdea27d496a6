"""Session fixtures of the conversion tests: tiny HF models, and the megatron-side work done once in spawned
ranks (conversions, round trips, TP=1 logits, bad-input errors; then TP=2 / EP=2 / PP=2 logits on 2 ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conversion_helpers import edit_config, edit_tensors

from megatron_sao.distributed import spawn_ranks
from megatron_sao.models.tiny import make_tiny_model

INIT_STD = 0.1
FAMILIES = ("qwen3_moe", "glm4_moe", "glm_moe_dsa")
DENSE = ("qwen3", "llama_tied")
"""The dense families (issue 49): Qwen3 dense, and Llama with tied embeddings (SmolLM2's layout)."""
FP32_MODELS = (*FAMILIES, "qwen3_moe_tied", "glm4_moe_mtp", *DENSE)
BATCH, SEQ = 2, 16


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """fp32 models of each family, bf16 variants (GLM's router stays fp32 on disk), tied embeddings (with and
    without a stored lm_head copy), and a GLM-4.5 model carrying an MTP layer the megatron model does not build."""
    root = tmp_path_factory.mktemp("hf")
    models = {f: make_tiny_model(f, root / f, init_std=INIT_STD, seed=1) for f in FAMILIES}
    models["qwen3"] = make_tiny_model("qwen3", root / "qwen3", init_std=INIT_STD, seed=4)
    models["llama_tied"] = make_tiny_model("llama", root / "llama_tied", init_std=INIT_STD, tie_embeddings=True, seed=5)
    for f in ("qwen3_moe", "glm4_moe"):
        models[f"{f}_bf16"] = make_tiny_model(f, root / f"{f}_bf16", init_std=INIT_STD, dtype="bf16", seed=2)
    models["qwen3_moe_tied"] = make_tiny_model(
        "qwen3_moe", root / "qwen3_moe_tied", init_std=INIT_STD, tie_embeddings=True, seed=3
    )

    def store_lm_head(t: dict) -> None:
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    models["qwen3_moe_tied_stored"] = edit_tensors(
        models["qwen3_moe_tied"], root / "qwen3_moe_tied_stored", store_lm_head
    )

    def add_mtp_layer(t: dict) -> None:  # GLM-4.5 stores its MTP block as layer num_hidden_layers
        g = torch.Generator().manual_seed(5)
        t["model.layers.2.eh_proj.weight"] = torch.randn(64, 128, generator=g)
        t["model.layers.2.enorm.weight"] = torch.randn(64, generator=g)

    models["glm4_moe_mtp"] = edit_tensors(models["glm4_moe"], root / "glm4_moe_mtp", add_mtp_layer)
    return models


@pytest.fixture(scope="session")
def tokens() -> torch.Tensor:
    from megatron_sao.convert.parity import sample_tokens

    return sample_tokens(512, BATCH, SEQ, seed=0)


@pytest.fixture(scope="session")
def hf_reference_logits(tiny_models: dict[str, Path], tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    from megatron_sao.convert.parity import hf_logits

    return {name: hf_logits(tiny_models[name], tokens) for name in FP32_MODELS}


@pytest.fixture(scope="session")
def conversions(
    tiny_models: dict[str, Path], tokens: torch.Tensor, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Everything the world-size-1 worker computes (tests/models/conversion_helpers.py)."""
    from conversion_helpers import conversion_worker

    root = tmp_path_factory.mktemp("megatron")
    qwen = tiny_models["qwen3_moe"]

    def wrong_shape(t: dict) -> None:
        t["model.layers.0.mlp.experts.1.up_proj.weight"] = torch.zeros(33, 64)

    bad_hf = {"hf_shape": str(edit_tensors(qwen, root / "hf_wrong_shape", wrong_shape))}
    other = edit_config(qwen, root / "hf_other_config", moe_intermediate_size=48)
    (result,) = spawn_ranks(
        conversion_worker,
        1,
        {k: str(v) for k, v in tiny_models.items()},
        list(FP32_MODELS),
        bad_hf,
        str(other),
        str(root),
        tokens,
        timeout_s=600,
    )
    return result


@pytest.fixture(scope="session")
def multi_rank_logits(
    tiny_models: dict[str, Path], conversions: dict[str, Any], tokens: torch.Tensor
) -> list[dict[str, Any]]:
    """Per rank (2 gloo ranks, one spawn): {model: {layout: logits or None}} at TP=2, EP=2 and PP=2."""
    from conversion_helpers import multi_rank_worker

    jobs = {f: (str(tiny_models[f]), conversions["ckpt"][f], ["tp2", "ep2", "pp2"]) for f in FAMILIES}
    jobs["qwen3_moe_tied"] = (str(tiny_models["qwen3_moe_tied"]), conversions["ckpt"]["qwen3_moe_tied"], ["pp2"])
    for name in DENSE:  # no experts: TP=2 (sequence parallel, as by default) and without it, PP=2
        jobs[name] = (str(tiny_models[name]), conversions["ckpt"][name], ["tp2", "pp2", "tp2nosp"])
    return spawn_ranks(multi_rank_worker, 2, jobs, tokens, timeout_s=600)

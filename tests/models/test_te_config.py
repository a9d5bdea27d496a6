"""The GPU (Transformer Engine) configuration, checked on CPU where it can be: the TransformerConfig each family
gets with TE, the one TE/THD decision, and the checkpoint filter for TE's extra states. The TE layers themselves
only run on a GPU (benchmarks/gpu_qwen3_slice.py is the prepared device check)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from conftest import FAMILIES

from megatron_sao.config import ParallelConfig
from megatron_sao.models import builder
from megatron_sao.models.builder import ModelSpec, transformer_config, uses_transformer_engine
from megatron_sao.models.checkpoint import drop_extra_state, is_extra_state


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_gets_a_valid_te_config(family: str, tiny_models, monkeypatch) -> None:
    """MLATransformerConfig refuses fused RoPE without YaRN; megatron's output layer refuses gradient-accumulation
    fusion without apex's kernel (not part of TE). Both must follow from the model and the install."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel.layers import _grad_accum_fusion_available

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)  # TE's kernel, as on a GPU

    spec = ModelSpec.from_hf_dir(str(tiny_models[family]), dtype="bf16")
    config = transformer_config(spec, ParallelConfig(), use_te=True)
    assert config.moe_grouped_gemm and config.bias_activation_fusion
    assert config.apply_rope_fusion == (not spec.family.multi_latent_attention)
    assert config.gradient_accumulation_fusion == _grad_accum_fusion_available


def test_te_needs_megatrons_te_specs_and_bf16(monkeypatch, tiny_models) -> None:
    from megatron.core.models.gpt import gpt_layer_specs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    te = types.ModuleType("transformer_engine")
    te.pytorch = types.ModuleType("transformer_engine.pytorch")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te.pytorch)
    monkeypatch.setattr(gpt_layer_specs, "HAVE_TE", False)  # TE imports, megatron cannot use it
    assert not builder.transformer_engine_available()
    monkeypatch.setattr(gpt_layer_specs, "HAVE_TE", True)
    assert builder.transformer_engine_available()
    bf16 = ModelSpec.from_hf_dir(str(tiny_models["qwen3_moe"]), dtype="bf16")
    fp32 = ModelSpec.from_hf_dir(str(tiny_models["qwen3_moe"]), dtype="fp32")
    assert uses_transformer_engine(bf16) and not uses_transformer_engine(fp32)  # no fp32 THD attention in TE


def test_te_grouped_expert_extra_states_are_dropped() -> None:
    keys = [
        "decoder.layers.0.mlp.experts.linear_fc1._extra_state",
        "decoder.layers.0.mlp.experts.linear_fc1._extra_state1",
        "decoder.layers.0.mlp.experts.linear_fc1._extra_state17",
        "decoder.layers.0.mlp.experts.linear_fc1.weight3",
        "decoder.layers.0.self_attention.linear_qkv.weight",
    ]
    assert [k for k in keys if is_extra_state(k)] == keys[:3]
    assert list(drop_extra_state(dict.fromkeys(keys, 0))) == keys[3:]

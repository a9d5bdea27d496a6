"""The HF <-> megatron name mapping and the canonical checkpoint key space: one key per tensor whatever the layer
spec (local or Transformer Engine), QKV grouping, GLU fusion, expert placement per EP rank, tied embeddings."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES

from megatron_sao.models.builder import ModelSpec
from megatron_sao.models.checkpoint import canonical_key
from megatron_sao.models.mapping import (
    AttentionShape,
    canonical_from_param_name,
    checkpoint_key,
    fuse_qkv,
    split_qkv,
)
from megatron_sao.models.weights import weight_mapping


def _layer_kinds(spec: ModelSpec) -> tuple[list[int], bool]:
    arch = spec.family.architecture(spec.hf)
    return list(arch["moe_layer_freq"]), spec.family.multi_latent_attention


def _kind(name: str, moe: list[int]) -> bool:
    parts = name.split(".")
    return name.startswith("decoder.layers.") and bool(moe[int(parts[2])])


@pytest.mark.parametrize("family", FAMILIES)
def test_local_spec_emits_the_keys_checkpoint_key_predicts(family, tiny_models, conversions):
    spec = ModelSpec.from_hf_dir(tiny_models[family])
    moe, mla = _layer_kinds(spec)
    predicted = {checkpoint_key(n, "local", moe_layer=_kind(n, moe), mla=mla) for n in weight_mapping(spec).rules}
    emitted = {(key, tuple(axes)) for key, axes in conversions["local_keys"][family]}
    assert emitted == predicted


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("spec_name", ["local", "te"])
def test_every_spec_spelling_canonicalizes_to_the_one_on_disk_key(family, spec_name, tiny_models):
    spec = ModelSpec.from_hf_dir(tiny_models[family])
    moe, mla = _layer_kinds(spec)
    for name in weight_mapping(spec).rules:
        key, axes = checkpoint_key(name, spec_name, moe_layer=_kind(name, moe), mla=mla)
        canonical, canonical_axes = checkpoint_key(name, "canonical")
        assert (canonical_key(f"policy.{key}"), axes) == (f"policy.{canonical}", canonical_axes), name


def test_te_spec_spells_fused_norms_as_megatron_te_layers_do():
    # megatron-core gpt_layer_specs: TELayerNormColumnParallelLinear for linear_qkv (GQA), linear_q/kv_up_proj
    # (MLA with qk_layernorm) and linear_fc1 of dense MLPs; a separate TENorm pre_mlp_layernorm for MoE layers.
    layer = "decoder.layers.3."
    assert (
        checkpoint_key(layer + "input_layernorm.weight", "te")[0]
        == layer + "self_attention.linear_qkv.layer_norm_weight"
    )
    assert checkpoint_key(layer + "pre_mlp_layernorm.weight", "te")[0] == layer + "mlp.linear_fc1.layer_norm_weight"
    assert (
        checkpoint_key(layer + "pre_mlp_layernorm.weight", "te", moe_layer=True)[0]
        == layer + "pre_mlp_layernorm.weight"
    )
    assert checkpoint_key(layer + "input_layernorm.weight", "te", mla=True)[0] == layer + "input_layernorm.weight"
    q_norm = checkpoint_key(layer + "self_attention.q_layernorm.weight", "te", mla=True)[0]
    assert q_norm == layer + "self_attention.linear_q_up_proj.layer_norm_weight"
    kv_norm = checkpoint_key(layer + "self_attention.kv_layernorm.weight", "te", mla=True)[0]
    assert kv_norm == layer + "self_attention.linear_kv_up_proj.layer_norm_weight"
    qk_norm = checkpoint_key(layer + "self_attention.q_layernorm.weight", "te")[0]  # GQA q/k norms are TENorms
    assert qk_norm == layer + "self_attention.q_layernorm.weight"


def test_experts_are_stacked_on_one_leading_axis_in_every_spec():
    name = "decoder.layers.5.mlp.experts.local_experts.7.linear_fc1.weight"
    expected = ("decoder.layers.5.mlp.experts.experts.linear_fc1.weight", (7,))
    assert checkpoint_key(name, "canonical") == checkpoint_key(name, "local") == checkpoint_key(name, "te") == expected


def test_expert_parameters_get_global_indices_per_ep_rank():
    # EP rank 1 of 2 with 4 local experts holds global experts 4..7; PP stage 1 of 2 holds layers 2..3.
    local = "module.decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"
    assert canonical_from_param_name(local, 2, 4) == "decoder.layers.2.mlp.experts.local_experts.5.linear_fc2.weight"
    grouped = "decoder.layers.1.mlp.experts.linear_fc1.weight3"  # TE grouped GEMM
    assert canonical_from_param_name(grouped, 2, 4) == "decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight"
    fused_norm = "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    assert canonical_from_param_name(fused_norm, 2, 4) == "decoder.layers.2.input_layernorm.weight"


def test_qkv_fusion_groups_each_kv_head_with_its_queries():
    shape = AttentionShape(num_heads=4, num_kv_heads=2, head_dim=3)
    q = torch.arange(12.0).repeat_interleave(5).view(12, 5)  # row r of head h: value 3h + d
    k, v = 100 + torch.arange(6.0).view(6, 1).expand(6, 5), 200 + torch.arange(6.0).view(6, 1).expand(6, 5)
    fused = fuse_qkv(q, k, v, shape)
    first_group = fused[:12, 0].tolist()  # q heads 0, 1 then k head 0, v head 0
    assert first_group == [0, 1, 2, 3, 4, 5, 100, 101, 102, 200, 201, 202]
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, shape), (q, k, v)))


def test_glu_weights_fuse_gate_above_up(tiny_models):
    mapping = weight_mapping(ModelSpec.from_hf_dir(tiny_models["qwen3_moe"]))
    name = "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"
    assert mapping.rule(name).hf == (
        "model.layers.1.mlp.experts.2.gate_proj.weight",
        "model.layers.1.mlp.experts.2.up_proj.weight",
    )
    gate, up = torch.zeros(3, 2), torch.ones(3, 2)
    fused = mapping.to_megatron(name, {mapping.rule(name).hf[0]: gate, mapping.rule(name).hf[1]: up}.__getitem__, 0)
    assert torch.equal(fused, torch.cat([gate, up]))


def test_router_and_expert_bias_and_shared_experts_are_mapped(tiny_models):
    mapping = weight_mapping(ModelSpec.from_hf_dir(tiny_models["glm4_moe"]))
    assert mapping.rule("decoder.layers.1.mlp.router.weight").hf == ("model.layers.1.mlp.gate.weight",)
    bias = mapping.rule("decoder.layers.1.mlp.router.expert_bias").hf
    assert bias == ("model.layers.1.mlp.gate.e_score_correction_bias",)
    shared = mapping.rule("decoder.layers.1.mlp.shared_experts.linear_fc1.weight")
    assert shared.hf[0] == "model.layers.1.mlp.shared_experts.gate_proj.weight" and shared.transform == "glu"


def test_tied_embeddings_map_no_output_layer(tiny_models):
    tied = weight_mapping(ModelSpec.from_hf_dir(tiny_models["qwen3_moe_tied"]))
    untied = weight_mapping(ModelSpec.from_hf_dir(tiny_models["qwen3_moe"]))
    assert "output_layer.weight" not in tied.rules and "lm_head.weight" not in tied.hf_names()
    assert untied.rule("output_layer.weight").hf == ("lm_head.weight",)


def test_vocab_rows_are_padded_for_megatron_and_cut_back_for_hf(tiny_models):
    mapping = weight_mapping(ModelSpec.from_hf_dir(tiny_models["qwen3_moe"]))
    embed = torch.randn(mapping.vocab_size, 4)  # 512 rows; pretend megatron pads to 640
    padded = mapping.to_megatron("embedding.word_embeddings.weight", lambda _: embed, 640)
    assert padded.shape == (640, 4) and torch.equal(padded[512:], torch.zeros(128, 4))
    assert torch.equal(mapping.to_hf("embedding.word_embeddings.weight", padded)[0][1], embed)

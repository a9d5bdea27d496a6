"""HF <-> megatron conversion: bit-exact round trips, what the megatron checkpoint holds, and refusal of bad input
with a message naming the problem. The megatron side runs in spawned ranks (conftest.conversions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conversion_helpers import edit_config, edit_tensors, load_tool

from megatron_sao.convert.hf_to_megatron import convert_hf_to_megatron
from megatron_sao.models.weights import HFCheckpoint

ROUND_TRIP_MODELS = [
    "qwen3_moe",
    "glm4_moe",
    "glm_moe_dsa",
    "qwen3_moe_bf16",
    "glm4_moe_bf16",
    "qwen3_moe_tied",
    "qwen3_moe_tied_stored",
    "glm4_moe_mtp",
    "qwen3",
    "llama_tied",
]


@pytest.mark.parametrize("name", ROUND_TRIP_MODELS)
def test_hf_megatron_hf_round_trip_is_bit_identical(name, tiny_models, conversions):
    source, back = HFCheckpoint(tiny_models[name]), HFCheckpoint(conversions["back"][name])
    assert sorted(back.names()) == sorted(source.names())
    for n in source.names():
        a, b = source.get(n), back.get(n)
        assert (b.dtype, b.shape) == (a.dtype, a.shape), n
        assert torch.equal(a, b), n


def test_checkpoint_without_hf_source_record_converts_back_in_the_config_dtype(tiny_models, conversions, tmp_path):
    assert conversions["errors"]["no_record"] == "no error"
    back = Path(conversions["ckpt"]["qwen3_moe"]).parent / "back_no_record"
    source, converted = HFCheckpoint(tiny_models["qwen3_moe"]), HFCheckpoint(back)
    assert sorted(converted.names()) == sorted(source.names())
    assert all(torch.equal(source.get(n), converted.get(n)) for n in source.names())


def test_round_trip_writes_an_index_shards_config_and_tokenizer(tiny_models, conversions):
    back = Path(conversions["back"]["qwen3_moe"])
    index = json.loads((back / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((back / s).is_file() for s in shards)  # 150KB shards of a ~560KB model
    assert shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (back / f).read_bytes() == (tiny_models["qwen3_moe"] / f).read_bytes(), f


def test_bf16_checkpoint_keeps_the_tensors_hf_keeps_in_fp32(conversions):
    stored = conversions["stored"]["glm4_moe_bf16"]
    assert stored["policy.decoder.layers.1.mlp.router.weight"][1] == "torch.float32"
    assert stored["policy.decoder.layers.1.mlp.router.expert_bias"][1] == "torch.float32"
    assert stored["policy.decoder.layers.1.mlp.experts.experts.linear_fc1.weight"][1] == "torch.bfloat16"
    assert stored["policy.decoder.layers.0.self_attention.linear_qkv.weight"][1] == "torch.bfloat16"


def test_bf16_model_loads_the_fp32_stored_router_rounded_once(conversions):
    assert conversions["bf16_router_exact"]


def test_checkpoint_uses_canonical_keys_under_the_policy_prefix(conversions):
    keys = set(conversions["stored"]["qwen3_moe"])
    assert all(k.startswith(("policy.", "passthrough.")) for k in keys)
    assert "policy.decoder.layers.0.input_layernorm.weight" in keys
    assert "policy.decoder.layers.1.pre_mlp_layernorm.weight" in keys
    assert not any("layer_norm_weight" in k for k in keys)
    shape, _ = conversions["stored"]["qwen3_moe"]["policy.decoder.layers.1.mlp.experts.experts.linear_fc1.weight"]
    assert shape == (4, 64, 64)  # experts stacked on a leading axis, [gate; up] fused


def test_tied_model_checkpoint_has_no_output_layer(conversions):
    assert not any(k.startswith("policy.output_layer") for k in conversions["stored"]["qwen3_moe_tied"])
    assert "policy.output_layer.weight" in conversions["stored"]["qwen3_moe"]


def test_dsa_indexer_and_mtp_tensors_travel_as_passthrough(tiny_models, conversions):
    dsa = {k for k in conversions["stored"]["glm_moe_dsa"] if k.startswith("passthrough.")}
    indexer = {f"passthrough.{n}" for n in HFCheckpoint(tiny_models["glm_moe_dsa"]).names() if ".indexer." in n}
    assert indexer and dsa == indexer
    mtp = {k for k in conversions["stored"]["glm4_moe_mtp"] if k.startswith("passthrough.")}
    assert mtp == {"passthrough.model.layers.2.eh_proj.weight", "passthrough.model.layers.2.enorm.weight"}


# ---------------------------------------------------------------- bad input


def test_unsupported_architecture_is_refused_listing_the_supported_ones(tiny_models, tmp_path):
    gpt2 = edit_config(tiny_models["qwen3_moe"], tmp_path / "gpt2", model_type="gpt2")
    with pytest.raises(ValueError, match="unsupported architecture: model_type='gpt2'") as e:
        convert_hf_to_megatron(gpt2, tmp_path / "out", progress=False)
    assert all(t in str(e.value) for t in ("qwen3_moe", "glm4_moe", "glm_moe_dsa", "qwen3", "llama"))


def test_non_empty_output_directory_is_refused_without_force(tiny_models, tmp_path, capsys):
    main = load_tool("convert_hf_to_megatron").main
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["--hf", str(tiny_models["qwen3_moe"]), "--out", str(out), "--quiet"]) == 2
    assert "is not empty; pass --force" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"


def test_missing_hf_tensor_is_named(tiny_models, tmp_path):
    def drop(t: dict) -> None:
        del t["model.layers.1.mlp.experts.3.down_proj.weight"]

    hf = edit_tensors(tiny_models["qwen3_moe"], tmp_path / "hf", drop)
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*model\.layers\.1\.mlp\.experts\.3\.down_proj\.weight"):
        convert_hf_to_megatron(hf, tmp_path / "out", progress=False)


def test_unexpected_hf_tensor_is_named(tiny_models, tmp_path):
    def add(t: dict) -> None:
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    hf = edit_tensors(tiny_models["qwen3_moe"], tmp_path / "hf", add)
    with pytest.raises(ValueError, match=r"does not know: model\.layers\.0\.self_attn\.rotary_emb\.inv_freq"):
        convert_hf_to_megatron(hf, tmp_path / "out", progress=False)


def test_hf_tensor_with_unsupported_dtype_is_named(tiny_models, tmp_path):
    def quantize(t: dict) -> None:
        t["model.layers.0.self_attn.o_proj.weight"] = t["model.layers.0.self_attn.o_proj.weight"].to(torch.int8)

    hf = edit_tensors(tiny_models["qwen3_moe"], tmp_path / "hf", quantize)
    with pytest.raises(
        ValueError, match=r"unsupported dtype: model\.layers\.0\.self_attn\.o_proj\.weight \(torch\.int8"
    ):
        convert_hf_to_megatron(hf, tmp_path / "out", progress=False)


def test_tied_config_with_a_different_lm_head_is_refused(tiny_models, tmp_path):
    def untie(t: dict) -> None:
        t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1

    hf = edit_tensors(tiny_models["qwen3_moe_tied"], tmp_path / "hf", untie)
    with pytest.raises(ValueError, match="tie_word_embeddings=true but lm_head.weight differs"):
        convert_hf_to_megatron(hf, tmp_path / "out", progress=False)


def test_hf_shape_mismatch_is_named(conversions):
    msg = conversions["errors"]["hf_shape"]
    assert msg.startswith("WeightMismatchError: HF tensor shape mismatch")
    assert "model.layers.0.mlp.experts.1.up_proj.weight: [33, 64], expected [32, 64]" in msg


def test_megatron_checkpoint_missing_a_tensor_is_named(conversions):
    msg = conversions["errors"]["ckpt_missing"]
    assert msg.startswith("CheckpointMismatchError") and "lacks 1 tensor" in msg
    assert "policy.decoder.layers.1.mlp.router.weight" in msg


def test_megatron_checkpoint_with_an_unexpected_tensor_is_named(conversions):
    msg = conversions["errors"]["ckpt_unexpected"]
    assert "does not hold: policy.decoder.layers.0.self_attention.extra_proj.weight" in msg


def test_megatron_checkpoint_shape_mismatch_is_named(conversions):
    assert "policy.decoder.final_layernorm.weight: [65], expected [64]" in conversions["errors"]["ckpt_shape"]


def test_megatron_checkpoint_dtype_mismatch_is_named(conversions):
    msg = conversions["errors"]["ckpt_dtype"]
    assert "dtype mismatch" in msg
    assert "policy.decoder.layers.0.self_attention.linear_proj.weight: torch.bfloat16, expected torch.float32" in msg


def test_megatron_checkpoint_from_another_config_is_refused_naming_the_fields(conversions):
    msg = conversions["errors"]["ckpt_other_config"]
    assert "converted from a different qwen3_moe config" in msg
    assert "moe_ffn_hidden_size: checkpoint 32 vs 48" in msg


def test_megatron_to_hf_refuses_a_directory_that_is_not_a_checkpoint(tiny_models, tmp_path):
    from megatron_sao.convert.megatron_to_hf import convert_megatron_to_hf

    with pytest.raises(ValueError, match="is not a megatron dist checkpoint"):
        convert_megatron_to_hf(tiny_models["qwen3_moe"], tmp_path / "out", tiny_models["qwen3_moe"], progress=False)


def test_force_replaces_a_non_empty_output_directory(conversions):
    assert "stale.txt" not in conversions["force_replaced"]
    assert {"metadata.json", "common.pt", ".metadata"} <= set(conversions["force_replaced"])

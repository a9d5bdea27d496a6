"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): GQA with per-head q/k RMSNorm, softmax top-k router, no shared
experts, RoPE over the whole head. Reference: transformers Qwen3MoeForCausalLM."""

from __future__ import annotations

from typing import Any

from megatron_sao.models.families.base import (
    HFConfig,
    ModelFamily,
    UnsupportedModelError,
    hf_get,
    require_default_rope,
    rope_theta,
)
from megatron_sao.models.mapping import (
    Rule,
    dense_mlp_rules,
    embedding_rules,
    gqa_attention_rules,
    moe_mlp_rules,
    norm_rules,
)


def _num_experts(hf: HFConfig) -> int:
    """transformers 5 writes `num_local_experts`; released Qwen3-MoE configs say `num_experts`."""
    value = hf_get(hf, "num_experts", hf_get(hf, "num_local_experts"))
    if value is None:
        raise UnsupportedModelError("qwen3_moe: config.json has neither num_experts nor num_local_experts")
    return int(value)


def _moe_layers(hf: HFConfig) -> list[int]:
    layers = int(hf_get(hf, "num_hidden_layers", required=True))
    sparse_step = int(hf_get(hf, "decoder_sparse_step", 1))
    mlp_only = set(hf_get(hf, "mlp_only_layers", []) or [])
    num_experts = _num_experts(hf)
    return [int(i not in mlp_only and num_experts > 0 and (i + 1) % sparse_step == 0) for i in range(layers)]


def weight_rules(hf: HFConfig) -> list[Rule]:
    rules = embedding_rules(bool(hf_get(hf, "tie_word_embeddings", False)))
    for layer, moe in enumerate(_moe_layers(hf)):
        rules += norm_rules(layer)
        rules += gqa_attention_rules(layer, qkv_bias=bool(hf_get(hf, "attention_bias", False)), qk_norm=True)
        if moe:
            rules += moe_mlp_rules(layer, _num_experts(hf), shared_experts=False, expert_bias=False)
        else:
            rules += dense_mlp_rules(layer)
    return rules


def architecture(hf: HFConfig) -> dict[str, Any]:
    require_default_rope(hf, "qwen3_moe")
    if hf_get(hf, "use_sliding_window", False):
        raise UnsupportedModelError("qwen3_moe: use_sliding_window=true is not supported (Qwen3-MoE ships it off)")
    layers = int(hf_get(hf, "num_hidden_layers", required=True))
    heads = int(hf_get(hf, "num_attention_heads", required=True))
    hidden = int(hf_get(hf, "hidden_size", required=True))
    num_experts = _num_experts(hf)
    return dict(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(hf_get(hf, "num_key_value_heads", heads)),
        kv_channels=int(hf_get(hf, "head_dim", hidden // heads)),
        ffn_hidden_size=int(hf_get(hf, "intermediate_size", required=True)),
        layernorm_epsilon=float(hf_get(hf, "rms_norm_eps", 1e-6)),
        qk_layernorm=True,
        add_qkv_bias=bool(hf_get(hf, "attention_bias", False)),
        rotary_base=rope_theta(hf),
        rotary_percent=1.0,
        num_moe_experts=num_experts,
        moe_router_topk=int(hf_get(hf, "num_experts_per_tok", required=True)),
        moe_ffn_hidden_size=int(hf_get(hf, "moe_intermediate_size", required=True)),
        # transformers: softmax over all experts, top-k, renormalize iff norm_topk_prob. megatron's default
        # (top-k on logits, then softmax over the k) is the renormalized form; pre-softmax is the other.
        moe_router_pre_softmax=not bool(hf_get(hf, "norm_topk_prob", False)),
        moe_router_score_function="softmax",
        moe_layer_freq=_moe_layers(hf),
    )


FAMILY = ModelFamily(
    name="qwen3_moe",
    hf_model_types=("qwen3_moe",),
    hf_architecture="Qwen3MoeForCausalLM",
    architecture=architecture,
    weight_rules=weight_rules,
)

"""GLM-4.5-style MoE (Glm4MoeForCausalLM): GQA with qkv bias, partial RoPE (first half of each head, rotate-half
layout), leading dense layers, sigmoid router with expert bias, one shared expert. MTP layers are not built."""

from __future__ import annotations

from typing import Any

from megatron_sao.models.families.base import (
    HFConfig,
    ModelFamily,
    dense_first_layers,
    dense_then_moe_rules,
    hf_get,
    is_mtp_weight,
    moe_layer_pattern,
    require_default_rope,
    rope_theta,
    sigmoid_router,
)
from megatron_sao.models.mapping import (
    Rule,
    gqa_attention_rules,
)


def partial_rotary_factor(hf: HFConfig) -> float:
    params = hf.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5)))


def weight_rules(hf: HFConfig) -> list[Rule]:
    bias, qk_norm = bool(hf_get(hf, "attention_bias", False)), bool(hf_get(hf, "use_qk_norm", False))
    return dense_then_moe_rules(hf, lambda layer: gqa_attention_rules(layer, bias, qk_norm))


def passthrough(hf: HFConfig, name: str) -> bool:
    """GLM-4.5 checkpoints carry multi-token-prediction layers after the last decoder layer; kept, not built."""
    return is_mtp_weight(hf, name)


def architecture(hf: HFConfig) -> dict[str, Any]:
    require_default_rope(hf, "glm4_moe")
    layers = int(hf_get(hf, "num_hidden_layers", required=True))
    heads = int(hf_get(hf, "num_attention_heads", required=True))
    hidden = int(hf_get(hf, "hidden_size", required=True))
    return dict(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(hf_get(hf, "num_key_value_heads", heads)),
        kv_channels=int(hf_get(hf, "head_dim", hidden // heads)),
        ffn_hidden_size=int(hf_get(hf, "intermediate_size", required=True)),
        layernorm_epsilon=float(hf_get(hf, "rms_norm_eps", 1e-5)),
        qk_layernorm=bool(hf_get(hf, "use_qk_norm", False)),
        add_qkv_bias=bool(hf_get(hf, "attention_bias", False)),
        rotary_base=rope_theta(hf),
        rotary_percent=partial_rotary_factor(hf),
        moe_layer_freq=moe_layer_pattern(layers, dense_first_layers(hf)),
        **sigmoid_router(hf, "glm4_moe"),
    )


FAMILY = ModelFamily(
    name="glm4_moe",
    hf_model_types=("glm4_moe",),
    hf_architecture="Glm4MoeForCausalLM",
    architecture=architecture,
    weight_rules=weight_rules,
    passthrough=passthrough,
)

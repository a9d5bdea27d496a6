"""GLM-5 class (GlmMoeDsaForCausalLM, model_type glm_moe_dsa; GLM-5.2 750B-A40B): multi-latent attention with
a DeepSeek sparse-attention (DSA) indexer, leading dense layers, sigmoid router with expert bias, shared expert.

The learner builds dense MLA by default. DSA restricts each query to the indexer's top-k keys; for sequences
no longer than `index_topk` every key is selected, so dense MLA is exact there, and the indexer's weights travel
through checkpoints unchanged. `model.use_dsa_indexer=true` is refused with the reasons megatron-core 0.16's DSA
module cannot serve (builder.DSA_UNAVAILABLE, docs/models.md)."""

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
    mla_attention_rules,
)


def weight_rules(hf: HFConfig) -> list[Rule]:
    q_lora = hf_get(hf, "q_lora_rank") is not None
    return dense_then_moe_rules(hf, lambda layer: mla_attention_rules(layer, q_lora=q_lora))


def passthrough(hf: HFConfig, name: str) -> bool:
    """The DSA indexer's weights (dense MLA does not use them) and any MTP layers travel unchanged."""
    return is_mtp_weight(hf, name) or (name.startswith("model.layers.") and ".self_attn.indexer." in name)


def architecture(hf: HFConfig) -> dict[str, Any]:
    require_default_rope(hf, "glm_moe_dsa")
    layers = int(hf_get(hf, "num_hidden_layers", required=True))
    heads = int(hf_get(hf, "num_attention_heads", required=True))
    return dict(
        num_layers=layers,
        hidden_size=int(hf_get(hf, "hidden_size", required=True)),
        num_attention_heads=heads,
        num_query_groups=heads,
        ffn_hidden_size=int(hf_get(hf, "intermediate_size", required=True)),
        layernorm_epsilon=float(hf_get(hf, "rms_norm_eps", 1e-5)),
        qk_layernorm=True,  # MLA: the q_a / kv_a latent RMSNorms
        q_lora_rank=hf_get(hf, "q_lora_rank"),
        kv_lora_rank=int(hf_get(hf, "kv_lora_rank", required=True)),
        qk_head_dim=int(hf_get(hf, "qk_nope_head_dim", required=True)),
        qk_pos_emb_head_dim=int(hf_get(hf, "qk_rope_head_dim", required=True)),
        v_head_dim=int(hf_get(hf, "v_head_dim", required=True)),
        rope_type="rope",
        rotary_base=rope_theta(hf),
        rotary_percent=1.0,
        moe_layer_freq=moe_layer_pattern(layers, dense_first_layers(hf)),
        dsa_indexer_n_heads=int(hf_get(hf, "index_n_heads", 0)) or None,
        dsa_indexer_head_dim=int(hf_get(hf, "index_head_dim", 0)) or None,
        dsa_indexer_topk=int(hf_get(hf, "index_topk", 0)) or None,
        **sigmoid_router(hf, "glm_moe_dsa"),
    )


FAMILY = ModelFamily(
    name="glm_moe_dsa",
    hf_model_types=("glm_moe_dsa",),
    hf_architecture="GlmMoeDsaForCausalLM",
    architecture=architecture,
    weight_rules=weight_rules,
    passthrough=passthrough,
    multi_latent_attention=True,
    mla_latent_norm_eps=1e-6,  # transformers' GlmMoeDsaAttention builds q_a/kv_a_layernorm with the default 1e-6
)

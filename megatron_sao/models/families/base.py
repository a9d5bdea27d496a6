"""What a model family is: how an HF config.json becomes megatron-core TransformerConfig arguments, and the
HF<->megatron weight mapping (mapping/) of its checkpoints. One module per family registers one ModelFamily."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_sao.models.mapping import Rule

HFConfig = dict[str, Any]
"""config.json as a plain dict (with model.hf_overrides applied)."""


class UnsupportedModelError(ValueError):
    """The HF config describes something the family (or megatron-core) cannot represent; says what and why."""


@dataclass(frozen=True)
class ModelFamily:
    name: str
    """Registry key, e.g. qwen3_moe (also `model.family` in the config)."""
    hf_model_types: tuple[str, ...]
    """config.json `model_type` values this family accepts."""
    hf_architecture: str
    """transformers class name (the parity reference), e.g. Qwen3MoeForCausalLM."""
    architecture: Callable[[HFConfig], dict[str, Any]]
    """HF config -> TransformerConfig keyword arguments describing the network (no parallelism, no dtype)."""
    weight_rules: Callable[[HFConfig], list[Rule]] = field(default=lambda hf: [])
    """HF config -> the mapping rules of every megatron tensor (models/mapping.py)."""
    passthrough: Callable[[HFConfig, str], bool] = field(default=lambda hf, name: False)
    """HF tensors the megatron model does not use but checkpoints carry unchanged (e.g. MTP layers)."""
    multi_latent_attention: bool = False
    """Build an MLATransformerConfig (MLA attention) instead of a TransformerConfig."""
    mla_latent_norm_eps: float | None = None
    """Fixed eps of the MLA q/kv latent RMSNorms when the checkpoint's differs from rms_norm_eps."""


def hf_get(hf: HFConfig, key: str, default: Any = None, *, required: bool = False) -> Any:
    if key in hf and hf[key] is not None:
        return hf[key]
    if required:
        raise UnsupportedModelError(f"config.json has no {key!r}; it is required to build this model")
    return default


def rope_theta(hf: HFConfig, default: float = 10000.0) -> float:
    """rope_theta from transformers 5 `rope_parameters` or the older top-level key."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return float(params.get("rope_theta", hf.get("rope_theta", default)))


def rope_type(hf: HFConfig) -> str:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    return "default" if kind in (None, "default") else str(kind)


def require_default_rope(hf: HFConfig, family: str) -> None:
    kind = rope_type(hf)
    if kind != "default":
        raise UnsupportedModelError(
            f"{family}: rope_type {kind!r} is not mapped to megatron-core yet (only the default RoPE is); "
            f"remove rope scaling from config.json or add the mapping in megatron_sao/models/families/"
        )


def moe_layer_pattern(num_layers: int, dense_first: int) -> list[int]:
    """megatron moe_layer_freq list: 0 = dense MLP layer, 1 = MoE layer."""
    return [0] * min(dense_first, num_layers) + [1] * max(0, num_layers - dense_first)


def sigmoid_router(hf: HFConfig, family: str, num_experts_key: str = "n_routed_experts") -> dict[str, Any]:
    """DeepSeek-V3-style router (GLM-4.5/GLM-5): sigmoid scores, expert-bias (aux-loss-free) top-k selection,
    group-limited routing, normalized top-k weights times routed_scaling_factor, shared experts."""
    topk = int(hf_get(hf, "num_experts_per_tok", required=True))
    n_group = int(hf_get(hf, "n_group", 1))
    topk_group = int(hf_get(hf, "topk_group", 1))
    if not hf_get(hf, "norm_topk_prob", True) and topk > 1:
        raise UnsupportedModelError(
            f"{family}: norm_topk_prob=false with a sigmoid router has no megatron-core equivalent "
            f"(megatron always normalizes sigmoid top-k weights)"
        )
    groups: dict[str, Any] = {}
    if n_group > 1:
        if topk % topk_group or topk // topk_group != 2:
            raise UnsupportedModelError(
                f"{family}: group-limited routing scores groups by their top-2 experts in transformers but by "
                f"top-(topk/topk_group)={topk // max(topk_group, 1)} in megatron-core; only topk/topk_group == 2 maps"
            )
        groups = dict(moe_router_num_groups=n_group, moe_router_group_topk=topk_group)
    shared = int(hf_get(hf, "n_shared_experts", 0) or 0)
    moe_ffn = int(hf_get(hf, "moe_intermediate_size", required=True))
    return dict(
        num_moe_experts=int(hf_get(hf, num_experts_key, required=True)),
        moe_router_topk=topk,
        moe_ffn_hidden_size=moe_ffn,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=float(hf_get(hf, "routed_scaling_factor", 1.0)),
        moe_shared_expert_intermediate_size=moe_ffn * shared if shared else None,
        **groups,
    )


def dense_first_layers(hf: HFConfig) -> int:
    """Leading dense layers: `first_k_dense_replace`, or the count of 'dense' in `mlp_layer_types`."""
    types = hf.get("mlp_layer_types")
    if types:
        pattern = [0 if t == "dense" else 1 for t in types]
        first = pattern.index(1) if 1 in pattern else len(pattern)
        if any(p == 0 for p in pattern[first:]):
            raise UnsupportedModelError("mlp_layer_types with dense layers after the first MoE layer are not mapped")
        return first
    return int(hf_get(hf, "first_k_dense_replace", 0))


def dense_then_moe_rules(hf: HFConfig, attention_rules: Callable[[int], list[Rule]]) -> list[Rule]:
    """Weight rules of the GLM / DeepSeek layout: `first_k_dense_replace` dense layers, then MoE layers with a
    sigmoid router, expert bias and optional shared experts; `attention_rules(layer)` gives the attention."""
    from megatron_sao.models.mapping import dense_mlp_rules, embedding_rules, moe_mlp_rules, norm_rules

    rules = embedding_rules(bool(hf_get(hf, "tie_word_embeddings", False)))
    dense = dense_first_layers(hf)
    shared = int(hf_get(hf, "n_shared_experts", 0) or 0) > 0
    for layer in range(int(hf_get(hf, "num_hidden_layers", required=True))):
        rules += norm_rules(layer) + attention_rules(layer)
        if layer < dense:
            rules += dense_mlp_rules(layer)
        else:
            rules += moe_mlp_rules(layer, int(hf["n_routed_experts"]), shared_experts=shared, expert_bias=True)
    return rules


def is_mtp_weight(hf: HFConfig, name: str) -> bool:
    """Multi-token-prediction layers sit after the last decoder layer in GLM/DeepSeek checkpoints."""
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    return m is not None and int(m.group(1)) >= int(hf_get(hf, "num_hidden_layers", required=True))


def dense_architecture(hf: HFConfig, family: str, qk_norm: bool) -> dict[str, Any]:
    """TransformerConfig arguments of a dense decoder (Llama's layout: GQA, SwiGLU, RMSNorm, RoPE over the whole
    head), with per-head q/k RMSNorm when `qk_norm` (Qwen3). Biases on the attention (transformers puts them on q, k, v
    and o alike) or the MLP have no megatron-core equivalent here and are refused."""
    require_default_rope(hf, family)
    for key in ("attention_bias", "mlp_bias"):
        if hf_get(hf, key, False):
            raise UnsupportedModelError(f"{family}: {key}=true is not mapped (megatron-core's bias covers every "
                                        "linear layer or only q/k/v; this layout biases others)")  # fmt: skip
    heads = int(hf_get(hf, "num_attention_heads", required=True))
    hidden = int(hf_get(hf, "hidden_size", required=True))
    return dict(
        num_layers=int(hf_get(hf, "num_hidden_layers", required=True)),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(hf_get(hf, "num_key_value_heads", heads)),
        kv_channels=int(hf_get(hf, "head_dim", hidden // heads)),
        ffn_hidden_size=int(hf_get(hf, "intermediate_size", required=True)),
        layernorm_epsilon=float(hf_get(hf, "rms_norm_eps", 1e-6)),
        qk_layernorm=qk_norm,
        add_qkv_bias=False,
        rotary_base=rope_theta(hf),
        rotary_percent=1.0,
    )


def dense_rules(hf: HFConfig, qk_norm: bool) -> list[Rule]:
    """Weight rules of a dense decoder: embeddings (tied or not), and per layer its norms, GQA attention and MLP."""
    from megatron_sao.models.mapping import dense_mlp_rules, embedding_rules, gqa_attention_rules, norm_rules

    rules = embedding_rules(bool(hf_get(hf, "tie_word_embeddings", False)))
    for layer in range(int(hf_get(hf, "num_hidden_layers", required=True))):
        rules += norm_rules(layer) + gqa_attention_rules(layer, qkv_bias=False, qk_norm=qk_norm)
        rules += dense_mlp_rules(layer)
    return rules

"""Qwen3 dense (Qwen3-0.6B ... Qwen3-32B): Llama's layout plus per-head q/k RMSNorm and an explicit head_dim.
Reference: transformers Qwen3ForCausalLM."""

from __future__ import annotations

from megatron_sao.models.families.base import (
    ModelFamily,
    UnsupportedModelError,
    dense_architecture,
    dense_rules,
    hf_get,
)


def _architecture(hf: dict) -> dict:
    if hf_get(hf, "use_sliding_window", False):
        raise UnsupportedModelError("qwen3: use_sliding_window=true is not supported (Qwen3 ships it off)")
    return dense_architecture(hf, "qwen3", qk_norm=True)


FAMILY = ModelFamily(
    name="qwen3",
    hf_model_types=("qwen3",),
    hf_architecture="Qwen3ForCausalLM",
    architecture=_architecture,
    weight_rules=lambda hf: dense_rules(hf, qk_norm=True),
)

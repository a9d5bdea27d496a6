"""Llama (Llama-2/3 without rope scaling, SmolLM2, and the many models of its layout): dense, grouped-query attention
without q/k norms or biases, a SwiGLU MLP, RMSNorm, RoPE over the whole head, often tied embeddings (SmolLM2).
Reference: transformers LlamaForCausalLM."""

from __future__ import annotations

from megatron_sao.models.families.base import ModelFamily, dense_architecture, dense_rules

FAMILY = ModelFamily(
    name="llama",
    hf_model_types=("llama",),
    hf_architecture="LlamaForCausalLM",
    architecture=lambda hf: dense_architecture(hf, "llama", qk_norm=False),
    weight_rules=lambda hf: dense_rules(hf, qk_norm=False),
)

"""Multi-latent attention pieces for megatron-core's local (non-TE) spec.

* megatron-core 0.16's local `DotProductAttention` assumes query/key and value heads share `kv_channels`, so
  `MLASelfAttention` (k_channels = qk_nope + qk_rope, v_channels = v_head_dim) cannot build on the local spec.
  `LatentDotProductAttention` is the same eager attention with a separate value head size.
* megatron builds every norm with `config.layernorm_epsilon`, but GLM-5/DeepSeek checkpoints normalize the q/kv
  latents with eps 1e-6 whatever rms_norm_eps is; `latent_norm(eps)` pins it.
The builder swaps both into MLA layer specs when Transformer Engine is not used (TE's attention handles the
head sizes on GPU; its fused latent norm uses layernorm_epsilon, see docs/models.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm


class LatentDotProductAttention(DotProductAttention):
    """DotProductAttention whose value heads may be narrower or wider than the query/key heads."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(
            config, layer_number, attn_mask_type, attention_type, attention_dropout, softmax_scale,
            cp_comm_type, pg_collection,
        )  # fmt: skip
        if v_channels is not None:
            # The output reshape ([sq, b, np, v] -> [sq, b, np * v]) uses hidden_size_per_partition.
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


def latent_norm(eps: float) -> type:
    """A norm class for MLA's q/kv latent norms that ignores the eps megatron passes and uses `eps`."""

    class LatentRMSNorm:
        def __new__(cls, config: Any, hidden_size: int, eps_from_config: float | None = None, **kwargs: Any) -> Any:
            return WrappedTorchNorm(config, hidden_size, eps)

    LatentRMSNorm.__name__ = f"LatentRMSNorm(eps={eps})"
    return LatentRMSNorm


def with_latent_attention(block_spec: Any, latent_norm_eps: float | None) -> Any:
    """Copy of a TransformerBlockSubmodules whose MLA layers use LatentDotProductAttention (and, when given,
    latent norms with a fixed eps)."""
    layers = []
    for layer in block_spec.layer_specs:
        attn = layer.submodules.self_attention
        if hasattr(attn.submodules, "linear_kv_down_proj"):
            changes: dict[str, Any] = {"core_attention": LatentDotProductAttention}
            if latent_norm_eps is not None:
                changes["q_layernorm"] = changes["kv_layernorm"] = latent_norm(latent_norm_eps)
            attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, **changes))
            layer = dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attn))
        layers.append(layer)
    return dataclasses.replace(block_spec, layer_specs=layers)


__all__ = ["LatentDotProductAttention", "ModuleSpec", "latent_norm", "with_latent_attention"]

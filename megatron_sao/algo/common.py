"""What every algo module shares: the compute-dtype policy, input checks and masked reductions.

Called only from inside megatron_sao.algo (gae, policy_loss, value_loss, baselines, advantages), so that each
rule (fp32 compute, the [B, T] bool action mask, 0 instead of NaN on empty masks) is written once.
"""

from __future__ import annotations

import torch

Metrics = dict[str, torch.Tensor]
"""Diagnostics returned by the losses and helpers: name -> detached 0-dim tensor (no host sync)."""


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the algo functions compute and return in: float64 stays float64, everything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_action_mask(action_mask: torch.Tensor) -> None:
    """ValueError unless `action_mask` is a bool [B, T] tensor."""
    if action_mask.dtype != torch.bool or action_mask.dim() != 2:
        raise ValueError(
            f"action_mask must be a bool tensor [B, T], got {action_mask.dtype} with shape "
            f"{tuple(action_mask.shape)}; build it with `mask.bool()`"
        )


def check_token_inputs(action_mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    """ValueError unless action_mask is bool [B, T] and every named tensor is floating point of its shape."""
    check_action_mask(action_mask)
    for name, t in tensors.items():
        if t.shape != action_mask.shape or not t.is_floating_point():
            raise ValueError(
                f"{name} must be a float tensor shaped like action_mask {tuple(action_mask.shape)}, "
                f"got {t.dtype} with shape {tuple(t.shape)}"
            )


def normalizer(
    action_mask: torch.Tensor, num_action_tokens: int | float | torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, N): action tokens in the inputs, and the loss denominator (count by default, >= 1).

    Shared by the policy and value losses. An override must be > 0 and, when given as a tensor, 0-dim.
    """
    count = action_mask.sum().to(dtype)
    if num_action_tokens is None:
        return count, count.clamp(min=1.0)
    norm = torch.as_tensor(num_action_tokens, dtype=dtype, device=action_mask.device)
    if norm.dim() != 0:
        raise ValueError(f"num_action_tokens must be a scalar, got shape {tuple(norm.shape)}")
    if not bool(norm > 0):
        raise ValueError(
            f"num_action_tokens={norm.item()} must be > 0: pass the step's total number of action tokens "
            "(all micro-batches, all data-parallel ranks), or None to use the count in these inputs"
        )
    return count, norm


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over the True entries of mask, 0-dim; 0 when the mask is empty."""
    return torch.where(mask, x, 0.0).sum() / mask.sum().to(x.dtype).clamp(min=1.0)


def masked_mean_var(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, population variance) of x over the True entries of mask, 0-dim each; 0 when the mask is empty."""
    mean = masked_mean(x, mask)
    return mean, masked_mean((x - mean) ** 2, mask)

"""The critic's loss: PPO clipped value loss against lambda_critic = 1 returns (SAO section 2).

Owns the value objective and its diagnostics. Called by the learner's value step (K = 2 optimizer steps per
policy step, on the same trajectories), once per micro-batch, with `num_action_tokens` set to the step's
total; `returns` come from `compute_step_targets` (megatron_sao.algo.advantages) and `old_values` are the
critic's values recorded at the start of the step, when those returns were computed.
"""

from __future__ import annotations

import torch

from megatron_sao.algo.common import (
    Metrics,
    check_token_inputs,
    compute_dtype,
    masked_mean,
    masked_mean_var,
    normalizer,
)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    clip: float | None = 0.2,
    num_action_tokens: int | float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """`v_loss = 0.5 * sum_t max((V_t - R_t)^2, (V_old_t + clip(V_t - V_old_t, -c, c) - R_t)^2) / N`.

    CleanRL's clipped value loss, token-summed over action tokens and divided by N. With `clip=None` it is
    `0.5 * sum_t (V_t - R_t)^2 / N`.

    Args:
        values: float [B, T], the critic's current predictions; the only input that gets a gradient.
        old_values: float [B, T], the critic's predictions when `returns` were computed (clip centre).
        returns: float [B, T], GAE returns with lambda_critic (compute_step_targets).
        action_mask: bool [B, T]; only action tokens have value targets.
        clip: `algo.value.clip` (> 0), or None for the unclipped loss.
        num_action_tokens: N; default the action tokens of these inputs (see dis_policy_loss).

    Returns:
        (loss, metrics): loss 0-dim float32 (float64 for float64 values), 0 without action tokens. metrics
        (detached 0-dim): loss/value, value/clipfrac (fraction of action tokens where the clipped term is
        strictly the larger one, i.e. the clip removed their gradient), value/explained_variance,
        value/vpred_mean, value/returns_mean, value/num_action_tokens.
    """
    if clip is not None and not clip > 0:
        raise ValueError(f"clip={clip} must be > 0, or None to disable value clipping (algo.value.clip)")
    check_token_inputs(action_mask, values=values, old_values=old_values, returns=returns)
    dtype = compute_dtype(values.dtype)
    count, norm = normalizer(action_mask, num_action_tokens, dtype)
    newvalue = values.to(dtype)
    returns = returns.detach().to(dtype)
    v_loss_unclipped = (newvalue - returns) ** 2
    if clip is None:
        v_loss_max = v_loss_unclipped
        clipped = torch.zeros_like(action_mask)
    else:
        old = old_values.detach().to(dtype)
        v_clipped = old + torch.clamp(newvalue - old, -clip, clip)
        v_loss_clipped = (v_clipped - returns) ** 2
        v_loss_max = torch.max(v_loss_unclipped, v_loss_clipped)
        clipped = (v_loss_clipped > v_loss_unclipped).detach() & action_mask
    v_loss = 0.5 * torch.where(action_mask, v_loss_max, 0.0).sum() / norm
    with torch.no_grad():
        metrics = {
            "loss/value": v_loss.detach(),
            "value/clipfrac": masked_mean(clipped.to(dtype), action_mask),
            "value/explained_variance": explained_variance(newvalue.detach(), returns, action_mask),
            "value/vpred_mean": masked_mean(newvalue, action_mask),
            "value/returns_mean": masked_mean(returns, action_mask),
            "value/num_action_tokens": count,
        }
    return v_loss, metrics


def explained_variance(y_pred: torch.Tensor, y_true: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var[y_true - y_pred] / Var[y_true] over the masked entries (population variances), 0-dim.

    Always finite (scikit-learn's `force_finite` convention): 1 when both variances are 0 (perfect
    prediction of a constant), 0 when only Var[y_true] is 0, and 0 for fewer than one masked entry.
    """
    _, var_y = masked_mean_var(y_true, mask)
    _, var_res = masked_mean_var(y_true - y_pred, mask)
    ev = 1.0 - var_res / var_y.clamp(min=torch.finfo(y_true.dtype).tiny)
    ev = torch.where(var_y > 0, ev, torch.where(var_res > 0, 0.0, 1.0).to(ev.dtype))
    return torch.where(mask.any(), ev, torch.zeros_like(ev))

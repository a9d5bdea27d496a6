"""Policy losses: SAO's DIS loss (section 1 of the notes) and the PPO-clip loss of the GRPO arm.

Owns the per-token policy-gradient objective and its diagnostics. Called by the learner's policy step, once
per micro-batch, with `num_action_tokens` set to the step's total so the micro-batch losses add up to the
step's token mean. Both losses take their reference log-probs from the rollout engine (`rollout_logprobs`):
there is no separate pi_old recomputation.

Metrics are detached 0-dim float32 tensors (no host sync here), averaged over the action tokens of the
inputs; `*/num_action_tokens` is that count, for weighting when the learner averages micro-batches.
"""

from __future__ import annotations

import torch

from megatron_sao.algo.common import Metrics, check_token_inputs, compute_dtype, masked_mean, normalizer


def dis_policy_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    eps_low: float = 0.3,
    eps_high: float = 5.0,
    num_action_tokens: int | float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Direct double-sided importance sampling: `loss = -sum_t(m_t * r_t * A_t) / N`.

    r_t = exp(logprobs_t - rollout_logprobs_t); m_t = 1 if (1 - eps_low) < r_t < (1 + eps_high) else 0, an
    open interval, computed without gradient (tokens outside the band are masked, never clipped). The
    gradient w.r.t. logprobs_t is `-m_t * r_t * A_t / N`, i.e. f(r_t) * A_t * grad log pi_theta(a_t) / N.

    Args:
        logprobs: float [B, T], learner log-probs of the sampled tokens; the only input that gets a gradient.
        rollout_logprobs: float [B, T], log-probs logged by the engine that generated each token.
        advantages: float [B, T] (e.g. from compute_gae); treated as constants.
        action_mask: bool [B, T], True on generated tokens; everything else contributes nothing.
        eps_low, eps_high: band edges (`algo.dis.eps_low` / `eps_high`; paper 0.3 / 5.0).
        num_action_tokens: N. Default: action tokens in these inputs, masked-out ones included. Pass the
            step's total (summed over micro-batches and data-parallel ranks) to make the step a token mean.

    Returns:
        (loss, metrics): loss is a 0-dim float32 tensor (float64 for float64 logprobs), 0 when there are no
        action tokens. metrics: dis/masked_frac, dis/masked_low_frac, dis/masked_high_frac, dis/ratio_mean,
        dis/ratio_max, dis/mismatch_kl (k3 estimate of KL(rollout || learner)), dis/logprob_abs_diff (mean
        |learner - rollout| log-prob over the action tokens), loss/policy,
        dis/num_action_tokens.
    """
    if not 0.0 <= eps_low <= 1.0 or not eps_high > 0.0:
        raise ValueError(
            f"need 0 <= eps_low <= 1 and eps_high > 0, got eps_low={eps_low}, eps_high={eps_high} "
            "(algo.dis.eps_low / algo.dis.eps_high; the paper uses 0.3 / 5.0)"
        )
    logratio, advantages, count, norm = _prepare(logprobs, rollout_logprobs, advantages, action_mask, num_action_tokens)
    with torch.no_grad():
        ratio_seen = torch.exp(logratio)  # r_t for the band test and the metrics
        below = (ratio_seen <= 1.0 - eps_low) & action_mask
        above = (ratio_seen >= 1.0 + eps_high) & action_mask
        in_band = action_mask & ~below & ~above
    # exp only inside the band and torch.where, not a product: out-of-band tokens get an exact 0 gradient
    # even when their r_t would overflow
    ratio = torch.exp(torch.where(in_band, logratio, 0.0))
    pg_loss = -torch.where(in_band, ratio * advantages, 0.0).sum() / norm
    metrics = {
        "loss/policy": pg_loss.detach(),
        "dis/masked_frac": masked_mean((below | above).to(ratio.dtype), action_mask),
        "dis/masked_low_frac": masked_mean(below.to(ratio.dtype), action_mask),
        "dis/masked_high_frac": masked_mean(above.to(ratio.dtype), action_mask),
        **_ratio_metrics("dis", ratio_seen, logratio.detach(), action_mask, count),
    }
    metrics["dis/mismatch_kl"] = metrics.pop("dis/approx_kl")
    return pg_loss, metrics


def ppo_clip_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    num_action_tokens: int | float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO's clipped surrogate (the GRPO arm's `policy_loss: ppo_clip`), token-summed and divided by N.

    pg_loss = sum_t max(-A_t * r_t, -A_t * clip(r_t, 1 - clip_eps, 1 + clip_eps_high)) / N, with
    r_t = exp(logprobs_t - old_logprobs_t) and old_logprobs the engine's rollout log-probs.

    Args:
        logprobs, old_logprobs, advantages: float [B, T]; gradient flows through logprobs only.
        action_mask: bool [B, T].
        clip_eps: lower (and by default upper) clip range (`algo.grpo.clip_eps`).
        clip_eps_high: upper clip range for clip-higher (`algo.grpo.clip_eps_high`); None = clip_eps.
        num_action_tokens: N, as in dis_policy_loss.

    Returns:
        (loss, metrics): loss 0-dim float32; metrics loss/policy, ppo/clipfrac (fraction of action tokens
        whose ratio is outside the clip range), ppo/approx_kl (k3), ppo/ratio_mean, ppo/ratio_max, ppo/logprob_abs_diff,
        ppo/num_action_tokens.
    """
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if not 0.0 < clip_eps < 1.0 or not eps_high > 0.0:
        raise ValueError(
            f"need 0 < clip_eps < 1 and clip_eps_high > 0, got {clip_eps}, {clip_eps_high} "
            "(algo.grpo.clip_eps / algo.grpo.clip_eps_high)"
        )
    logratio, advantages, count, norm = _prepare(logprobs, old_logprobs, advantages, action_mask, num_action_tokens)
    ratio = torch.exp(logratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + eps_high)
    pg_loss = torch.where(action_mask, torch.max(pg_loss1, pg_loss2), 0.0).sum() / norm
    with torch.no_grad():
        clipped = ((ratio < 1.0 - clip_eps) | (ratio > 1.0 + eps_high)).to(ratio.dtype)
    metrics = {
        "loss/policy": pg_loss.detach(),
        "ppo/clipfrac": masked_mean(clipped, action_mask),
        **_ratio_metrics("ppo", ratio.detach(), logratio.detach(), action_mask, count),
    }
    return pg_loss, metrics


def _prepare(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    num_action_tokens: int | float | torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Upcast, mask and detach: (logratio, advantages, count, N); logratio is 0 off the action tokens."""
    check_token_inputs(action_mask, logprobs=logprobs, rollout_logprobs=ref_logprobs, advantages=advantages)
    dtype = compute_dtype(logprobs.dtype)
    # 0 off the action tokens so exp() stays finite there (rollout log-probs are 0 on non-action tokens)
    logratio = torch.where(action_mask, logprobs.to(dtype) - ref_logprobs.detach().to(dtype), 0.0)
    advantages = torch.where(action_mask, advantages.detach().to(dtype), 0.0)
    count, norm = normalizer(action_mask, num_action_tokens, dtype)
    return logratio, advantages, count, norm


def _ratio_metrics(
    prefix: str, ratio: torch.Tensor, logratio: torch.Tensor, mask: torch.Tensor, count: torch.Tensor
) -> Metrics:
    # k3 estimator (Schulman): E_rollout[(r - 1) - log r] = KL(rollout || learner) for samples of the rollout
    approx_kl = masked_mean((ratio - 1.0) - logratio, mask)
    ratio_max = torch.where(mask, ratio, 0.0).amax() if ratio.numel() else count.new_zeros(())
    return {
        f"{prefix}/ratio_mean": masked_mean(ratio, mask),
        f"{prefix}/ratio_max": ratio_max,
        f"{prefix}/approx_kl": approx_kl,
        f"{prefix}/logprob_abs_diff": masked_mean(logratio.abs(), mask),
        f"{prefix}/num_action_tokens": count,
    }

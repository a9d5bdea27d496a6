"""Token-level GAE that skips observation tokens, and the length-adaptive lambda (SAO section 4).

Owns the advantage/return recursion over the action tokens of each trajectory row. Called by the per-step
helper in `megatron_sao.algo.advantages` (which the learner uses) and by benchmarks/gae_bench.py.

How it is vectorized (no Python loop over tokens):
1. compaction: each row's action tokens are moved to the left, in order, as if the observation, prompt and
   padding tokens were absent (destination = running count of action tokens, one scatter);
2. `delta = r + gamma * V(next) - V` on the compacted rows, with V = 0 past the last action token;
3. a reverse discounted scan `A_k = delta_k + c * A_{k+1}` with c = gamma * lam per row, computed blockwise:
   inside a block of `_BLOCK` tokens it is a matmul with the upper-triangular matrix of powers c^(j-k) <= 1,
   and the block totals are combined by the same scan, recursively (about log_64(T) levels). Every term is a
   product of factors <= 1, so nothing overflows or cancels catastrophically for any c in [0, 1], unlike the
   cumsum(c^-k * delta) trick;
4. the compacted advantages are gathered back to their original positions; every non-action position is 0.
"""

from __future__ import annotations

import torch

from megatron_sao.algo.common import check_action_mask, check_token_inputs, compute_dtype

_BLOCK = 64
"""Tokens per block of the blocked scan (a [B, 64, 64] coefficient matrix per level)."""


def length_adaptive_lambda(action_mask: torch.Tensor, alpha: float = 1.5) -> torch.Tensor:
    """VAPO's length-adaptive lambda: `lam = 1 - 1 / (alpha * l)`, l = number of action tokens of the row.

    Args:
        action_mask: bool [B, T], True on tokens the policy generated (one trajectory per row).
        alpha: the config's `algo.gae.alpha` (paper 1.5); must be > 0.

    Returns:
        float32 [B], clamped to [0, 1]. Rows with l = 0, and rows with alpha * l < 1, get 0.
    """
    check_action_mask(action_mask)
    if not alpha > 0:
        raise ValueError(f"alpha={alpha} must be > 0 (algo.gae.alpha; the paper uses 1.5)")
    num_action = action_mask.sum(dim=1).to(torch.float32)
    lam = 1.0 - 1.0 / (alpha * num_action.clamp(min=1.0))
    return torch.where(num_action > 0, lam, torch.zeros_like(lam)).clamp(0.0, 1.0)


def gae_span(action_mask: torch.Tensor) -> torch.Tensor:
    """Every token from a row's first action token to its last, observation tokens between turns included: the
    mask GAE runs over when it does not skip observations (`algo.gae.skip_observations: false`, an ablation).

    Args:
        action_mask: bool [B, T], one trajectory per row.

    Returns:
        bool [B, T]; all False on rows without action tokens.
    """
    check_action_mask(action_mask)
    seen = action_mask.to(torch.int32).cumsum(dim=1)
    return ((seen > 0) & (seen < seen[:, -1:])) | action_mask if action_mask.shape[1] else action_mask.clone()


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the action tokens of each row, skipping observation (and prompt, padding) tokens.

    For consecutive action tokens k and next(k) of a row (possibly across an observation gap):
        delta_k = r_k + gamma * V(next(k)) - V(k)
        A_k     = delta_k + gamma * lam * A_next(k)
    with V = 0 and A = 0 past the row's last action token; returns_k = A_k + V(k).

    Args:
        rewards: float [B, T]; non-zero only on action tokens (normally the last one of a trajectory or turn).
        values: float [B, T]; critic values V; read only on action tokens.
        action_mask: bool [B, T], True on tokens the policy generated. One trajectory per row.
        gamma: discount in [0, 1] (`algo.gae.gamma`).
        lam: GAE lambda in [0, 1], a float or a float tensor [B] (one per row, e.g. `length_adaptive_lambda`).

    Returns:
        (advantages, returns), each [B, T], float32 (float64 when `rewards` is float64); 0 on every
        non-action position and on rows without action tokens. No gradient flows through them.

    Raises:
        ValueError: on shape/dtype mismatches, gamma or lam outside [0, 1], or a non-zero reward on a
            non-action position.
    """
    _check_gae_inputs(rewards, values, action_mask)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma={gamma} must be in [0, 1] (algo.gae.gamma; the paper's default is 1.0)")
    dtype = compute_dtype(rewards.dtype)
    batch, seq = rewards.shape
    lam_rows = _lambda_per_row(lam, batch, rewards.device, dtype)
    if seq == 0:
        return rewards.to(dtype).clone(), rewards.to(dtype).clone()

    with torch.no_grad():
        # 1. compaction: destination of each action token = its rank among the row's action tokens
        not_action = ~action_mask
        dest = (action_mask.cumsum(dim=1) - 1).masked_fill_(not_action, seq)  # non-action -> dummy column `seq`
        r_c = _compact(rewards.to(dtype), dest, seq)
        v_c = _compact(values.to(dtype), dest, seq)  # 0 past the last action token
        # 2. TD residuals; V(next(k)) is the next compacted value, 0 after the last action token
        next_values = torch.nn.functional.pad(v_c[:, 1:], (0, 1))
        delta = r_c + gamma * next_values - v_c
        # 3. A_k = delta_k + gamma * lam * A_{k+1}, computed stably
        adv_c = reverse_discounted_scan(delta, gamma * lam_rows)
        # 4. back to the original positions; non-action positions are 0
        advantages = adv_c.gather(1, dest.clamp_(max=seq - 1)).masked_fill_(not_action, 0.0)
        returns = (advantages + values.to(dtype)).masked_fill_(not_action, 0.0)
    return advantages, returns


def reverse_discounted_scan(x: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """y_k = x_k + coef * y_{k+1} along dim 1 (y = 0 past the end), per row, with coef in [0, 1].

    Args:
        x: float [B, T].
        coef: float [B], the per-row discount (gamma * lam).

    Returns:
        [B, T] in x's dtype. Blocked: a [B, L, L] matmul inside blocks, the same scan over block totals.
    """
    batch, seq = x.shape
    if seq <= 1:
        return x.clone()
    block = min(_BLOCK, seq)
    num_blocks = -(-seq // block)
    xb = torch.nn.functional.pad(x, (0, num_blocks * block - seq)).view(batch, num_blocks, block)
    # discount[b, k, j] = coef_b^(j - k) for j >= k, else 0 (exponent j - k, 0 ** 0 == 1)
    steps = torch.arange(block, device=x.device, dtype=x.dtype)
    offsets = steps.view(1, -1) - steps.view(-1, 1)  # [L, L]: j - k
    discount = torch.pow(coef.view(-1, 1, 1), offsets.clamp(min=0)) * (offsets >= 0)
    # local[b, n, k] = sum_{j >= k in block n} coef^(j-k) x[b, n, j]
    local = torch.matmul(xb, discount.transpose(1, 2))
    if num_blocks > 1:
        # totals[b, n] = sum over blocks m >= n of coef^(L*(m-n)) * local[b, m, 0]: the same scan, coarser
        totals = reverse_discounted_scan(local[:, :, 0], coef**block)
        carry = torch.nn.functional.pad(totals[:, 1:], (0, 1))  # what flows into block n from blocks > n
        # y[b, n, k] = local[b, n, k] + coef^(L - k) * carry[b, n]
        decay = torch.pow(coef.view(-1, 1), (block - steps).view(1, -1))  # [B, L]
        local = local + carry.unsqueeze(2) * decay.unsqueeze(1)
    return local.reshape(batch, num_blocks * block)[:, :seq]


def _compact(x: torch.Tensor, dest: torch.Tensor, seq: int) -> torch.Tensor:
    """Move each row's action-token entries to the front (order kept); 0 behind them. [B, T] -> [B, T]."""
    out = torch.zeros(x.shape[0], seq + 1, dtype=x.dtype, device=x.device)
    out.scatter_(1, dest, x)  # every non-action entry lands in the dummy column `seq`, dropped below
    return out[:, :seq]


def _lambda_per_row(lam: float | torch.Tensor, batch: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(lam, torch.Tensor):
        if lam.dim() == 0:
            lam = lam.expand(batch)
        if lam.shape != (batch,):
            raise ValueError(f"lam has shape {tuple(lam.shape)}; pass a float or a tensor of shape [B]=[{batch}]")
        lam_rows = lam.detach().to(device=device, dtype=dtype)
    else:
        lam_rows = torch.full((batch,), float(lam), device=device, dtype=dtype)
    if batch and not bool(((lam_rows >= 0) & (lam_rows <= 1)).all()):
        raise ValueError(
            f"lam must be in [0, 1], got min {lam_rows.min().item()} max {lam_rows.max().item()}; "
            "use length_adaptive_lambda(...) or algo.gae.lambda_policy in [0, 1]"
        )
    return lam_rows


def _check_gae_inputs(rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor) -> None:
    check_token_inputs(action_mask, rewards=rewards, values=values)
    stray = (rewards != 0) & ~action_mask
    if bool(stray.any()):
        row, pos = (int(i) for i in stray.nonzero()[0])
        raise ValueError(
            f"non-zero reward {rewards[row, pos].item()} at row {row}, position {pos}, which is not an action token; "
            "rewards belong to the action token they score (normally the last one): build rewards with "
            "token_rewards(action_mask, ...)"
        )

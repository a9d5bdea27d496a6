"""Independent float64 reference implementations for the algo tests: plain Python loops, no torch tricks."""

from __future__ import annotations

import math


def gae_loop(
    rewards: list[list[float]],
    values: list[list[float]],
    mask: list[list[bool]],
    gamma: float,
    lam: float | list[float],
) -> tuple[list[list[float]], list[list[float]]]:
    """CleanRL's backward GAE loop, per row, visiting only action tokens (observations are skipped)."""
    advantages = [[0.0] * len(row) for row in rewards]
    returns = [[0.0] * len(row) for row in rewards]
    for b in range(len(rewards)):
        lam_b = lam[b] if isinstance(lam, list) else lam
        lastgaelam = 0.0
        next_value = 0.0  # V past the last action token
        for t in reversed(range(len(rewards[b]))):
            if not mask[b][t]:
                continue
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            lastgaelam = delta + gamma * lam_b * lastgaelam
            advantages[b][t] = lastgaelam
            returns[b][t] = lastgaelam + values[b][t]
            next_value = values[b][t]
    return advantages, returns


def dis_grad_loop(
    logprobs: list[float],
    rollout_logprobs: list[float],
    advantages: list[float],
    mask: list[bool],
    eps_low: float,
    eps_high: float,
    n: float,
) -> tuple[float, list[float], list[bool]]:
    """Loss -sum(m r A)/N, its gradient -m r A / N per token, and m per token, token by token."""
    loss, grad, in_band = 0.0, [], []
    for lp, rlp, a, is_action in zip(logprobs, rollout_logprobs, advantages, mask):
        r = math.exp(lp - rlp) if is_action else 0.0
        m = is_action and (1 - eps_low) < r < (1 + eps_high)
        loss -= (r * a / n) if m else 0.0
        grad.append(-r * a / n if m else 0.0)
        in_band.append(m)
    return loss, grad, in_band

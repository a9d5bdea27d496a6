"""Per-step targets the learner needs: token rewards, policy advantages and critic returns, in one place.

Owns how the algo config turns a step's trajectories into training targets:
- `token_rewards`: the [B, T] reward tensor (terminal reward, and optional per-turn rewards, on the last
  action token they score);
- `compute_step_targets`: policy advantages with lambda_policy (length-adaptive, or `algo.gae.lambda_policy`)
  and critic returns with lambda_critic (= 1), optionally whitened advantages (`whiten`: over the tokens the policy
  trains on, across every rank of the step when given a reduction);
- `sequence_to_token_advantages`: spreads the critic-free arms' per-trajectory advantages over their tokens.
Called by the learner once per step, before the K value updates and the policy update.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_sao.algo.common import Metrics, check_action_mask, masked_mean, masked_mean_var
from megatron_sao.algo.gae import compute_gae, length_adaptive_lambda
from megatron_sao.config.algo import AlgoConfig, GAEConfig


@dataclass(frozen=True)
class StepTargets:
    """What one learner step trains on (all without gradient)."""

    advantages: torch.Tensor  # float32 [B, T]: policy advantages (lambda_policy); 0 off action tokens
    returns: torch.Tensor  # float32 [B, T]: critic targets (lambda_critic); 0 off action tokens
    lambda_policy: torch.Tensor  # float32 [B]: the lambda each row's advantages used
    metrics: Metrics  # gae/* diagnostics, detached 0-dim tensors


def compute_step_targets(
    rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    config: AlgoConfig | GAEConfig,
    policy_mask: torch.Tensor | None = None,
    moments: Moments | None = None,
) -> StepTargets:
    """Policy advantages and critic returns for one step, as the algo config says.

    Args:
        rewards: float [B, T] token rewards (token_rewards(...)); non-zero only on action tokens.
        values: float [B, T] critic values at the start of the step (also value_loss's `old_values`).
        action_mask: bool [B, T], one trajectory per row: the tokens GAE runs over.
        config: the `algo` section (or its `algo.gae` subsection). Uses gamma, alpha, lambda_policy,
            lambda_critic and whiten_advantages.
        policy_mask: bool [B, T], the tokens the policy loss covers (what whitening normalizes over); default
            `action_mask` (they differ only when GAE also runs through observation tokens, gae_span).
        moments: the reduction `whiten` applies to its statistics (the step's other data-parallel ranks); None:
            these inputs are the whole step.

    Returns:
        StepTargets. Advantages: GAE with lambda_policy = 1 - 1/(alpha * l) per row, or the fixed
        `lambda_policy` when set; whitened over `policy_mask` when `whiten_advantages` (off by default; the
        paper does not whiten), 0 elsewhere. Returns: GAE with lambda_critic.
    """
    gae = config.gae if isinstance(config, AlgoConfig) else config
    if gae.lambda_policy is None:
        lam_policy = length_adaptive_lambda(action_mask, gae.alpha)
    else:
        lam_policy = torch.full((action_mask.shape[0],), gae.lambda_policy, dtype=torch.float32)
    lam_policy = lam_policy.to(rewards.device)
    advantages, returns = compute_gae(rewards, values, action_mask, gae.gamma, lam_policy)
    if gae.lambda_policy != gae.lambda_critic:  # the critic's targets need their own pass
        _, returns = compute_gae(rewards, values, action_mask, gae.gamma, gae.lambda_critic)
    mean, var = masked_mean_var(advantages, action_mask)
    metrics = {  # advantages before any whitening
        "gae/lambda_policy_mean": lam_policy.mean() if lam_policy.numel() else lam_policy.new_zeros(()),
        "gae/advantages_mean": mean,
        "gae/advantages_std": var.sqrt(),
        "gae/returns_mean": masked_mean(returns, action_mask),
    }
    if gae.whiten_advantages:
        advantages = whiten(advantages, action_mask if policy_mask is None else policy_mask, moments=moments)
    return StepTargets(advantages=advantages, returns=returns, lambda_policy=lam_policy, metrics=metrics)


Moments = Callable[[torch.Tensor], torch.Tensor]
"""Sums a float64 [3] tensor (count, sum, sum of squares) over the ranks that share a step (an all-reduce)."""


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, moments: Moments | None = None) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked entries (population std); 0 off the mask. [B, T] -> [B, T].

    With `moments`, mean and std are those of the masked entries of every rank it sums over (each rank holds a
    data-parallel shard of the step), so the step is whitened as one batch whatever the layout."""
    picked = x[mask].double()
    stats = torch.stack([picked.new_tensor(float(picked.numel())), picked.sum(), (picked * picked).sum()])
    if moments is not None:
        stats = moments(stats)
    n, total, squares = (float(v) for v in stats.cpu())
    if n == 0:
        return torch.zeros_like(x)
    mean = total / n
    std = max(squares / n - mean * mean, 0.0) ** 0.5
    return torch.where(mask, (x - mean) / (std + eps), 0.0).to(x.dtype)


def token_rewards(
    action_mask: torch.Tensor,
    rewards: torch.Tensor,
    turn_rewards: torch.Tensor | None = None,
    turn_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Build the [B, T] token-reward tensor: each reward on the last action token it scores.

    Args:
        action_mask: bool [B, T], one trajectory per row.
        rewards: float [B], terminal reward of each trajectory, placed on its last action token.
        turn_rewards: optional float [B, M]; column j is the reward of turn j, placed on that turn's last
            action token (0 = no reward). On the last turn it adds to the terminal reward.
        turn_index: optional int [B, T], the turn each action token belongs to (0, 1, ...; ignored off the
            action tokens). Default: turns are the maximal runs of consecutive action tokens, which merges
            two turns with no observation between them; pass turn_index (from the bus `Turn` ranges) then.

    Returns:
        float32 [B, T], 0 off the action tokens.

    Raises:
        ValueError: a non-zero reward for a row without action tokens, or for a turn that has no tokens.
    """
    check_action_mask(action_mask)
    batch, seq = action_mask.shape
    if rewards.shape != (batch,):
        raise ValueError(f"rewards must have shape [B]=[{batch}], got {tuple(rewards.shape)}; one per trajectory")
    has_action = action_mask.any(dim=1)
    if bool(((rewards != 0) & ~has_action).any()):
        row = int(((rewards != 0) & ~has_action).nonzero()[0])
        raise ValueError(f"row {row} has reward {rewards[row].item()} but no action tokens to put it on")
    out = torch.zeros(batch, seq, dtype=torch.float32, device=action_mask.device)
    if seq == 0:
        return out
    last = seq - 1 - action_mask.flip(1).to(torch.int8).argmax(dim=1)  # last action token (T-1 for empty rows)
    out.scatter_add_(1, last.unsqueeze(1), torch.where(has_action, rewards.to(torch.float32), 0.0).unsqueeze(1))
    if turn_rewards is not None:
        out += _turn_reward_tensor(action_mask, turn_rewards, turn_index)
    return out


def _turn_reward_tensor(
    action_mask: torch.Tensor, turn_rewards: torch.Tensor, turn_index: torch.Tensor | None
) -> torch.Tensor:
    """Per-turn rewards on each turn's last action token, float32 [B, T]."""
    batch, seq = action_mask.shape
    if turn_rewards.dim() != 2 or turn_rewards.shape[0] != batch:
        raise ValueError(f"turn_rewards must have shape [B, M]=[{batch}, M], got {tuple(turn_rewards.shape)}")
    num_turns = turn_rewards.shape[1]
    if num_turns == 0:
        return torch.zeros(batch, seq, dtype=torch.float32, device=action_mask.device)
    if turn_index is None:
        starts = action_mask & ~torch.nn.functional.pad(action_mask[:, :-1], (1, 0))
        turn_index = starts.cumsum(dim=1) - 1
    elif turn_index.shape != (batch, seq) or turn_index.is_floating_point():
        raise ValueError(f"turn_index must be an int tensor [B, T]=[{batch}, {seq}], got {tuple(turn_index.shape)}")
    turn_index = turn_index.to(torch.int64).masked_fill(~action_mask, -1)
    next_index = torch.nn.functional.pad(turn_index[:, 1:], (0, 1), value=-1)
    ends = action_mask & (next_index != turn_index) & (turn_index < num_turns)
    if bool((action_mask & (turn_index < 0)).any()):
        raise ValueError("turn_index is negative on an action token; number turns 0, 1, ... on action tokens")
    col = turn_index.clamp(0, num_turns - 1)
    ends_per_turn = torch.zeros(batch, num_turns, device=action_mask.device).scatter_add_(1, col, ends.float())
    if bool((ends_per_turn > 1).any()):
        row, turn = (int(i) for i in (ends_per_turn > 1).nonzero()[0])
        raise ValueError(f"turn {turn} of row {row} is split into several runs; a turn's action tokens are contiguous")
    lost = (turn_rewards != 0) & (ends_per_turn == 0)
    if bool(lost.any()):
        row, turn = (int(i) for i in lost.nonzero()[0])
        raise ValueError(f"turn_rewards[{row}, {turn}] is non-zero but row {row} has no action tokens in turn {turn}")
    per_token = turn_rewards.to(torch.float32).gather(1, col)
    return torch.where(ends, per_token, 0.0)


def sequence_to_token_advantages(advantages: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Give every action token of row b the trajectory's advantage (GRPO / running-mean arms). [B] -> [B, T]."""
    if advantages.shape != action_mask.shape[:1]:
        raise ValueError(f"advantages must have shape [B]=[{action_mask.shape[0]}], got {tuple(advantages.shape)}")
    return torch.where(action_mask, advantages.to(torch.float32).unsqueeze(1), 0.0)


def turn_to_token_advantages(
    advantages: torch.Tensor, turn_index: torch.Tensor, action_mask: torch.Tensor
) -> torch.Tensor:
    """Give every action token the advantage of its turn (the oracle-value arm). advantages [B, J], turn_index [B, T]
    (each position's turn, -1 outside turns), action_mask [B, T] -> [B, T]."""
    if advantages.dim() != 2 or advantages.shape[0] != action_mask.shape[0]:
        raise ValueError(f"advantages must have shape [B={action_mask.shape[0]}, turns], got {tuple(advantages.shape)}")
    if bool((action_mask & (turn_index >= advantages.shape[1])).any()):
        raise ValueError(f"an action token's turn is past the {advantages.shape[1]} turns advantages were given for")
    per_token = advantages.to(torch.float32).gather(1, turn_index.clamp(min=0))
    return torch.where(action_mask & (turn_index >= 0), per_token, 0.0)

"""A learner step's trajectories as tensors, and their split over data-parallel ranks.

Everything token-level is aligned to the *predicting position*: entry j of a trajectory's shifted arrays
describes token j+1, whose log-prob comes from the logits at position j and whose value is V(s_j), the critic's
output at position j (the context before the token was generated). A trajectory of T tokens has T-1 positions.
Called by learner/step.py; trajectories come from the bus (bus/schema.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megatron_sao.bus.schema import Trajectory


@dataclass
class StepBatch:
    """One rank's trajectories, padded to [B, L] with L = longest T - 1 (shifted, see module docstring)."""

    tokens: list[torch.Tensor]  # B x int64 [T_b]: full token sequences (model inputs)
    action_mask: torch.Tensor  # bool [B, L]: position j predicts a generated token
    rollout_logprobs: torch.Tensor  # float32 [B, L]: engine log-prob of the predicted token (0 off actions)
    rewards: torch.Tensor  # float32 [B]: terminal reward per trajectory
    turn_rewards: torch.Tensor | None  # float32 [B, M] per-turn rewards, or None when no trajectory has them
    turn_index: torch.Tensor  # int64 [B, L]: turn of each predicted action token (-1 elsewhere)
    versions: torch.Tensor  # int32 [B, L]: weight version of each predicted token (-1 off actions)
    prompt_ids: list[str]  # B: prompt id (GRPO groups)
    trajectory_ids: list[str]  # B
    routes: list[np.ndarray | None] | None = None  # B x the engine's routes [T_b - 1, layers, top_k] (bus/schema.py)

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def lengths(self) -> list[int]:
        """Positions per trajectory (T_b - 1)."""
        return [int(t.numel()) - 1 for t in self.tokens]

    def num_action_tokens(self) -> int:
        return int(self.action_mask.sum())


def _turn_index(traj: Trajectory) -> np.ndarray:
    idx = np.full(traj.header.num_tokens, -1, dtype=np.int64)
    for i, turn in enumerate(traj.header.turns):
        idx[turn.action_start : turn.action_end] = i
    return idx


def check_trainable(t: Trajectory, max_seq_len: int, vocab_size: int | None = None) -> None:
    """Raise ValueError naming the trajectory when the learner cannot train on it (invalid values, too short or
    too long, token ids outside the model's vocabulary)."""
    try:
        t.validate()
    except ValueError as e:
        raise ValueError(f"trajectory {t.trajectory_id}: {e}") from None
    if t.header.num_tokens < 2:
        raise ValueError(f"trajectory {t.trajectory_id} has {t.header.num_tokens} tokens; at least 2 are needed")
    if t.header.num_tokens > max_seq_len:
        raise ValueError(
            f"trajectory {t.trajectory_id} has {t.header.num_tokens} tokens, more than model.max_seq_len="
            f"{max_seq_len}; raise model.max_seq_len or lower rollout.max_total_tokens"
        )
    if vocab_size is not None and int(t.tokens.max()) >= vocab_size:
        raise ValueError(
            f"trajectory {t.trajectory_id} holds token id {int(t.tokens.max())} >= the model's vocab_size "
            f"{vocab_size}; the engines serve another model than the learner trains"
        )


def make_step_batch(
    trajectories: Sequence[Trajectory], max_seq_len: int, vocab_size: int | None = None, checked: bool = False
) -> StepBatch:
    """Validate (unless the caller already ran check_trainable: `checked`) and tensorize trajectories (a
    data-parallel shard may be empty). Raises ValueError naming the trajectory when one cannot be used."""
    for t in () if checked else trajectories:
        check_trainable(t, max_seq_len, vocab_size)
    width = max((t.header.num_tokens for t in trajectories), default=1) - 1
    b = len(trajectories)
    action = torch.zeros(b, width, dtype=torch.bool)
    logp = torch.zeros(b, width, dtype=torch.float32)
    turn_idx = torch.full((b, width), -1, dtype=torch.int64)
    versions = torch.full((b, width), -1, dtype=torch.int32)
    max_turns = max((len(t.header.turns) for t in trajectories), default=0)
    has_turn_rewards = any(turn.reward for t in trajectories for turn in t.header.turns)
    turn_rewards = torch.zeros(b, max(max_turns, 1), dtype=torch.float32) if has_turn_rewards else None
    for i, t in enumerate(trajectories):
        n = t.header.num_tokens - 1
        mask = torch.from_numpy(t.action_mask[1:].copy())
        action[i, :n] = mask
        logp[i, :n] = torch.from_numpy(t.rollout_logprobs[1:].astype(np.float32)) * mask
        turn_idx[i, :n] = torch.from_numpy(_turn_index(t)[1:])
        versions[i, :n] = torch.from_numpy(t.weight_versions[1:].astype(np.int32))
        if turn_rewards is not None:
            for j, turn in enumerate(t.header.turns):
                turn_rewards[i, j] = float(turn.reward or 0.0)
    return StepBatch(
        tokens=[torch.from_numpy(t.tokens.astype(np.int64)) for t in trajectories],
        action_mask=action,
        rollout_logprobs=logp,
        rewards=torch.tensor([t.header.reward for t in trajectories], dtype=torch.float32),
        turn_rewards=turn_rewards,
        turn_index=turn_idx,
        versions=versions,
        prompt_ids=[t.header.prompt_id for t in trajectories],
        trajectory_ids=[t.trajectory_id for t in trajectories],
        routes=[t.routes for t in trajectories] if any(t.routes is not None for t in trajectories) else None,
    )


def shard_for_data_parallel(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Assign trajectories to DP ranks balancing tokens (longest first onto the lightest rank); deterministic.

    Returns, per DP rank, the trajectory indices in their original order.
    """
    load = [0] * dp_size
    shards: list[list[int]] = [[] for _ in range(dp_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(dp_size), key=lambda r: (load[r], r))
        shards[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shards]


def select(trajectories: Sequence[Trajectory], indices: Sequence[int]) -> list[Trajectory]:
    return [trajectories[i] for i in indices]

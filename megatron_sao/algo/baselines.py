"""Critic-free baselines kept in the same framework: GRPO's group mean and the single-rollout running mean.

Owns sequence-level advantages for the `grpo` and `running_mean` arms of `algo.name`. Called by the learner
for those arms (instead of compute_step_targets); `sequence_to_token_advantages` in
megatron_sao.algo.advantages spreads the result over each trajectory's action tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from megatron_sao.algo.common import compute_dtype


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | Sequence[Hashable],
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages: `A_i = (R_i - mean_g R) / (std_g R + eps)`, or `R_i - mean_g R` without std.

    Args:
        rewards: float [B], one scalar reward per trajectory.
        group_ids: [B] integer tensor, or a sequence of hashable ids (e.g. the bus header's `prompt_id`);
            trajectories with equal ids form a group (the G samples of one prompt), in any order.
        normalize_std: divide by the group's std (`algo.grpo.normalize_std`).
        eps: added to the std; a group whose rewards are all equal gets advantages 0.

    Returns:
        float32 [B] (float64 for float64 rewards). The std is the unbiased one (ddof = 1, as torch.std,
        TRL and verl compute it); a group of one trajectory has std 0 and advantage 0.
    """
    if rewards.dim() != 1 or not rewards.is_floating_point():
        raise ValueError(f"rewards must be a float tensor [B], got {rewards.dtype} {tuple(rewards.shape)}")
    inverse = _group_index(group_ids, rewards.shape[0], rewards.device)
    dtype = compute_dtype(rewards.dtype)
    r = rewards.detach().to(dtype)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    size = torch.zeros(num_groups, dtype=dtype, device=r.device).index_add_(0, inverse, torch.ones_like(r))
    mean = torch.zeros_like(size).index_add_(0, inverse, r) / size
    centred = r - mean[inverse]
    if not normalize_std:
        return centred
    sq = torch.zeros_like(size).index_add_(0, inverse, centred**2)
    denom = torch.sqrt(sq / (size - 1).clamp(min=1.0))[inverse] + eps
    return torch.where(denom > 0, centred / denom, 0.0)  # eps = 0 and a constant group: 0, not NaN


def _group_index(group_ids: torch.Tensor | Sequence[Hashable], batch: int, device: torch.device) -> torch.Tensor:
    """Dense group index in [0, num_groups) for every trajectory, int64 [B]."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.shape != (batch,) or group_ids.is_floating_point():
            raise ValueError(
                f"group_ids must be an integer tensor [B]=[{batch}], got {group_ids.dtype} {tuple(group_ids.shape)}"
            )
        return torch.unique(group_ids, return_inverse=True)[1].to(device)
    ids = list(group_ids)
    if len(ids) != batch:
        raise ValueError(f"group_ids has {len(ids)} entries for {batch} rewards; pass one id per trajectory")
    dense: dict[Hashable, int] = {}
    return torch.tensor([dense.setdefault(g, len(dense)) for g in ids], dtype=torch.int64, device=device)


class RunningMeanBaseline:
    """Single-rollout baseline: the mean of the last `window` rewards seen (paper: window 8).

    The baseline for a reward is computed BEFORE that reward is added, so no reward is part of its own
    baseline (the advantage stays an unbiased policy-gradient weight). Before any reward has been seen the
    baseline is 0, so the first advantage equals the first reward. Rewards are consumed in the order given:
    within one `advantages()` call the i-th reward's baseline includes rewards 0..i-1 of the same call. The
    history is global (one stream for all prompts), matching a stream of single rollouts.

    Holds `window` floats; `state_dict()` / `load_state_dict()` carry them across checkpoints.
    """

    def __init__(self, window: int = 8) -> None:
        if window < 1:
            raise ValueError(f"window={window} must be >= 1 (algo.running_mean.window; the paper uses 8)")
        self.window = window
        self._history: deque[float] = deque(maxlen=window)
        self.num_seen = 0

    @property
    def baseline(self) -> float:
        """Mean of the last `window` rewards added so far; 0.0 before the first one."""
        return sum(self._history) / len(self._history) if self._history else 0.0

    def update(self, reward: float) -> None:
        """Add one reward to the history (after its advantage was computed)."""
        self._history.append(float(reward))
        self.num_seen += 1

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """`A_i = R_i - baseline_before_i` for rewards [B] in stream order, then adds them; float32 [B].

        The loop is over trajectories (B per step), never over tokens.
        """
        if rewards.dim() != 1 or not rewards.is_floating_point():
            raise ValueError(f"rewards must be a float tensor [B], got {rewards.dtype} {tuple(rewards.shape)}")
        values = rewards.detach().to(torch.float64).cpu().tolist()
        baselines = []
        for r in values:
            baselines.append(self.baseline)
            self.update(r)
        out = torch.tensor(values, dtype=torch.float64) - torch.tensor(baselines, dtype=torch.float64)
        return out.to(device=rewards.device, dtype=compute_dtype(rewards.dtype))

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "history": list(self._history), "num_seen": self.num_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("window") != self.window:
            raise ValueError(
                f"checkpointed running-mean baseline has window={state.get('window')}, this run uses "
                f"{self.window}; set algo.running_mean.window={state.get('window')} to resume it"
            )
        history = [float(x) for x in state["history"]]
        if len(history) > self.window:
            raise ValueError(f"checkpointed history holds {len(history)} rewards, more than window={self.window}")
        self._history = deque(history, maxlen=self.window)
        self.num_seen = int(state["num_seen"])


class KeyedRunningMeanBaseline:
    """One RunningMeanBaseline per key (e.g. each prompt's difficulty): a reward's baseline is the mean of the last
    `window` rewards of its own key, before it. With the key a task's difficulty, this is the best any prompt-level
    baseline can do (the oracle experiments/critic_matters.py compares a critic with)."""

    def __init__(self, window: int = 8) -> None:
        self.window = window
        self.by_key: dict[str, RunningMeanBaseline] = {}

    def advantages(self, rewards: torch.Tensor, keys: Sequence[str]) -> torch.Tensor:
        """`A_i = R_i - baseline_before_i(key_i)` for rewards [B] in stream order; float32 [B]."""
        if len(keys) != rewards.shape[0]:
            raise ValueError(f"{len(keys)} keys for {rewards.shape[0]} rewards; pass one key per trajectory")
        out = torch.empty_like(rewards, dtype=compute_dtype(rewards.dtype))
        for i, key in enumerate(keys):
            baseline = self.by_key.setdefault(key, RunningMeanBaseline(self.window))
            out[i : i + 1] = baseline.advantages(rewards[i : i + 1])
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "by_key": {k: b.state_dict() for k, b in self.by_key.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("window") != self.window:
            saved = state.get("window")
            raise ValueError(f"checkpointed keyed running mean has window={saved}, this run uses {self.window}; set "
                             f"algo.running_mean.window={saved} to resume it")  # fmt: skip
        self.by_key = {}
        for key, sub in state["by_key"].items():
            self.by_key[key] = RunningMeanBaseline(self.window)
            self.by_key[key].load_state_dict(sub)


class StateValueTable:
    """The oracle arm's values: one RunningMeanBaseline per state the environment names for each turn (trajectory
    metadata `turn_states`, e.g. key_chain with decoys: turns left and whether a decoy was seen). A state's value is the
    mean of the last `window` returns seen from it, before the trajectory's own; advantages are GAE over turns with
    those values, gamma 1 and the reward at the end:

        delta_t = V(s_t+1) - V(s_t)  (t < n - 1),  delta_n-1 = R - V(s_n-1),  A_t = sum_k lambda^k delta_t+k

    so lambda 1 gives R - V(s_t) and lambda 0 turn-level TD. What no critic can beat on such a task: the ceiling of
    experiments/credit.py."""

    def __init__(self, window: int = 64, lambda_turn: float = 1.0) -> None:
        if not 0.0 <= lambda_turn <= 1.0:
            raise ValueError(f"lambda_turn={lambda_turn} must be in [0, 1] (algo.oracle_value.lambda_turn)")
        self.window, self.lambda_turn = window, lambda_turn
        self.by_state: dict[str, RunningMeanBaseline] = {}

    def turn_advantages(self, rewards: Sequence[float], states: Sequence[Sequence[str]]) -> torch.Tensor:
        """Per-turn advantages [B, max turns] (0 past a trajectory's last turn), trajectories in stream order; each
        one's return joins the values of its states after its advantages were computed."""
        if len(rewards) != len(states):
            raise ValueError(f"{len(states)} state lists for {len(rewards)} rewards; pass one per trajectory")
        out = torch.zeros(len(rewards), max((len(s) for s in states), default=1) or 1, dtype=torch.float32)
        for i, (reward, path) in enumerate(zip(rewards, states, strict=True)):
            values = [self.by_state.setdefault(s, RunningMeanBaseline(self.window)).baseline for s in path]
            advantage = 0.0
            for t in reversed(range(len(path))):
                after = values[t + 1] if t + 1 < len(path) else float(reward)
                advantage = after - values[t] + self.lambda_turn * advantage
                out[i, t] = advantage
            for s in set(path):
                self.by_state[s].update(float(reward))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "by_state": {k: b.state_dict() for k, b in self.by_state.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("window") != self.window:
            saved = state.get("window")
            raise ValueError(f"checkpointed state values have window={saved}, this run uses {self.window}; set "
                             f"algo.oracle_value.window={saved} to resume it")  # fmt: skip
        self.by_state = {}
        for key, sub in state["by_state"].items():
            self.by_state[key] = RunningMeanBaseline(self.window)
            self.by_state[key].load_state_dict(sub)

"""The SAO algorithm core in pure torch: DIS loss, skip-observation length-adaptive GAE, value loss, baselines.

Data flow inside one learner step (docs/algorithm.md puts each formula next to its function):
    token_rewards ──► compute_step_targets (compute_gae x2, length_adaptive_lambda) ──► advantages, returns
    returns ──► value_loss (K times)        advantages ──► dis_policy_loss (or ppo_clip_policy_loss)
Critic-free arms: grpo_advantages / RunningMeanBaseline ──► sequence_to_token_advantages ──► policy loss;
StateValueTable (the oracle arm) ──► turn_to_token_advantages ──► policy loss.

Modules: gae.py (the recursion), policy_loss.py, value_loss.py, baselines.py, advantages.py (per-step glue),
common.py (dtype policy, input checks, masked reductions).
"""

from megatron_sao.algo.advantages import (
    StepTargets,
    compute_step_targets,
    sequence_to_token_advantages,
    token_rewards,
    turn_to_token_advantages,
    whiten,
)
from megatron_sao.algo.baselines import (
    KeyedRunningMeanBaseline,
    RunningMeanBaseline,
    StateValueTable,
    grpo_advantages,
)
from megatron_sao.algo.common import Metrics
from megatron_sao.algo.gae import compute_gae, gae_span, length_adaptive_lambda, reverse_discounted_scan
from megatron_sao.algo.policy_loss import dis_policy_loss, ppo_clip_policy_loss
from megatron_sao.algo.value_loss import explained_variance, value_loss

__all__ = [
    "Metrics",
    "KeyedRunningMeanBaseline",
    "RunningMeanBaseline",
    "StateValueTable",
    "StepTargets",
    "compute_gae",
    "compute_step_targets",
    "dis_policy_loss",
    "explained_variance",
    "gae_span",
    "grpo_advantages",
    "length_adaptive_lambda",
    "ppo_clip_policy_loss",
    "reverse_discounted_scan",
    "sequence_to_token_advantages",
    "token_rewards",
    "turn_to_token_advantages",
    "value_loss",
    "whiten",
]

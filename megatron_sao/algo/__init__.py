"""The SAO algorithm core in pure torch (docs/algorithm.md puts each formula next to its function)."""

from megatron_sao.algo.common import Metrics
from megatron_sao.algo.gae import compute_gae, length_adaptive_lambda, reverse_discounted_scan
from megatron_sao.algo.policy_loss import dis_policy_loss, ppo_clip_policy_loss
from megatron_sao.algo.value_loss import explained_variance, value_loss

__all__ = [
    "Metrics",
    "compute_gae",
    "dis_policy_loss",
    "explained_variance",
    "length_adaptive_lambda",
    "ppo_clip_policy_loss",
    "reverse_discounted_scan",
    "value_loss",
]

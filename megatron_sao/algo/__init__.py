"""The SAO algorithm core in pure torch (docs/algorithm.md puts each formula next to its function)."""

from megatron_sao.algo.gae import compute_gae, length_adaptive_lambda, reverse_discounted_scan

__all__ = ["compute_gae", "length_adaptive_lambda", "reverse_discounted_scan"]

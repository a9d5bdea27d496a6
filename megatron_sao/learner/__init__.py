"""The SAO learner on megatron-core: trajectories -> packed micro-batches -> value and policy updates ->
checkpoints. `Learner` (learner.py) is the entry; docs/learner.md walks through one step."""

from megatron_sao.learner.checkpoint import load_checkpoint, load_pretrained, save_checkpoint
from megatron_sao.learner.learner import Learner

__all__ = ["Learner", "load_checkpoint", "load_pretrained", "save_checkpoint"]

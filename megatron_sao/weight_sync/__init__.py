"""Learner -> engines weight sync: gather the policy's shards into HF tensors on learner rank 0 (export.py) and
broadcast them over a process group shared with the engines (group.py), driven over SGLang's HTTP protocol
(broadcaster.py). The embedded engine joins the same kind of group (rollout/engine/weights.py)."""

from megatron_sao.weight_sync.broadcaster import WeightBroadcaster, WeightSyncError
from megatron_sao.weight_sync.export import iter_hf_weights

__all__ = ["WeightBroadcaster", "WeightSyncError", "iter_hf_weights"]

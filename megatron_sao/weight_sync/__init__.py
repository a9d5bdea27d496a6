"""Learner -> engines weight sync, per pipeline stage: plan.py (what moves where), gather.py (in-stage gathers into
HF tensors, packed), sender.py (a stage source's update group and bucket sends), engines.py (rank 0: membership,
protocol by SGLang release, session, verification), sync.py (the collective push). The embedded engine's side is
engines/embedded/weights.py; both ends share distributed/update_group.py and distributed/flat_bucket.py."""

from megatron_sao.weight_sync.sender import WeightSyncError
from megatron_sao.weight_sync.sync import WeightSync, gather_hf_tensors, hf_dtype_of

__all__ = ["WeightSync", "WeightSyncError", "gather_hf_tensors", "hf_dtype_of"]

"""A model's local shards under canonical names, and reassembly of full tensors from every rank's shards.

Used by tests (comparing layouts), tools that gather a model on one rank, and the weight sync to engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_sao.models.mapping import canonical_from_checkpoint_key
from megatron_sao.models.weights import iter_sharded_tensors


@dataclass(frozen=True)
class Shard:
    name: str  # canonical megatron name
    full_shape: tuple[int, ...]  # shape of the full (unsharded) tensor
    offset: tuple[int, ...]  # where this shard starts in the full tensor
    tensor: torch.Tensor  # the shard (a detached CPU copy)


def local_shards(model: Any, skip_replicas: bool = True, copy: bool = True) -> list[Shard]:
    """This rank's shards of `model`. With skip_replicas only the main replica of each shard is returned.
    copy=False: each Shard.tensor is the live (detached) parameter data, wherever it lives; copy it before use."""
    out = []
    for sh in iter_sharded_tensors(model):
        replica = sh.replica_id if isinstance(sh.replica_id, tuple) else (sh.replica_id,)
        if skip_replicas and any(int(r) != 0 for r in replica):
            continue
        p = sh.prepend_axis_num
        name = canonical_from_checkpoint_key(sh.key, tuple(sh.global_offset[:p]))
        data = sh.data.detach().to("cpu", copy=True) if copy else sh.data.detach()
        out.append(Shard(name, tuple(sh.global_shape[p:]), tuple(sh.global_offset[p:]), data))
    return out


def assemble(shards: list[Shard]) -> dict[str, torch.Tensor]:
    """Full tensors from the shards of all ranks (each element written by at least one shard)."""
    full: dict[str, torch.Tensor] = {}
    for s in shards:
        t = full.setdefault(s.name, torch.zeros(s.full_shape, dtype=s.tensor.dtype))
        index = tuple(slice(o, o + n) for o, n in zip(s.offset, s.tensor.shape))
        t[index] = s.tensor
    return full

"""The policy's weights as full HF tensors on learner rank 0, streamed a chunk at a time.

Every learner rank walks the same plan (canonical names in layer order, cut into chunks of about `chunk_bytes`):
per chunk it copies the main replica of its shards of those names to CPU and gathers them to rank 0, which
reassembles the full tensors (models/shards.py), splits them into HF tensors with the one HF<->Megatron mapping
(models/weights.py) and casts each to its HF dtype. Peak memory on rank 0: about one chunk of full tensors.
Every rank of the learner's world must call it together (it runs collectives); only rank 0 yields.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron_sao.models.builder import ModelSpec
from megatron_sao.models.shards import Shard, assemble, local_shards
from megatron_sao.models.weights import weight_mapping

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _order(name: str) -> tuple[int, int, str]:
    """Embedding first, then layer by layer, then the final norm and the output layer."""
    m = _LAYER.match(name)
    if m:
        return (1, int(m.group(1)), name)
    return (0 if name.startswith("embedding") else 2, 0, name)


def hf_dtype_of(hf_source: dict[str, Any] | None, fallback: torch.dtype) -> Callable[[str], torch.dtype]:
    """HF dtype of each tensor from the learner's hf_source record (the dtypes the engines loaded), else
    `fallback` (a model not loaded from HF)."""
    if not hf_source:
        return lambda name: fallback
    default = getattr(torch, hf_source["hf_dtype"])
    exceptions = {n: getattr(torch, d) for n, d in hf_source.get("hf_dtype_exceptions", {}).items()}
    return lambda name: exceptions.get(name, default)


def iter_hf_weights(
    model: Any, spec: ModelSpec, dtype_of: Callable[[str], torch.dtype], chunk_bytes: int = 256 * 2**20
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full contiguous CPU tensor in its HF dtype) for every weight of `model` (this rank's megatron
    policy module), on rank 0; other ranks yield nothing but must iterate too (collectives)."""
    mapping = weight_mapping(spec)
    mine: dict[str, list[Shard]] = {}
    for shard in local_shards(model, skip_replicas=True, copy=False):
        mine.setdefault(shard.name, []).append(shard)
    sizes = {n: math.prod(s[0].full_shape) * s[0].tensor.element_size() for n, s in mine.items()}
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        every: list[dict[str, int]] = [{} for _ in range(world)]
        dist.all_gather_object(every, sizes)
        for d in every:
            sizes.update(d)
    names = sorted(sizes, key=_order)
    unknown = [n for n in names if n not in mapping.rules]
    if unknown:
        raise KeyError(f"no HF mapping for megatron tensors {unknown[:5]} (models/families defines the mapping)")
    rank0 = world == 1 or dist.get_rank() == 0
    for chunk in _chunks(names, sizes, chunk_bytes):
        payload = [
            Shard(s.name, s.full_shape, s.offset, s.tensor.to("cpu", copy=True)) for n in chunk for s in mine.get(n, [])
        ]
        if world > 1:
            gathered: list[list[Shard]] | None = [[] for _ in range(world)] if rank0 else None
            dist.gather_object(payload, gathered, dst=0)
            payload = [s for part in gathered or [] for s in part]
        if not rank0:
            continue
        full = assemble(payload)
        for name in chunk:
            for hf_name, tensor in mapping.to_hf(name, full.pop(name)):
                yield hf_name, tensor.to(dtype_of(hf_name)).contiguous()


def _chunks(names: list[str], sizes: dict[str, int], limit: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    used = 0
    for name in names:
        if chunk and used + sizes[name] > limit:
            yield chunk
            chunk, used = [], 0
        chunk.append(name)
        used += sizes[name]
    if chunk:
        yield chunk

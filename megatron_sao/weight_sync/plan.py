"""What moves where in a weight push: the transfer plan every learner rank computes identically from every rank's
shard metadata (owned by weight_sync/; built by sync.py, executed by gather.py and sender.py).

For each pipeline stage:
  * its ranks, and its **source**: the stage's lowest global rank (TP 0 / DP 0 / EP 0 of the stage), which forms the
    stage's own update group with the engines and sends the stage's layers, and only those;
  * its tensors (canonical megatron names, layer order) and, for each, the **pieces** that tile it: the main replica
    (replica_id all 0) of every shard, on whichever ranks of the stage hold one (TP slices, EP experts, ETP slices);
  * **gather groups**: the distinct sets {holders of a tensor} + {source}, e.g. the DP-0 TP ranks for dense tensors
    and the EDP-0 EP x ETP ranks for experts. A gather never involves a rank outside the stage;
  * **buckets**: runs of tensors of one gather group such that what the source receives (every other member's
    pieces, exactly: no padding, no row for the source's own) and the bucket's HF bytes -- what it sends -- each stay
    within `bucket_bytes`; a tensor larger than that travels alone. Dense tensors come first, then experts (slime's
    order), each in layer order.
A bucket also fixes the byte layout of every member's contribution (uint8, aligned) and of the HF tensors the source
sends (SGLang's flattened-bucket layout, distributed/flat_bucket.py), so no metadata travels with the data.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from megatron_sao.distributed import flat_bucket
from megatron_sao.models.fp8 import FP8_DTYPE, Fp8Format, scale_name
from megatron_sao.models.mapping import WeightMapping

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def tensor_order(name: str) -> tuple[int, int, str]:
    """Embedding first, then layer by layer, then the final norm and the output layer."""
    m = _LAYER.match(name)
    if m:
        return (1, int(m.group(1)), name)
    return (0 if name.startswith("embedding") else 2, 0, name)


@dataclass(frozen=True)
class Piece:
    """One main-replica shard: `shape` elements of canonical tensor `name` (full shape `full_shape`) starting at
    `offset`, held by global rank `rank`."""

    rank: int
    name: str
    full_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * flat_bucket.dtype_from_name(self.dtype).itemsize

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        return (self.name, self.offset)


@dataclass(frozen=True)
class RankInfo:
    """What a rank tells the others once (control path): where it sits and the pieces it holds."""

    rank: int
    stage: int
    host: str
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class HFEntry:
    """One tensor as the engines receive it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class Bucket:
    stage: int
    index: int
    names: list[str]  # canonical tensors, in layer order
    members: tuple[int, ...]  # the gather group (global ranks, sorted; the source among them)
    contributions: dict[int, list[Piece]]  # each member's pieces, in its contribution's byte order
    contribution_slots: dict[int, list[flat_bucket.Slot]]
    receive_offsets: dict[int, int]  # where each member other than the source lands in the source's receive area
    hf: list[HFEntry]  # in send order (aligned)
    slots: list[flat_bucket.Slot]  # their layout in the send buffer
    source: int = -1  # the stage source (the gather's destination)
    hf_of: dict[str, list[str]] = field(default_factory=dict)  # canonical name -> its HF names, in mapping order

    @property
    def send_bytes(self) -> int:
        return flat_bucket.nbytes(self.slots)

    def contribution_bytes(self, member: int) -> int:
        """What `member` sends the source: its pieces back to back, exactly (no padding to another member's)."""
        return flat_bucket.nbytes(self.contribution_slots[member])

    @property
    def received_bytes(self) -> int:
        """What the source receives: every other member's contribution, each at an offset aligned to the widest
        dtype; the source's own pieces are read where they live."""
        others = [m for m in self.members if m != self.source]
        return max((self.receive_offsets[m] + self.contribution_bytes(m) for m in others), default=0)


@dataclass
class StagePlan:
    stage: int
    ranks: tuple[int, ...]
    source: int
    host: str  # the source's host
    buckets: list[Bucket]
    relays: tuple[int, ...] = ()
    """The stage's ranks on the source's host, the source first: a shard-aware push's block groups are each rooted
    at one of them (part i at relays[i % len]), so the engine ranks' slices leave the node through as many NICs."""

    def relay_of(self, part: int, parts: int) -> int:
        """The rank that broadcasts block group `part` of `parts` (the source for a full push's single group)."""
        relays = self.relays[: max(1, min(parts, len(self.relays)))] or (self.source,)
        return relays[part % len(relays)]

    @property
    def hf_names(self) -> list[str]:
        return [e.name for b in self.buckets for e in b.hf]


@dataclass
class TransferPlan:
    stages: list[StagePlan]
    bucket_bytes: int

    def stage_of(self, rank: int) -> StagePlan:
        for s in self.stages:
            if rank in s.ranks:
                return s
        raise KeyError(f"rank {rank} is in no pipeline stage of the plan")

    @property
    def sources(self) -> list[int]:
        return [s.source for s in self.stages]

    @property
    def gather_groups(self) -> list[tuple[int, ...]]:
        """Every distinct gather group with more than one member, in a fixed order (process groups are created in
        this order on every rank)."""
        seen: list[tuple[int, ...]] = []
        for s in self.stages:
            for b in s.buckets:
                if len(b.members) > 1 and b.members not in seen:
                    seen.append(b.members)
        return seen

    @property
    def largest_tensor_bytes(self) -> int:
        """The largest full canonical tensor (what assembling one needs at most)."""
        sizes = [
            math.prod(p.full_shape) * flat_bucket.dtype_from_name(p.dtype).itemsize
            for s in self.stages
            for b in s.buckets
            for ps in b.contributions.values()
            for p in ps
        ]
        return max(sizes, default=0)

    def memory_bound(self, rank_buffers: int = 0) -> int:
        """Extra bytes a rank may hold during a push: about two buckets (the one in flight to the engines and the
        one being gathered) plus the largest single tensor (assembled from its pieces). A shard-aware push adds,
        per bucket in flight, its `rank_buffers` engine-rank buffers (one per distinct set of blocks), each at most
        the bucket."""
        biggest = max((max(b.received_bytes, b.send_bytes) for s in self.stages for b in s.buckets), default=0)
        return 2 * max(self.bucket_bytes, biggest) * (1 + rank_buffers) + self.largest_tensor_bytes


def build_plan(
    infos: Sequence[RankInfo],
    mapping: WeightMapping,
    hf_dtype: Callable[[str], torch.dtype],
    bucket_bytes: int,
    fp8_format: Fp8Format | None = None,
) -> TransferPlan:
    """The plan from every rank's RankInfo (deterministic: every rank computes the same). With `fp8_format` (the
    engines serve a block-FP8 checkpoint) each of its weights travels as float8_e4m3fn plus its float32
    `_scale_inv`, quantized by the source (gather.py), as the engines' checkpoint stores them."""
    by_stage: dict[int, list[RankInfo]] = {}
    for info in sorted(infos, key=lambda i: i.rank):
        by_stage.setdefault(info.stage, []).append(info)
    stages = []
    for stage in sorted(by_stage):
        ranks = tuple(i.rank for i in by_stage[stage])
        source = min(ranks)
        host = next(i.host for i in by_stage[stage] if i.rank == source)
        relays = tuple(i.rank for i in by_stage[stage] if i.host == host)  # sorted by rank: the source first
        pieces: dict[str, list[Piece]] = {}
        for info in by_stage[stage]:
            for p in info.pieces:
                pieces.setdefault(p.name, []).append(p)
        _check_tiling(pieces)
        stages.append(StagePlan(stage, ranks, source, host, _buckets(stage, source, pieces, mapping, hf_dtype,
                                                                      bucket_bytes, fp8_format), relays))  # fmt: skip
    _check_disjoint(stages)
    return TransferPlan(stages, bucket_bytes)


def _check_tiling(pieces: dict[str, list[Piece]]) -> None:
    """Every tensor's main-replica pieces cover it exactly once (the replica bookkeeping is megatron's; a gap or an
    overlap here would send wrong weights)."""
    for name, ps in pieces.items():
        full = ps[0].full_shape
        if any(p.full_shape != full for p in ps) or len({p.offset for p in ps}) != len(ps):
            raise ValueError(f"{name}: main-replica shards disagree on the full shape or repeat an offset: {ps}")
        if sum(math.prod(p.shape) for p in ps) != math.prod(full):
            raise ValueError(f"{name}: main-replica shards cover {sum(math.prod(p.shape) for p in ps)} of "
                             f"{math.prod(full)} elements")  # fmt: skip


def _check_disjoint(stages: list[StagePlan]) -> None:
    owner: dict[str, int] = {}
    for s in stages:
        for b in s.buckets:
            for n in b.names:
                if n in owner:
                    raise ValueError(f"{n} has main-replica shards in pipeline stages {owner[n]} and {s.stage}")
                owner[n] = s.stage


def _buckets(
    stage: int,
    source: int,
    pieces: dict[str, list[Piece]],
    mapping: WeightMapping,
    hf_dtype: Callable[[str], torch.dtype],
    budget: int,
    fp8_format: Fp8Format | None = None,
) -> list[Bucket]:
    names = sorted(pieces, key=tensor_order)
    unknown = [n for n in names if n not in mapping.rules]
    if unknown:
        raise KeyError(f"no HF mapping for megatron tensors {unknown[:5]} (models/families defines the mapping)")
    classes: dict[tuple[int, ...], list[str]] = {}  # gather group -> its tensors, groups in order of appearance
    for n in names:
        classes.setdefault(tuple(sorted({p.rank for p in pieces[n]} | {source})), []).append(n)
    buckets: list[Bucket] = []
    for members, group_names in classes.items():
        current: list[str] = []
        received, hf_bytes = 0, 0  # what the source would receive from the others, and send, for `current`
        for n in group_names:
            add = sum(p.nbytes for p in pieces[n] if p.rank != source)
            hf = _hf_entries(n, pieces[n][0].full_shape, mapping, hf_dtype, fp8_format)
            if current and (received + add > budget or hf_bytes + sum(e.nbytes for e in hf) > budget):
                buckets.append(
                    _bucket(stage, len(buckets), current, members, source, pieces, mapping, hf_dtype, fp8_format)
                )
                current, received, hf_bytes = [], 0, 0
            current.append(n)
            received += add
            hf_bytes += sum(e.nbytes for e in hf)
        if current:
            buckets.append(
                _bucket(stage, len(buckets), current, members, source, pieces, mapping, hf_dtype, fp8_format)
            )
    return buckets


def _hf_entries(
    name: str,
    full_shape: tuple[int, ...],
    mapping: WeightMapping,
    hf_dtype: Callable[[str], torch.dtype],
    fp8_format: Fp8Format | None = None,
) -> list[HFEntry]:
    out = []
    for h, shape in mapping.hf_shapes(name, full_shape).items():
        if fp8_format is not None and fp8_format.quantized(h):
            out.append(HFEntry(h, FP8_DTYPE, tuple(shape)))
            out.append(HFEntry(scale_name(h), torch.float32, fp8_format.scale_shape(tuple(shape))))
        else:
            out.append(HFEntry(h, hf_dtype(h), tuple(shape)))
    return out


RECEIVE_ALIGN = 16
"""Each contribution starts at a multiple of this in the source's receive area (any dtype's alignment)."""


def _bucket(
    stage: int,
    index: int,
    names: list[str],
    members: tuple[int, ...],
    source: int,
    pieces: dict[str, list[Piece]],
    mapping: WeightMapping,
    hf_dtype: Callable[[str], torch.dtype],
    fp8_format: Fp8Format | None = None,
) -> Bucket:
    contributions: dict[int, list[Piece]] = {}
    slots: dict[int, list[flat_bucket.Slot]] = {}
    for m in members:
        mine = [p for n in names for p in pieces[n] if p.rank == m]
        mine = flat_bucket.aligned_order(mine, lambda p: flat_bucket.dtype_from_name(p.dtype))
        contributions[m] = mine
        slots[m] = _layout([f"{p.name}@{p.offset}" for p in mine], [flat_bucket.dtype_from_name(p.dtype) for p in mine],
                           [p.shape for p in mine])  # fmt: skip
    # the other members' contributions lie back to back in the source's receive area, each at an aligned offset (a
    # float32 router or expert bias after an odd-length bf16 contribution would otherwise sit at an unaligned address)
    offsets, at = {}, 0
    for m in members:
        if m != source:
            offsets[m] = at
            at += -(-flat_bucket.nbytes(slots[m]) // RECEIVE_ALIGN) * RECEIVE_ALIGN
    hf_of = {n: [e.name for e in _hf_entries(n, pieces[n][0].full_shape, mapping, hf_dtype, fp8_format)]
             for n in names}  # fmt: skip
    entries = [e for n in names for e in _hf_entries(n, pieces[n][0].full_shape, mapping, hf_dtype, fp8_format)]
    entries = flat_bucket.aligned_order(entries, lambda e: e.dtype)
    send = _layout([e.name for e in entries], [e.dtype for e in entries], [e.shape for e in entries])
    return Bucket(stage, index, names, members, contributions, slots, offsets, entries, send, source, hf_of)


def _layout(names: list[str], dtypes: list[torch.dtype], shapes: list[tuple[int, ...]]) -> list[flat_bucket.Slot]:
    return flat_bucket.layout(names, dtypes, shapes) if names else []

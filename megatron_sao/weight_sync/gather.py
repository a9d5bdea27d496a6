"""Inside one pipeline stage: gather each bucket's pieces to the stage's source with tensor collectives over the
stage's own gather groups, and assemble them into the HF tensors the engines receive, packed in SGLang's flattened
layout (owned by weight_sync/; driven by sync.py on every learner rank).

Per bucket, every member of its gather group other than the source copies its pieces into one uint8 contribution
of exactly their bytes and sends it to the source point to point (one batch of sends and receives per bucket), on
the device (NCCL) or the CPU (gloo); the source's own pieces are read where they live. Nothing is pickled, no object
collective touches the data. The source reassembles each canonical tensor from its pieces (a view
when one piece is the whole tensor), splits it into HF tensors with the one HF<->megatron mapping (models/mapping.py),
casts each to its HF dtype and writes it straight into its slot of the send buffer.

Overlap and memory (the source): bucket k+1 is gathered while bucket k is still travelling to the engines; bucket
k+1 is packed only once bucket k's send finished, so at most two buckets (one in flight, one gathered) and one
assembled tensor exist at a time. A source that gathers nothing (it holds the whole stage: TP=EP=1) packs bucket k+1
into a second send buffer while bucket k travels. `MemoryMeter` counts every buffer this module allocates;
plan.memory_bound() is the bound it must stay under.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megatron_sao.distributed import flat_bucket
from megatron_sao.models import fp8
from megatron_sao.models.fp8 import Fp8Format
from megatron_sao.models.mapping import WeightMapping
from megatron_sao.models.shards import local_shards
from megatron_sao.weight_sync.plan import Bucket, Piece, RankInfo, StagePlan
from megatron_sao.weight_sync.sender import WeightSyncError


class MemoryMeter:
    """Bytes of the buffers a push allocated on this rank: now and at the peak."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def take(self, t: torch.Tensor) -> torch.Tensor:
        self.now += t.nbytes
        self.peak = max(self.peak, self.now)
        return t

    def give(self, *ts: torch.Tensor | None) -> None:
        for t in ts:
            if t is not None:
                self.now -= t.nbytes


def local_pieces(model: Any, rank: int) -> list[tuple[Piece, torch.Tensor]]:
    """This rank's main-replica shards of `model` as plan pieces, each with its live (detached) data."""
    out = []
    for s in local_shards(model, skip_replicas=True, copy=False):
        dtype = flat_bucket.dtype_name(s.tensor.dtype)
        out.append((Piece(rank, s.name, s.full_shape, s.offset, tuple(s.tensor.shape), dtype), s.tensor))
    return out


def rank_info(pieces: list[tuple[Piece, torch.Tensor]], rank: int, stage: int) -> RankInfo:
    return RankInfo(rank, stage, socket.gethostname(), tuple(p for p, _ in pieces))


class PendingSend(Protocol):
    def landed(self) -> None: ...  # the bytes are on every engine: the next bucket may go, the buffer be reused

    def wait(self) -> None: ...  # every engine also answered success


StartSend = Callable[[Bucket, torch.Tensor], PendingSend]
"""Hands a packed bucket to the engines (sender.py); the returned handle's wait() returns when it landed."""


class Buffers:
    """The few buffers a rank's part of a push works in, sized once from the plan and reused bucket after bucket
    (and, in host memory, push after push: fresh host memory pays its page faults on first touch, several times
    the cost of the copy itself). On the source: the send buffer (the bucket travelling to the engines), the receive
    area (the bucket being gathered: every other member's contribution, exactly) and an
    assembly scratch (a tensor put together from several pieces); elsewhere a contribution buffer."""

    def __init__(self, stage: StagePlan, rank: int, device: torch.device, send_device: torch.device) -> None:
        mine = [b for b in stage.buckets if rank in b.members]
        source = rank == stage.source
        # a source that gathers nothing (it holds every piece) has no receive area: two send buffers alternate then,
        # so packing bucket k+1 overlaps sending bucket k within the same two buckets
        self.double = source and all(len(b.members) == 1 for b in mine)
        send = max((b.send_bytes for b in mine), default=0) if source else 0
        self.sizes = {
            "send": send,
            "send2": send if self.double else 0,
            "receive": max((b.received_bytes for b in mine if len(b.members) > 1), default=0) if source else 0,
            "contribution": 0 if source else max((b.contribution_bytes(rank) for b in mine), default=0),
            "assembly": max((_assembly_bytes(b) for b in mine), default=0) if source else 0,
        }
        self.device, self.send_device = device, send_device
        self._held: dict[str, torch.Tensor] = {}

    def get(self, role: str, nbytes: int, meter: MemoryMeter) -> torch.Tensor:
        """A uint8 view of `nbytes` of the `role` buffer (allocated on first use)."""
        buf = self._held.get(role)
        if buf is None:
            sending = role.startswith("send")
            device = self.send_device if sending else self.device
            pinned = sending and device.type == "cpu" and self.device.type == "cuda"
            buf = torch.empty(self.sizes[role], dtype=torch.uint8, device=device, pin_memory=pinned)
            self._held[role] = buf
            meter.take(buf)
        return buf[:nbytes]

    def release(self, meter: MemoryMeter) -> None:
        """Drop the device buffers after a push (the caching allocator keeps them for training); host buffers stay."""
        for role, buf in list(self._held.items()):
            if buf.device.type != "cpu" or buf.is_pinned():
                meter.give(self._held.pop(role))

    @property
    def held_bytes(self) -> int:
        return sum(b.nbytes for b in self._held.values())


def _assembly_bytes(bucket: Bucket) -> int:
    """The largest tensor of a bucket that has to be put together from several pieces."""
    sizes = [0]
    for name in bucket.names:
        pieces = [p for ps in bucket.contributions.values() for p in ps if p.name == name]
        if len(pieces) > 1 or (pieces and pieces[0].shape != pieces[0].full_shape):
            sizes.append(math.prod(pieces[0].full_shape) * flat_bucket.dtype_from_name(pieces[0].dtype).itemsize)
    return max(sizes)


class StageGather:
    """One rank's part of one stage's transfer."""

    def __init__(
        self,
        stage: StagePlan,
        rank: int,
        pieces: list[tuple[Piece, torch.Tensor]],
        groups: dict[tuple[int, ...], Any],
        mapping: WeightMapping,
        device: torch.device,
        send_device: torch.device | None = None,
        fp8_format: Fp8Format | None = None,
    ) -> None:
        self.stage, self.rank, self.groups, self.mapping = stage, rank, groups, mapping
        self.fp8_format = fp8_format  # the engines serve block-FP8: quantize its weights into their format
        self.local = {p.key: t for p, t in pieces}
        self.device = device
        self.send_device = send_device or device  # pinned host memory when the engines receive over gloo from GPUs
        self.meter = MemoryMeter()
        self.buffers = Buffers(stage, rank, device, self.send_device)

    @property
    def is_source(self) -> bool:
        return self.rank == self.stage.source

    def run(self, start_send: StartSend | None, on_packed: Callable[[Bucket, torch.Tensor], None] | None = None) -> int:
        """Take part in every bucket of the stage; the source packs each and hands it to `start_send` (two in
        flight at most). `on_packed(bucket, buffer)` sees each packed buffer (checksums, samples) before it is sent.
        A send that fails stops the sending, not the gathering: the other members are still gathering, so the source
        takes part to the end, then raises the send's WeightSyncError. Returns the buckets this rank took part in."""
        pending: PendingSend | None = None  # the bucket in flight
        answering: PendingSend | None = None  # the one before it: landed, its answers may still be coming
        error: WeightSyncError | None = None
        done = 0
        self.meter.now = self.meter.peak = self.buffers.held_bytes  # what stays allocated between pushes counts too
        try:
            for bucket in self.stage.buckets:
                if self.rank not in bucket.members:
                    continue
                local = self._gather(bucket)  # bucket k+1 is gathered while bucket k still travels
                done += 1
                if not self.is_source or error is not None:
                    continue
                try:
                    role = "send2" if self.buffers.double and done % 2 == 0 else "send"
                    if pending is not None and not self.buffers.double:  # one send buffer: bucket k lands first
                        pending.landed()
                    buffer = self._pack(bucket, local, role)
                    if on_packed is not None:
                        on_packed(bucket, buffer)
                    if pending is not None:
                        pending.landed()  # announced only now: it queues behind bucket k on every engine, in order
                    if answering is not None:
                        answering.wait()
                    assert start_send is not None, "the stage source needs a sender"
                    answering, pending = pending, start_send(bucket, buffer)
                except WeightSyncError as e:  # an engine refused, or the group broke
                    error = e
                except Exception as e:  # packing failed here: the members still gather, so stay in step with them
                    error = WeightSyncError(f"stage {self.stage.stage} bucket {bucket.index}: packing failed: {e!r}")
            for last in (answering, pending):
                if last is not None and error is None:
                    try:
                        last.wait()
                    except WeightSyncError as e:
                        error = e
        finally:
            self.buffers.release(self.meter)
        if error is not None:
            raise error
        return done

    # ---- one bucket ---------------------------------------------------------------------------------------------
    def _gather(self, bucket: Bucket) -> Located:
        """Where every piece of the bucket now is, on the source: {piece key: (piece, view)} -- the other members'
        in the receive area, the source's own where they live (nothing of its own is copied). {} elsewhere. Each
        member sends exactly its pieces, point to point (one batch of sends and receives per bucket)."""
        own = {p.key: (p, self.local[p.key]) for p in bucket.contributions[self.rank]} if self.is_source else {}
        if len(bucket.members) == 1:
            return own
        group = self.groups[bucket.members]
        if not self.is_source:
            mine = self.buffers.get("contribution", bucket.contribution_bytes(self.rank), self.meter)
            for piece, slot in zip(bucket.contributions[self.rank], bucket.contribution_slots[self.rank]):
                flat_bucket.view(mine, slot).copy_(self.local[piece.key])
            if mine.numel():
                for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, self.stage.source, group)]):
                    work.wait()
            return {}
        area = self.buffers.get("receive", bucket.received_bytes, self.meter)
        ops, views = [], {}
        for member, at in bucket.receive_offsets.items():
            n = bucket.contribution_bytes(member)
            views[member] = area[at : at + n]
            if n:
                ops.append(dist.P2POp(dist.irecv, views[member], member, group))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        where = dict(own)
        for member, contrib in views.items():
            for piece, slot in zip(bucket.contributions[member], bucket.contribution_slots[member]):
                where[piece.key] = (piece, flat_bucket.view(contrib, slot))
        return where

    def _pack(self, bucket: Bucket, where: Located, role: str = "send") -> torch.Tensor:
        """The bucket's HF tensors in its send layout (in send buffer `role`), from wherever its pieces are."""
        send = self.buffers.get(role, bucket.send_bytes, self.meter)
        out_slots = {s.name: s for s in bucket.slots}
        by_name: dict[str, list[tuple[Piece, torch.Tensor]]] = {}
        for piece, t in where.values():
            by_name.setdefault(piece.name, []).append((piece, t))
        for name in bucket.names:
            full = self._assemble(by_name[name])
            for hf_name, tensor in self.mapping.to_hf(name, full):
                if self.fp8_format is not None and self.fp8_format.quantized(hf_name):
                    q, scale = fp8.quantize(tensor, self.fp8_format.block)
                    flat_bucket.view(send, out_slots[hf_name]).copy_(q)
                    flat_bucket.view(send, out_slots[fp8.scale_name(hf_name)]).copy_(scale)
                else:
                    flat_bucket.view(send, out_slots[hf_name]).copy_(tensor)  # casts to the HF dtype
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the send may run on another stream or from the host
        return send

    def _assemble(self, parts: list[tuple[Piece, torch.Tensor]]) -> torch.Tensor:
        """The full canonical tensor from its pieces: the piece itself when it is the whole tensor (no copy), else
        put together in the assembly scratch."""
        piece, t = parts[0]
        if len(parts) == 1 and piece.shape == piece.full_shape:
            return t
        nbytes = math.prod(piece.full_shape) * t.element_size()
        full = self.buffers.get("assembly", nbytes, self.meter).view(t.dtype).view(piece.full_shape)
        for p, data in parts:
            full[tuple(slice(o, o + n) for o, n in zip(p.offset, p.shape))] = data
        return full


Located = dict[tuple[str, tuple[int, ...]], tuple[Piece, torch.Tensor]]
"""piece key -> (the piece, where its data is now)."""


class _Kept:
    """The handle of a bucket kept in memory instead of sent: it has landed at once."""

    def landed(self) -> None:
        return None

    def wait(self) -> None:
        return None


def collect(gather: StageGather) -> dict[str, torch.Tensor]:
    """Take part in every bucket of the stage without engines: on the source, every HF tensor as it would be sent
    ({name: copy}); {} elsewhere. For tests, tools and benchmarks: the same gathers and packing as a push."""
    out: dict[str, torch.Tensor] = {}

    def keep(bucket: Bucket, buffer: torch.Tensor) -> PendingSend:
        out.update((name, view.clone()) for name, view in hf_views(bucket, buffer))
        return _Kept()

    gather.run(keep if gather.is_source else None)
    return out


def hf_views(bucket: Bucket, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, view) of every tensor of a packed bucket."""
    for slot in bucket.slots:
        yield slot.name, flat_bucket.view(buffer, slot)

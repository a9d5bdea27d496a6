"""Inside one pipeline stage: gather each bucket's pieces to the stage's source with tensor collectives over the
stage's own gather groups, and assemble them into the HF tensors the engines receive, packed in SGLang's flattened
layout (owned by weight_sync/; driven by sync.py on every learner rank).

Per bucket, every member of its gather group copies its pieces into one uint8 contribution (padded to the largest
member's) and takes part in one `dist.gather` to the source, on the device (NCCL) or the CPU (gloo); nothing is
pickled, no object collective touches the data. The source reassembles each canonical tensor from its pieces (a view
when one piece is the whole tensor), splits it into HF tensors with the one HF<->megatron mapping (models/mapping.py),
casts each to its HF dtype and writes it straight into its slot of the send buffer.

Overlap and memory (the source): bucket k+1 is gathered while bucket k is still travelling to the engines; bucket
k+1 is packed only once bucket k's send finished, so at most two buckets (one in flight, one gathered) and one
assembled tensor exist at a time. `MemoryMeter` counts every buffer this module allocates; plan.memory_bound() is
the bound it must stay under.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megatron_sao.distributed import flat_bucket
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
    def wait(self) -> None: ...


StartSend = Callable[[Bucket, torch.Tensor], PendingSend]
"""Hands a packed bucket to the engines (sender.py); the returned handle's wait() returns when it landed."""


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
    ) -> None:
        self.stage, self.rank, self.groups, self.mapping = stage, rank, groups, mapping
        self.local = {p.key: t for p, t in pieces}
        self.device = device
        self.send_device = send_device or device  # pinned host memory when the engines receive over gloo from GPUs
        self.meter = MemoryMeter()

    @property
    def is_source(self) -> bool:
        return self.rank == self.stage.source

    def run(self, start_send: StartSend | None, on_packed: Callable[[Bucket, torch.Tensor], None] | None = None) -> int:
        """Take part in every bucket of the stage; the source packs each and hands it to `start_send` (two in
        flight at most). `on_packed(bucket, buffer)` sees each packed buffer (checksums, samples) before it is sent.
        A send that fails stops the sending, not the gathering: the other members are still gathering, so the source
        takes part to the end, then raises the send's WeightSyncError. Returns the buckets this rank took part in."""
        pending: PendingSend | None = None
        in_flight: torch.Tensor | None = None
        error: WeightSyncError | None = None
        done = 0
        try:
            for bucket in self.stage.buckets:
                if self.rank not in bucket.members:
                    continue
                received = self._gather(bucket)
                done += 1
                if not self.is_source or error is not None:
                    self.meter.give(*received)
                    continue
                try:
                    if pending is not None:  # bucket k must have landed before bucket k+1 is packed
                        pending, waiting = None, pending
                        waiting.wait()
                        self.meter.give(in_flight)
                        in_flight = None
                    buffer = self._pack(bucket, received)
                    self.meter.give(*received)
                    del received
                    if on_packed is not None:
                        on_packed(bucket, buffer)
                    assert start_send is not None, "the stage source needs a sender"
                    pending, in_flight = start_send(bucket, buffer), buffer
                except WeightSyncError as e:  # an engine refused, or the group broke
                    error = e
            if pending is not None and error is None:
                try:
                    pending.wait()
                except WeightSyncError as e:
                    error = e
        finally:
            self.meter.give(in_flight)
        if error is not None:
            raise error
        return done

    # ---- one bucket ---------------------------------------------------------------------------------------------
    def _gather(self, bucket: Bucket) -> list[torch.Tensor]:
        """Every member's contribution (the source gets them all, in member order; others get [])."""
        mine = self.meter.take(torch.zeros(bucket.gather_bytes, dtype=torch.uint8, device=self.device))
        for piece, slot in zip(bucket.contributions[self.rank], bucket.contribution_slots[self.rank]):
            flat_bucket.view(mine, slot).copy_(self.local[piece.key])
        if len(bucket.members) == 1:
            return [mine]
        source = self.stage.source
        received = None
        if self.is_source:
            received = [self.meter.take(torch.empty_like(mine)) for _ in bucket.members]
        dist.gather(mine, received, dst=source, group=self.groups[bucket.members])
        self.meter.give(mine)
        return received or []

    def _pack(self, bucket: Bucket, received: list[torch.Tensor]) -> torch.Tensor:
        """The bucket's HF tensors in its send layout, from the members' contributions."""
        pinned = self.send_device.type == "cpu" and self.device.type == "cuda"
        send = torch.empty(bucket.send_bytes, dtype=torch.uint8, device=self.send_device, pin_memory=pinned)
        self.meter.take(send)
        out_slots = {s.name: s for s in bucket.slots}
        where = {}  # piece key -> its view in the received contributions
        for member, contrib in zip(bucket.members, received):
            for piece, slot in zip(bucket.contributions[member], bucket.contribution_slots[member]):
                where[piece.key] = (piece, flat_bucket.view(contrib, slot))
        by_name: dict[str, list[tuple[Piece, torch.Tensor]]] = {}
        for piece, t in where.values():
            by_name.setdefault(piece.name, []).append((piece, t))
        for name in bucket.names:
            full, owned = _assemble(by_name[name], self.meter)
            for hf_name, tensor in self.mapping.to_hf(name, full):
                flat_bucket.view(send, out_slots[hf_name]).copy_(tensor)  # casts to the HF dtype
            self.meter.give(owned)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the send may run on another stream or from the host
        return send


def _assemble(parts: list[tuple[Piece, torch.Tensor]], meter: MemoryMeter) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The full canonical tensor from its pieces: the piece itself when it is the whole tensor (no copy), else a new
    tensor (returned second, to be released)."""
    piece, t = parts[0]
    if len(parts) == 1 and piece.shape == piece.full_shape:
        return t, None
    full = meter.take(torch.empty(piece.full_shape, dtype=t.dtype, device=t.device))
    for p, data in parts:
        full[tuple(slice(o, o + n) for o, n in zip(p.offset, p.shape))] = data
    return full, full


def hf_views(bucket: Bucket, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, view) of every tensor of a packed bucket."""
    for slot in bucket.slots:
        yield slot.name, flat_bucket.view(buffer, slot)


"""Relays of a shard-aware push: stage ranks beside the source that broadcast some of its block groups (owned by
weight_sync/; the source's side is in sender.py, both driven by sync.py).

A shard-aware push cuts each bucket into one buffer per block group (the engine ranks holding the same blocks). Sent
from the stage source alone, every byte of the bucket still leaves through that one GPU's NIC, so the push is no
faster than a full-tensor broadcast however small each engine rank's slice. So block group i is rooted at
`StagePlan.relay_of(i)`: a rank of the stage on the source's host (the source itself for the first one). Per bucket
the source hands each relay its groups' buffers over the node's own links (a pair group of the learner's world,
NVLink on GPUs) and the relay broadcasts them to the engines, so the slices leave the node through as many NICs as
there are relays.

Per bucket, over the pair group {source, relay}: the source sends a header `[bucket index, bytes of each of the
relay's groups' buffers]` and the buffers; the relay broadcasts each over its block group and answers `[0]` once all
landed, `[1]` when one failed, or did not land before weight_sync.bucket_timeout_s, or the source gave up the push
meanwhile (a key in the learner's store: an engine refused the bucket and will never receive it). A header with index
-1 ends the push. The source counts a bucket landed only once every relay answered 0.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_sao.distributed.update_group import abort_update_group, destroy_update_group, init_update_group

log = logging.getLogger(__name__)

STOP = -1


def cancel_key(push_id: int, stage: int) -> str:
    """The learner-store key a stage source sets when it gives up a push, so its relays stop waiting."""
    return f"weight_sync/relay_cancel/{push_id}/{stage}"


@dataclass
class Relay:
    """This rank's side of its stage's block groups `parts` (it is rank 0 of each): joined once per group forming,
    then one loop per push."""

    stage: int
    source: int
    pair: Any  # the learner-world group {source, this rank}
    parts: list[int]
    groups: list[Any]
    device: torch.device
    timeout_s: float
    broken: bool = False
    thread: threading.Thread | None = field(default=None, repr=False)

    @classmethod
    def join(cls, stage: int, source: int, pair: Any, parts: list[int], names: list[str], sizes: list[int],
             address: str, port: int, backend: str, device: torch.device, connect_timeout_s: float,
             timeout_s: float, group_timeout_s: float) -> Relay:  # fmt: skip
        """Join block groups `parts` (names, world sizes) as their rank 0, through the stage source's store."""
        import datetime

        store = dist.TCPStore(address, port, is_master=False, timeout=datetime.timedelta(seconds=connect_timeout_s))
        groups = []
        try:
            for name, size in zip(names, sizes):
                groups.append(init_update_group(backend, address, port, size, 0, name, connect_timeout_s, store=store,
                                                collective_timeout_s=group_timeout_s))  # fmt: skip
        except BaseException:
            for g in groups:
                abort_update_group(g)
            raise
        return cls(stage, source, pair, parts, groups, device, timeout_s)

    def start(self, push_id: int) -> None:
        """Serve this push's buckets on a thread, until the source's stop."""
        self.thread = threading.Thread(target=self._serve, args=(push_id,), daemon=True, name="weight-sync-relay")
        self.thread.start()

    def finish(self) -> None:
        """Wait for the push's stop (the source sends it once its last bucket is answered)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def _serve(self, push_id: int) -> None:
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
        cancel = cancel_key(push_id, self.stage)
        while True:
            header = torch.zeros(1 + len(self.parts), dtype=torch.int64, device=self.device)
            dist.recv(header, src=self.source, group=self.pair)
            index, *sizes = (int(x) for x in header.tolist())
            if index == STOP:
                return
            buffers = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
            for b in buffers:
                dist.recv(b, src=self.source, group=self.pair)
            status = 0 if self._broadcast(buffers, store, cancel, index) else 1
            dist.send(torch.tensor([status], dtype=torch.int64, device=self.device), dst=self.source, group=self.pair)

    def _broadcast(self, buffers: list[torch.Tensor], store: Any, cancel: str, index: int) -> bool:
        """Broadcast each buffer over its block group; True once all landed."""
        try:
            works = [dist.broadcast(b, src=0, group=g, async_op=True) for b, g in zip(buffers, self.groups)]
        except RuntimeError as e:
            log.error("weight sync relay (stage %d, bucket %d): %r", self.stage, index, e)
            self.broken = True
            return False
        deadline, polled = time.monotonic() + self.timeout_s, 0.0
        while not all(w.is_completed() for w in works):
            now = time.monotonic()
            if now > deadline:
                self.broken = True
                log.error("weight sync relay (stage %d, bucket %d): not landed within %.0fs", self.stage, index,
                          self.timeout_s)  # fmt: skip
                return False
            if now - polled > 0.01:
                polled = now
                if store.check([cancel]):  # the source gave the push up: nobody will receive this bucket
                    self.broken = True
                    return False
            time.sleep(0.0005)
        try:
            for w in works:
                w.wait()
        except RuntimeError as e:  # a peer died mid-broadcast
            log.error("weight sync relay (stage %d, bucket %d): %r", self.stage, index, e)
            self.broken = True
            return False
        return True

    def close(self) -> None:
        """Drop the block groups (aborted when a broadcast failed: pending work must not wait out their timeout)."""
        groups, self.groups = self.groups, []
        for g in groups:
            if self.broken:
                abort_update_group(g)
                continue
            try:
                destroy_update_group(g)
            except Exception as e:
                log.warning("weight sync relay: destroying a block group: %r", e)

"""The agent's ranks: one per TP rank of the engine behind it, each receiving that engine rank's slice of a push and
lending it to the engine at the handover (owned by engines/agent/; server.py drives rank 0, `serve_rank` the others).

A rank is the embedded engine's weight receiver (embedded/weights.py: update groups joined as the engine rank,
sessions, refusals, staging) over a table of the checkpoint's tensors instead of a model: it keeps what a session
received in host memory -- shared memory on the CPU, so the engine rank opens it without a copy -- and, on a GPU,
receives each bucket over NCCL into one bucket of GPU memory and moves it to the host at once (never a slice beside
the engine's weights). At the handover it lends one part at a time: its tensors of that part, cut to its block
where a push brought them whole, packed for /update_weights_from_tensor (distributed/tensor_payload.py; on a GPU
copied to the device first and lent by CUDA IPC handle, the part's bytes at most).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from megatron_sao.distributed import flat_bucket, tensor_payload
from megatron_sao.engines.agent.handover import Handover
from megatron_sao.engines.embedded.server import traffic_summary
from megatron_sao.engines.embedded.tp import Follower, Peers
from megatron_sao.engines.embedded.weights import ReceivedUpdate, WeightUpdateError, WeightUpdater
from megatron_sao.engines.protocol import ServerProtocol

log = logging.getLogger(__name__)


class AgentReceiver(WeightUpdater):
    """Engine TP rank `tp_rank`'s receiver: its block of each tensor per `handover`, staged until the handover."""

    def __init__(self, table: dict[str, torch.Tensor], protocol: ServerProtocol, handover: Handover, tp_rank: int,
                 device: torch.device, session_timeout_s: float, peers: Peers | None = None) -> None:  # fmt: skip
        torch.multiprocessing.set_sharing_strategy("file_system")  # before any share_memory_: payloads name files
        super().__init__(table, protocol, session_timeout_s, peers=peers, tp_rank=tp_rank)
        self.handover, self.device = handover, device
        self.backends = ("nccl", "gloo") if device.type == "cuda" else ("gloo",)
        self.pending: ReceivedUpdate | None = None  # what the last session received, until it is handed over
        self._lent: list[tuple[str, torch.Tensor]] = []  # the part the engine is loading now

    # ---- what this rank receives --------------------------------------------------------------------------------
    def box_of(self, name: str) -> flat_bucket.Box | None:
        if name not in self._boxes:
            self._boxes[name] = self.handover.box(name, self.tp_rank) if name in self.tensors else None
        return self._boxes[name]

    def _buffer(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            spare = self._spare.get(nbytes)
            if spare:
                return spare.pop()
        return torch.empty(nbytes, dtype=torch.uint8).share_memory_()  # the engine rank maps it, no copy

    def _broadcasts(self, group: Any, dtypes: list[torch.dtype], shapes: list[list[int]],
                    slots: list[flat_bucket.Slot] | None,
                    room: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # fmt: skip
        if self.device.type == "cuda" and slots is None:
            raise WeightUpdateError("the push agent takes buckets (load_format 'sharded_bucket' or "
                                    "'flattened_bucket'), not one broadcast per tensor")  # fmt: skip
        return super()._broadcasts(group, dtypes, shapes, slots, room)

    def _land(self, group: Any, nbytes: int) -> torch.Tensor:
        if self.device.type != "cuda":
            return super()._land(group, nbytes)
        landing = torch.empty(nbytes, dtype=torch.uint8, device=self.device)  # NCCL receives into GPU memory
        dist.broadcast(landing, src=0, group=group)
        buffer = self._buffer(nbytes)
        buffer.copy_(landing)
        return buffer

    # ---- the handover -------------------------------------------------------------------------------------------
    def close(self) -> str:
        """End the session (mirrored from rank 0) and keep what it received for the handover."""
        self.release()
        update, msg = self._end()
        self.pending = update
        return msg

    def _handed(self) -> list[tuple[str, torch.Tensor]]:
        """(name, what the engine rank loads) of the pending push: the rank's block of each tensor it takes split
        (cut here when the push brought it whole), the others whole; blocks of zero elements (experts another rank
        stores) are not handed over."""
        if self.pending is None:
            return []
        out = []
        for i, (target, tensor) in enumerate(zip(self.pending.targets, self.pending.tensors)):
            box = self.box_of(target.key)
            if box is not None and not self.pending.is_box(i):
                tensor = flat_bucket.block(tensor, box)
            if box is not None and tensor.numel() == 0:
                continue
            out.append((target.key, tensor))
        return out

    def sizes(self) -> list[tuple[str, int]]:
        """(name, bytes) this rank hands over, in order."""
        return [(n, t.nbytes) for n, t in self._handed()]

    def lend(self, names: list[list[str]]) -> str:
        """This rank's payload of one handover call: its part of it, `names[tp_rank]`, packed for the engine rank to
        open."""
        handed = dict(self._handed())
        pairs = [(n, handed[n]) for n in names[self.tp_rank]]
        if self.device.type == "cuda":  # by CUDA IPC handle: the part is copied to the device, lent until loaded
            pairs = [(n, t.to(self.device, non_blocking=True).contiguous()) for n, t in pairs]
            torch.cuda.synchronize(self.device)
        else:
            pairs = [(n, t if t.is_contiguous() else t.contiguous().share_memory_()) for n, t in pairs]
        self._lent = pairs
        return tensor_payload.pack(pairs)

    def returned(self) -> str:
        """The engine loaded the part lent last: free its device copies."""
        self._lent = []
        return "ok"

    def release(self) -> str:
        """Drop the pending push (handed over, or abandoned): its buffers go back for the next one."""
        self._lent = []
        if self.pending is not None:
            self.recycle(self.pending.buffers)
            self.pending = None
        return "released"


def serve_rank(store: Any, tp_rank: int, receiver: AgentReceiver) -> None:
    """An agent rank other than 0: rank 0's weight commands run here in its order; never returns."""

    def init_group(rank_offset: int, **kwargs: Any) -> str:  # the engine rank joins as rank_offset + tp_rank
        return receiver.init_group(rank_offset=rank_offset + tp_rank, **kwargs)

    def receive(**kwargs: Any) -> str:
        update = receiver.receive(**kwargs)
        return f"received {len(update.tensors)} tensors"

    handlers = {
        "step": {"traffic": lambda: traffic_summary(receiver)},
        "weights": {
            "init_group": init_group,
            "destroy_group": receiver.destroy_group,
            "begin": receiver.begin,
            "end": receiver.close,
            "receive": receive,
            "drop_pending": receiver.release,
            "discard": receiver.discard,
            "sizes": receiver.sizes,
            "lend": receiver.lend,
            "returned": receiver.returned,
        },
    }
    log.info("push agent rank %d serving rank 0's commands", tp_rank)
    Follower(store, tp_rank, handlers).run()

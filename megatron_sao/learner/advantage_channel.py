"""Advantages from a value job to a policy job, for a critic on its own ranks (learner.value_on_separate_ranks).

The value job runs `Learner.critic_step`, gathers the per-trajectory advantages on its rank 0 and sends them; the
policy job's rank 0 receives them and broadcasts them to its ranks, which run `Learner.policy_step`. The link is
one ZeroMQ PUSH/PULL pair (msgpack header + one float32 frame, no pickle); inside each job the object collectives
of torch.distributed move them. Called by the training entry point of each job.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch.distributed as dist
import zmq


class AdvantageHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    step: int  # the policy step these advantages are for (the value job's critic_step count)
    ids: list[str]  # trajectory ids, in frame order
    lengths: list[int]  # positions per trajectory (T - 1); the float32 frame holds them back to back


def gather_to_rank0(local: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    """Collective inside a job: every rank's advantages merged on rank 0 (None on the others)."""
    parts: list[dict[str, np.ndarray] | None] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(local, parts if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return None
    merged: dict[str, np.ndarray] = {}
    for part in parts:
        merged.update(part or {})
    return merged


def broadcast_from_rank0(advantages: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    """Collective inside a job: rank 0's advantages on every rank."""
    box = [advantages]
    dist.broadcast_object_list(box, src=0)
    return box[0] or {}


class AdvantageSender:
    """Value job, rank 0: connects to the policy job's receiver."""

    def __init__(self, address: str) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 5000)
        self._sock.connect(address)

    def send(self, step: int, advantages: dict[str, np.ndarray]) -> None:
        ids = sorted(advantages)
        arrays = [np.ascontiguousarray(advantages[i], dtype=np.float32) for i in ids]
        header = AdvantageHeader(step, ids, [int(a.size) for a in arrays])
        payload = np.concatenate(arrays) if arrays else np.zeros(0, np.float32)
        self._sock.send_multipart([msgspec.msgpack.encode(header), payload.data], copy=False)

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()


class AdvantageReceiver:
    """Policy job, rank 0: binds and receives the value job's advantages step by step."""

    def __init__(self, address: str) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._decoder = msgspec.msgpack.Decoder(AdvantageHeader)

    def recv(self, step: int, timeout_s: float) -> dict[str, np.ndarray]:
        """The advantages for `step`; raises TimeoutError when the value job sent nothing in time and ValueError
        when what arrived is malformed or for another step."""
        if not self._sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no advantages from the value job for step {step} within {timeout_s}s")
        frames = self._sock.recv_multipart(copy=False)
        if len(frames) != 2:
            raise ValueError(f"advantage message with {len(frames)} frames, expected 2")
        try:
            header = self._decoder.decode(frames[0].buffer)
        except msgspec.DecodeError as e:
            raise ValueError(f"malformed advantage header: {e}") from e
        if header.step != step:
            raise ValueError(f"advantages for step {header.step} arrived while the policy job is at step {step}")
        flat = np.frombuffer(frames[1].buffer, dtype=np.float32)
        if len(header.ids) != len(header.lengths) or sum(header.lengths) != flat.size:
            raise ValueError("advantage message: ids, lengths and payload size disagree")
        out, offset = {}, 0
        for traj_id, n in zip(header.ids, header.lengths):
            out[traj_id] = flat[offset : offset + n].copy()
            offset += n
        return out

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()

"""A point-to-point link between two torch.distributed jobs: rank 0 of one job (the host) and rank 0 of another (the
peer), over a two-rank gloo group of its own beside each job's world, built like the weight-update group
(distributed/update_group.py: a TCP store on the host's address, then a backend group over it).

It carries byte messages in order, each a length then the bytes (uint8 tensors through send/recv). A gloo send
returns only once the other end posted its receive, so `post` sends without waiting (the message is on its way
while the caller works on; the next send, or close, waits for it first). Gloo whatever the
jobs' own backend: what crosses it (trajectories, advantages, metrics, commands) lives in host memory, and a gloo
socket fails at once when the other process dies instead of hanging a GPU stream. Shared by the policy job and the
value job of a critic on its own ranks (learner/value_job.py), the two stages it sits below.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from megatron_sao.distributed.update_group import destroy_update_group, init_update_group

log = logging.getLogger(__name__)

HOST, PEER = 0, 1
"""The two ranks of a bridge: the job that binds the store (the policy job), the job that connects (the value job)."""


def parse_address(address: str) -> tuple[str, int]:
    """`tcp://HOST:PORT` -> (host, port); ValueError naming the form otherwise."""
    if not address.startswith("tcp://") or ":" not in address.removeprefix("tcp://"):
        raise ValueError(f"bridge address {address!r}: expected tcp://HOST:PORT")
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if not port.isdigit():
        raise ValueError(f"bridge address {address!r}: the port must be a number")
    return host, int(port)


class Bridge:
    """One end of the link. `open` blocks until both ends joined (or `timeout_s` passed); every later send or recv
    fails after `timeout_s` too (the group's timeout), and at once when the other process is gone."""

    def __init__(self, group: Any, rank: int, name: str) -> None:
        self.group, self.rank, self.name = group, rank, name
        self.other = PEER if rank == HOST else HOST
        self._posted: list[tuple[Any, torch.Tensor]] = []  # (work, the tensor it sends) of messages not yet received

    @classmethod
    def open(cls, address: str, host: bool, timeout_s: float, name: str = "sao_critic_bridge") -> Bridge:
        addr, port = parse_address(address)
        rank = HOST if host else PEER
        group = init_update_group("gloo", addr, port, 2, rank, name, timeout_s)
        log.info("bridge %s to %s up (this end: %s)", name, address, "host" if host else "peer")
        return cls(group, rank, name)

    def send(self, payload: bytes) -> None:
        """Returns once the other end received the message (and every one posted before it)."""
        self.post(payload)
        self.flush()

    def post(self, payload: bytes) -> None:
        """Send without waiting for the other end to receive it; messages still arrive in the order sent."""
        while self._posted and self._posted[0][0].is_completed():  # received: let their buffers go
            self._posted.pop(0)
        tensors = [torch.tensor([len(payload)], dtype=torch.int64)]
        if payload:
            tensors.append(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        for t in tensors:  # the tensors stay referenced until their sends completed
            self._posted.append((dist.isend(t, group=self.group, group_dst=self.other), t))

    def flush(self) -> None:
        """Wait until the other end received every posted message (fails as a send does)."""
        while self._posted:
            work, _ = self._posted[0]
            work.wait()
            self._posted.pop(0)

    def recv(self) -> bytes:
        length = torch.zeros(1, dtype=torch.int64)
        dist.recv(length, group=self.group, group_src=self.other)
        n = int(length.item())
        if n < 0:
            raise ValueError(f"bridge {self.name}: a message of {n} bytes")
        if n == 0:
            return b""
        data = torch.empty(n, dtype=torch.uint8)
        dist.recv(data, group=self.group, group_src=self.other)
        return data.numpy().tobytes()

    def close(self) -> None:
        try:
            self.flush()
        except Exception as e:  # the other end is gone: what was posted will never be received
            log.warning("closing bridge %s with %d sends posted: %r", self.name, len(self._posted), e)
        self._posted.clear()
        try:
            destroy_update_group(self.group)
        except Exception as e:  # the other end may be gone already; the group is dropped either way
            log.warning("closing bridge %s: %r", self.name, e)

"""The learner's next batch from the bus (rank 0 only; run/learn.py shares it with the other ranks).

Streaming arms (sao, running_mean): the first `n` trajectories in arrival order. Group arms (grpo, grpo_async): the
first n / G groups that are whole -- all G samples of one prompt from one worker -- so a group is never split across
steps; samples of groups not yet whole stay held for a later step.

While it waits it says so every WAIT_LOG_S (with what the bus saw), and it gives up (None) when the engines may lag
the learner and nothing fresh arrived for RESYNC_AFTER_S: the last weight push failed (an engine was down), or what
arrives is dropped as too stale (an engine restarted on its initial weights); and, sooner, when the engines serving
are not the ones last pushed to (asked every ENGINE_CHECK_S of waiting: one came back or restarted). The caller then
pushes again, so an engine that came back with old weights cannot starve the learner, nor generate long for nothing.
It never waits for ever: with no rollout worker connected for bus.producer_wait_s it raises NoProducers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from megatron_sao.bus.schema import Trajectory
from megatron_sao.learner.errors import NoProducers

log = logging.getLogger(__name__)

WAIT_LOG_S = 30.0
RESYNC_AFTER_S = 5.0
ENGINE_CHECK_S = 1.0


def whole_groups(held: Sequence[Trajectory], groups: int, group_size: int) -> list[int] | None:
    """Indices into `held` of the first `groups` whole groups (in the order they completed, each in sample order);
    None when fewer are whole."""
    members: dict[tuple[str, str], dict[int, int]] = {}
    complete: list[tuple[str, str]] = []
    for i, t in enumerate(held):
        key = (t.header.worker_id, t.header.prompt_id)
        group = members.setdefault(key, {})
        group.setdefault(t.header.sample_index, i)
        if len(group) == group_size and key not in complete:
            complete.append(key)
            if len(complete) == groups:
                break
    if len(complete) < groups:
        return None
    return [members[k][s] for k in complete for s in sorted(members[k])]


class Batches:
    """`held`: received trajectories of groups not yet whole. The bus counts them as consumed (a checkpoint commits
    them), so they go into the checkpoint too (run/learn.py) and come back on resume: never lost, never twice."""

    def __init__(
        self, receiver: Any, n: int, group_size: int | None, held: list[list[bytes]] | None = None, bus: Any = None
    ) -> None:
        from megatron_sao.bus.codec import Limits, decode

        self.receiver, self.n, self.group_size = receiver, n, group_size
        self.bus = bus
        limits = Limits(bus.max_frame_bytes, bus.max_message_bytes, bus.max_header_bytes) if bus else None
        self.held: list[Trajectory] = [decode(frames, limits)[0] for frames in held or []] if limits else []

    def held_frames(self) -> list[list[bytes]]:
        """The held trajectories in the bus's wire encoding (what a checkpoint stores: plain bytes)."""
        from megatron_sao.bus.codec import encode

        return [[bytes(f) for f in encode(t)] for t in self.held]

    def next(
        self,
        lagging: bool,
        stopping: Callable[[], bool] = lambda: False,
        engines_changed: Callable[[], bool] = lambda: False,
    ) -> list[Trajectory] | None:
        """Receive until a batch is complete (returned, and no longer held); None per the module docstring, or
        within ENGINE_CHECK_S of `stopping()` turning true (the run is asked to stop)."""
        waited, logged, quiet, alone = 0.0, 0.0, 0.0, 0.0
        stale0 = self.receiver.metrics().get("stale_dropped", 0.0)
        while True:
            batch = self._take()
            if batch is not None:
                return batch
            if stopping():
                return None
            got = self.receiver.recv_batch(max(self.n - len(self.held), 1), timeout_s=ENGINE_CHECK_S)
            self.held += got
            if got:
                quiet = 0.0
                continue
            waited += ENGINE_CHECK_S
            quiet += ENGINE_CHECK_S
            if engines_changed():
                log.info("the engines serving are not the ones last pushed to: pushing before waiting on")
                return None
            if quiet < RESYNC_AFTER_S:
                continue
            quiet = 0.0
            m = self.receiver.metrics()
            if lagging or m.get("stale_dropped", 0.0) > stale0:
                return None
            alone = alone + RESYNC_AFTER_S if not m.get("sessions", 0) else 0.0
            limit = self.bus.producer_wait_s if self.bus is not None else 0.0
            if limit and alone >= limit:
                raise NoProducers(
                    f"no rollout worker has been connected to the bus ({self.bus.bind}) for {alone:.0f} s while the "
                    f"learner waited for a batch of {self.n} ({len(self.held)} held): the workers died, never "
                    "started, dial another address, or hold a key this bus does not authorize (bus.curve_*; their "
                    "logs say which); raise bus.producer_wait_s to wait longer, or 0 to wait for ever"
                )
            if waited - logged >= WAIT_LOG_S:
                logged = waited
                log.warning(
                    "learner waiting for trajectories: %d held for a step of %d (bus: %d sessions, %d accepted, "
                    "%d rejected, %d dropped as stale)", len(self.held), self.n, int(m.get("sessions", 0)),
                    int(m.get("accepted", 0)), int(m.get("rejected", 0)), int(m.get("stale_dropped", 0)),
                )  # fmt: skip

    def ready(self) -> list[Trajectory] | None:
        """A batch only if one is complete now: what the bus holds is taken (and held), nothing is waited for."""
        batch = self._take()
        if batch is None:
            self.held += self.receiver.recv_batch(max(self.n - len(self.held), 1), timeout_s=0)
            batch = self._take()
        return batch

    def _take(self) -> list[Trajectory] | None:
        if self.group_size is None:
            if len(self.held) < self.n:
                return None
            batch, self.held = self.held[: self.n], self.held[self.n :]
            return batch
        picked = whole_groups(self.held, self.n // self.group_size, self.group_size)
        if picked is None:
            return None
        chosen = set(picked)
        batch = [self.held[i] for i in picked]
        self.held = [t for i, t in enumerate(self.held) if i not in chosen]
        return batch

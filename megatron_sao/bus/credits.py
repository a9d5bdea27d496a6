"""Receiver-side sessions and credits: who may send how many trajectories, so the learner's memory stays bounded.

Owned here: one `Session` per producer connection (its stream, cumulative credit counters, last activity) and the
`CreditBook` that grants credits out of a receiver-wide pool of `recv_queue_size` slots, only to sessions that
asked (demand), round-robin, so that no session has more than `max_inflight` trajectories granted-but-unsent or
queued for the learner. A slot is taken by a granted credit, held by the queued
trajectory, and freed when the learner takes it (or at once when the message is refused). Called by
receiver_io.py on the I/O thread only (no locking here).

All counters are cumulative per session (Hello resets them on both sides), so lost or repeated control messages
never corrupt the accounting: the producer may send while sent < granted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Session:
    """One producer connection (zmq routing id) between Hello and Bye / timeout."""

    rid: bytes  # zmq routing id of the connection
    stream: str  # dedup.stream_key(worker_id, epoch)
    worker_id: str  # the producer's worker id
    last_seen: float  # monotonic time of the last message from it
    nonce: int = 0  # the producer's session number from its Hello
    demand: int = 0  # cumulative data messages the producer wants to send (from Hello / Ping / Data)
    granted: int = 0  # cumulative credits granted
    received: int = 0  # cumulative data messages received (accepted or not)
    queued: int = 0  # its trajectories waiting in the learner's queue
    granted_sent: int = 0  # `granted` as last told to the producer
    starts_sent: int = 0  # rollout admission: starts granted to its stream as last told to the producer
    acks: list[int] = field(default_factory=list)  # receipt acks not yet sent

    @property
    def outstanding(self) -> int:
        """Granted credits not used yet."""
        return max(self.granted - self.received, 0)


class CreditBook:
    """Sessions by routing id and the credit pool."""

    def __init__(self, slots: int, per_session: int) -> None:
        self.slots = slots
        self.per_session = per_session
        self.sessions: dict[bytes, Session] = {}
        self.by_stream: dict[str, bytes] = {}
        self.slots_used = 0  # trajectories queued for the learner (enqueued - freed)
        self._outstanding = 0
        self._hungry: OrderedDict[bytes, None] = OrderedDict()  # sessions that may want credits, round-robin

    @property
    def outstanding(self) -> int:
        """Credits granted and not used yet, over all sessions (kept incrementally)."""
        return self._outstanding

    def open(self, rid: bytes, stream: str, worker_id: str, demand: int, now: float) -> Session:
        """Start a session (a Hello); an older session of the same stream is closed first (reconnect)."""
        old = self.by_stream.get(stream)
        if old is not None and old != rid:
            self.close(old)
        self.close(rid)
        s = Session(rid=rid, stream=stream, worker_id=worker_id, last_seen=now, demand=demand)
        self.sessions[rid] = s
        self.by_stream[stream] = rid
        self._hungry[rid] = None
        return s

    def close(self, rid: bytes) -> Session | None:
        """Forget a session; its unused credits return to the pool."""
        s = self.sessions.pop(rid, None)
        if s is not None:
            self._outstanding -= s.outstanding
            self._hungry.pop(rid, None)
            if self.by_stream.get(s.stream) == rid:
                del self.by_stream[s.stream]
        return s

    def update_demand(self, s: Session, demand: int) -> None:
        if demand > s.demand:
            s.demand = demand
            self._hungry[s.rid] = None

    def on_data(self, s: Session) -> bool:
        """Count one data message; False when it came without a credit (the producer broke the protocol)."""
        s.received += 1
        self._hungry[s.rid] = None  # a used credit may be replaced (per-session cap)
        if s.received <= s.granted:
            self._outstanding -= 1
            return True
        return False

    def expire(self, now: float, timeout_s: float) -> list[Session]:
        dead = [s for s in self.sessions.values() if now - s.last_seen > timeout_s]
        for s in dead:
            self.close(s.rid)
        return dead

    def allocate(self, allow: bool) -> list[Session]:
        """Grant free slots to sessions that want them; returns sessions whose `granted` grew."""
        if not allow or not self._hungry:
            return []
        free = self.slots - self.slots_used - self.outstanding
        changed: list[Session] = []
        while free > 0 and self._hungry:
            rid, _ = self._hungry.popitem(last=False)
            s = self.sessions.get(rid)
            if s is None:
                continue
            want = min(s.demand - s.granted, self.per_session - s.outstanding - s.queued)
            if want <= 0:
                continue  # not hungry any more; update_demand / freed credits put it back
            give = min(want, max(1, free // (len(self._hungry) + 1)))
            s.granted += give
            self._outstanding += give
            free -= give
            changed.append(s)
            if give < want:
                self._hungry[rid] = None  # still hungry: back of the round-robin
        return changed

    def enqueued(self, s: Session) -> None:
        """A trajectory of `s` went into the learner's queue: it holds a slot until the learner takes it."""
        self.slots_used += 1
        s.queued += 1

    def freed(self, rids: list[bytes]) -> None:
        """The learner took these sessions' queued trajectories: their slots return; senders may want more now."""
        self.slots_used -= len(rids)
        assert self.slots_used >= 0, self.slots_used
        for rid in rids:
            s = self.sessions.get(rid)
            if s is not None:
                s.queued -= 1
                self._hungry[rid] = None

"""Rollout admission: every trajectory is trained within `bus.max_staleness` versions of its oldest token, and no
episode is generated to be thrown away (the peers' rule -- AReaL's rollout admission -- made to hold for each
trajectory, one long episode included).

Owned here: the rule the receiver grants episode starts by (`AdmissionBook`, on the receiver's I/O thread) and the
producer's record of its starts (`StartBook`, under the sender's lock). They talk through protocol.Starts (in a Ping)
and `starts_granted` (in Pong and Ack). Called by receiver_io.py, receiver.py, sender.py and sender_io.py; the rollout
worker asks `TrajectorySender.take_starts` before it starts an episode.

The rule, with N trajectories training each policy version and B = bus.max_staleness: one more start is granted
only while

    O + N * (V - v_min) + min(c, N) < (B + 1) * N

V is the version the learner's next take trains at; c the takes accepted at V that count towards its batch (value
pre-training takes do not: they move no version); O every trajectory started and not yet taken (grants not yet used,
episodes running, trajectories on the wire or spooled, the receiver's queue); v_min the lowest version among those
(a running episode counts its engines' version at its start, a producer asking for starts its engines' version now,
and V itself). docs/bus.md ("Rollout admission") proves that no trajectory started under it is taken more than B
versions after its oldest token, whatever the episode lengths, worker count or learner speed. Every count the rule
reads is a report that can only be too high or too old (versions only grow), so a late report delays a start and
never breaks the bound. What it cannot cover: trajectories started before the receiver came up (a resumed learner's
first minutes), and producers that start without asking; the staleness gate still measures those.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from megatron_sao.bus.protocol import Starts


def room(bound: int, per_step: int, outstanding: int, version: int, v_min: int, taken: int) -> int:
    """The rule above: how many more starts it allows, (B + 1) N - O - N (V - v_min) - min(c, N). Also what
    plan/simulate.py applies to its modelled runs."""
    return (bound + 1) * per_step - outstanding - per_step * (version - v_min) - min(taken, per_step)


@dataclass
class _Producer:
    rid: bytes  # the connection its grants go to
    report: Starts  # its latest
    granted: int  # cumulative starts granted (never below report.used)


class AdmissionBook:
    """The receiver's side: the producers' latest reports and what each was granted, keyed by stream."""

    def __init__(self, bound: int, per_step: int, current_version: Callable[[], int]) -> None:
        if bound < 0 or per_step < 1:
            raise ValueError(f"rollout admission needs bus.max_staleness >= 0 and trajectories per step >= 1, got "
                             f"{bound} and {per_step}")  # fmt: skip
        self.bound, self.per_step, self.current_version = bound, per_step, current_version
        self.producers: dict[str, _Producer] = {}
        self._turn = 0  # round-robin start among producers that want starts

    def report(self, stream: str, rid: bytes, starts: Starts) -> None:
        p = self.producers.get(stream)
        if p is None:
            self.producers[stream] = _Producer(rid, starts, starts.used)
            return
        p.rid, p.report, p.granted = rid, starts, max(p.granted, starts.used)

    def forget(self, stream: str) -> None:
        """A producer that said Bye or went silent: what it held is gone with it (a restart reports it again)."""
        self.producers.pop(stream, None)

    def granted(self, stream: str) -> int:
        p = self.producers.get(stream)
        return 0 if p is None else p.granted

    def room(self, queued: int, queued_oldest: int | None, taken: tuple[int, int]) -> int:
        """How many more starts the rule allows now. `queued`: trajectories in the receiver's queue, the lowest
        version among them `queued_oldest`; `taken`: (version, takes accepted at it towards its batch)."""
        version = self.current_version()
        outstanding = queued + sum(max(p.granted - p.report.used, 0) + p.report.held for p in self.producers.values())
        versions = [version] + [p.report.oldest for p in self.producers.values() if p.report.oldest >= 0]
        if queued_oldest is not None:
            versions.append(queued_oldest)
        counted = taken[1] if taken[0] == version else 0
        return room(self.bound, self.per_step, outstanding, version, min(versions), counted)

    def grant(self, queued: int, queued_oldest: int | None, taken: tuple[int, int]) -> list[tuple[str, int]]:
        """Grant what the rule allows, one start at a time round-robin over the producers that want some; returns
        (stream, cumulative granted) of the producers whose grant grew."""
        room = self.room(queued, queued_oldest, taken)
        wanting = [s for s, p in self.producers.items() if p.report.wanted > p.granted]
        if room <= 0 or not wanting:
            return []
        grown: set[str] = set()
        self._turn = (self._turn + 1) % len(wanting)
        order = wanting[self._turn :] + wanting[: self._turn]
        while room > 0 and order:
            for stream in list(order):
                p = self.producers[stream]
                if room <= 0:
                    break
                if p.report.wanted <= p.granted:
                    order.remove(stream)
                    continue
                p.granted += 1
                room -= 1
                grown.add(stream)
        return [(s, self.producers[s].granted) for s in sorted(grown)]


class StartBook:
    """The producer's side: starts asked for, granted and made, and the version each running episode started at.
    Not locked itself: the sender holds its outbox lock around every call."""

    def __init__(self) -> None:
        self.granted = 0  # cumulative, as the receiver last said
        self.used = 0
        self.wanted = 0
        self.floor = -1  # the engines' version at the last ask
        self.running: Counter[int] = Counter()  # start version -> episodes running from it

    def take(self, k: int, floor: int) -> int:
        """Ask for `k` starts with the engines at version `floor`; returns how many may start now (each runs until
        end(floor))."""
        self.floor = max(self.floor, floor)
        self.wanted = self.used + k
        made = max(0, min(k, self.granted - self.used))
        self.used += made
        if made:
            self.running[floor] += made
        return made

    def end(self, floor: int) -> None:
        """An episode started at `floor` ended: its trajectory was handed to the sender, or it was given up."""
        self.running[floor] -= 1
        if self.running[floor] <= 0:
            del self.running[floor]

    def starving(self) -> bool:
        return self.wanted > self.granted

    def report(self, unacked: Iterable[int]) -> Starts:
        """`unacked`: the oldest version of each trajectory sent or waiting to be sent and not receipt-acked (-1:
        none), so a trajectory between the worker and the receiver's queue is always counted somewhere."""
        unacked = list(unacked)
        versions = [v for v in self.running] + [v for v in unacked if v >= 0]
        if self.wanted > self.used or self.granted > self.used:  # starts still to come begin at least here
            versions.append(self.floor)
        versions = [v for v in versions if v >= 0]
        held = sum(self.running.values()) + len(unacked)
        return Starts(self.wanted, self.used, held, min(versions) if versions else -1)

"""Receiver-side de-duplication state: what the learner has consumed, per producer stream, in bounded memory.

Owned here: the consumed set (per stream: a watermark `low` plus the few consumed seqs above it), the window of
recently consumed trajectory ids, their (JSON-able) checkpoint form, and forgetting settled streams.
Called by receiver.py from the learner's thread only (no locking here); the receiver saves `state_dict()` with
each learner checkpoint, so after a restart exactly the trajectories whose effect was checkpointed count as seen.

Why this is bounded: a stream is (worker_id, epoch); its seqs increase by send order; every message carries the
producer's `base` (all seqs below are committed or abandoned and never resent), so `low >= base` and the seqs
above `low` are < base + max_uncommitted (the receiver refuses others). Ids are still the identity: an id seen
among the last `recent_ids` consumed is a duplicate even under a new seq (e.g. a producer that re-sent it).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any, Literal

STATE_FORMAT = 1
"""Version of state_dict()'s layout."""

Verdict = Literal["new", "duplicate_seq", "duplicate_id"]


class StreamState:
    """Consumed seqs of one stream: every seq < low, plus `above`."""

    __slots__ = ("above", "low")

    def __init__(self, low: int = 0, above: set[int] | None = None) -> None:
        self.low = low
        self.above: set[int] = above if above is not None else set()

    def seen(self, seq: int) -> bool:
        return seq < self.low or seq in self.above

    def add(self, seq: int) -> None:
        self.above.add(seq)
        while self.low in self.above:
            self.above.remove(self.low)
            self.low += 1

    def advance(self, base: int) -> None:
        """The producer will never send a seq below `base` again: fold it into the watermark."""
        if base <= self.low:
            return
        self.low = base
        self.above = {s for s in self.above if s >= base}
        while self.low in self.above:
            self.above.remove(self.low)
            self.low += 1

    def as_list(self) -> list[Any]:
        return [self.low, sorted(self.above)]

    @property
    def settled(self) -> bool:
        return not self.above


def stream_key(worker_id: str, epoch: str) -> str:
    return f"{worker_id}#{epoch}"


class DedupState:
    """Consumed seqs of every stream plus a window of recent ids; `check_and_add` is the only mutator."""

    def __init__(self, recent_ids: int, max_streams: int) -> None:
        self.streams: OrderedDict[str, StreamState] = OrderedDict()  # least recently consumed first
        self._recent_cap = recent_ids
        self._recent: deque[str] = deque()
        self._recent_set: set[str] = set()
        self.max_streams = max_streams

    def check_and_add(self, stream: str, seq: int, base: int, trajectory_id: str) -> Verdict:
        """Mark (stream, seq) consumed and say whether it, or its id, had been consumed before."""
        st = self.streams.get(stream)
        if st is None:
            st = self.streams[stream] = StreamState(low=base)
        else:
            self.streams.move_to_end(stream)
        st.advance(base)
        if st.seen(seq):
            return "duplicate_seq"
        st.add(seq)  # handled either way: a duplicate id under a new seq is consumed (and committed) as a drop
        if trajectory_id in self._recent_set:
            return "duplicate_id"
        if self._recent_cap:
            self._recent.append(trajectory_id)
            self._recent_set.add(trajectory_id)
            if len(self._recent) > self._recent_cap:
                self._recent_set.discard(self._recent.popleft())
        return "new"

    def prune(self, latest_base: dict[str, int]) -> list[str]:
        """Forget least recently used streams over max_streams that are provably settled; returns their keys.

        A stream may be forgotten once it has no consumed seq above its watermark and the producer has said
        (latest_base, from its pings) that it holds nothing below it: re-created later from the producer's
        base it then describes the same consumed set. Streams not known settled are kept (the state may then
        exceed max_streams; the receiver counts that).
        """
        excess = len(self.streams) - self.max_streams
        if excess <= 0:
            return []
        victims = [
            key
            for key, st in self.streams.items()
            if st.settled and latest_base.get(key, -1) >= st.low  # a stream never heard from again stays
        ][:excess]
        for key in victims:
            del self.streams[key]
        return victims

    def committed_view(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Immutable copy for the I/O thread: stream -> (low, sorted above)."""
        return {k: (st.low, tuple(sorted(st.above))) for k, st in self.streams.items()}

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "streams": {k: st.as_list() for k, st in self.streams.items()},
            "recent_ids": list(self._recent),
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Replace the state with a saved one; raises ValueError when `d` is not a state_dict() of this format."""
        if not isinstance(d, dict) or d.get("format") != STATE_FORMAT:
            raise ValueError(
                f"bus de-dup state has format {d.get('format') if isinstance(d, dict) else type(d).__name__!r}, "
                f"expected {STATE_FORMAT}: pass the dict saved from TrajectoryReceiver.state_dict()"
            )
        streams: OrderedDict[str, StreamState] = OrderedDict()
        try:
            for key, (low, above) in d["streams"].items():
                streams[str(key)] = StreamState(int(low), {int(s) for s in above})
            recent = [str(i) for i in d["recent_ids"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bus de-dup state is corrupt ({e!r}); pass an unmodified state_dict()") from e
        self.streams = streams
        if self._recent_cap:
            recent = recent[-self._recent_cap :]
        else:
            recent = []
        self._recent = deque(recent)
        self._recent_set = set(recent)

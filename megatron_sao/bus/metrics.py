"""Thread-safe counters of the bus (both sides' I/O thread and the caller's thread increment them).

Owned here: the counter store only; the names are chosen by receiver.py / receiver_io.py / sender.py and listed in
docs/bus.md. Read through TrajectoryReceiver.metrics() and TrajectorySender.metrics().
"""

from __future__ import annotations

import threading
from collections import defaultdict


class Counters:
    def __init__(self, *names: str) -> None:
        self._lock = threading.Lock()
        self._values: defaultdict[str, float] = defaultdict(float)
        for name in names:
            self._values[name] = 0.0

    def add(self, name: str, amount: float = 1.0) -> None:
        with self._lock:
            self._values[name] += amount

    def add_many(self, **amounts: float) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._values[name] += amount

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)

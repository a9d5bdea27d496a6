"""Staleness gate: how many weight versions behind the learner each trajectory is, and what to do over the bound.

Owned here: the staleness measure (learner version minus the oldest weight version among action tokens), its
histogram, the drop/keep decision for trajectories over `max_staleness`, and the record of those (a bounded list
of recent ids plus a JSONL log). Called by receiver.py on the learner's thread as each trajectory is taken.
A dropped trajectory is still consumed and committed by the receiver: it was handled, never silently lost.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from megatron_sao.bus.schema import Trajectory

BUCKETS: tuple[float, ...] = (0, 1, 2, 4, 8, 16, 32, 64, math.inf)
"""Upper bounds (inclusive) of the staleness histogram; metric names `staleness_le_<bound>`."""

LOG_NAME = "stale.jsonl"


def bucket_name(bound: float) -> str:
    return f"staleness_le_{'inf' if math.isinf(bound) else int(bound)}"


class StalenessGate:
    """Measures staleness against `current_version()`; keeps or drops trajectories over `max_staleness`."""

    def __init__(
        self,
        current_version: Callable[[], int] | None,
        max_staleness: int | None,
        policy: Literal["drop", "keep"],
        log_dir: str | None,
        recent_cap: int,
    ) -> None:
        if max_staleness is not None and current_version is None:
            raise ValueError(
                "bus.max_staleness is set but the TrajectoryReceiver has no current_version callable; "
                "pass current_version=lambda: learner_weight_version, or set bus.max_staleness=null"
            )
        self._current_version = current_version
        self._max = max_staleness
        self._policy = policy
        self.recent: deque[str] = deque(maxlen=recent_cap)
        self._log_path = Path(log_dir) / LOG_NAME if log_dir else None
        if self._log_path is not None:
            self._log_path.parent.mkdir(parents=True, exist_ok=True)
        self.hist = dict.fromkeys(BUCKETS, 0)
        self.count = 0
        self.total = 0
        self.max_seen = 0
        self.dropped = 0
        self.kept_over = 0

    def admit(self, traj: Trajectory) -> bool:
        """Record the trajectory's staleness in traj.extras["staleness"]; False means drop it."""
        if self._current_version is None:
            return True
        current = int(self._current_version())
        oldest = traj.extras["oldest_version"] if "oldest_version" in traj.extras else traj.oldest_version()
        staleness = 0 if oldest is None else current - oldest
        traj.extras["staleness"] = staleness
        self._observe(max(staleness, 0))
        if self._max is None or staleness <= self._max:
            return True
        drop = self._policy == "drop"
        if drop:
            self.dropped += 1
        else:
            self.kept_over += 1
        self.recent.append(traj.trajectory_id)
        self._log(traj, staleness, current, oldest, "dropped" if drop else "kept")
        return not drop

    def _observe(self, staleness: int) -> None:
        self.count += 1
        self.total += staleness
        self.max_seen = max(self.max_seen, staleness)
        for bound in BUCKETS:
            if staleness <= bound:
                self.hist[bound] += 1
                break

    def _log(self, traj: Trajectory, staleness: int, current: int, oldest: int | None, action: str) -> None:
        if self._log_path is None:
            return
        h = traj.header
        line = {
            "trajectory_id": h.trajectory_id,
            "prompt_id": h.prompt_id,
            "worker_id": h.worker_id,
            "staleness": staleness,
            "learner_version": current,
            "oldest_version": oldest,
            "max_staleness": self._max,
            "action": action,
            "time": time.time(),
        }
        with self._log_path.open("a") as f:
            f.write(json.dumps(line) + "\n")

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {bucket_name(b): float(n) for b, n in self.hist.items()}
        out["stale_dropped"] = float(self.dropped)
        out["stale_kept"] = float(self.kept_over)
        out["staleness_max"] = float(self.max_seen)
        out["staleness_mean"] = self.total / self.count if self.count else 0.0
        return out

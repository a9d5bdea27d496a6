"""TrajectoryReceiver: the learner's end of the bus (the API the learner loop codes against).

Owned here: taking trajectories off the I/O thread's queue on the caller's thread, de-duplication (dedup.py) and
the staleness gate (staleness.py) at the moment the learner takes them, commits, and the checkpointable state.
Called by the learner loop (one thread). Socket work happens on the I/O thread in receiver_io.py.

Exactly-once as seen by training: call `state_dict()`, save it inside the learner checkpoint, then `commit()`.
Only committed trajectories are forgotten by producers; after a crash, restore the receiver with the state of
the checkpoint the learner resumes from (`TrajectoryReceiver(cfg, state=...)` or `load_state_dict`), and every
trajectory not in it arrives again while those in it are dropped as duplicates.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from megatron_sao.bus.admission import AdmissionBook
from megatron_sao.bus.dedup import DedupState
from megatron_sao.bus.metrics import Counters
from megatron_sao.bus.protocol import Reason
from megatron_sao.bus.receiver_io import Inbox, Item, ReceiverIO
from megatron_sao.bus.schema import Trajectory
from megatron_sao.bus.staleness import StalenessGate
from megatron_sao.config.bus import BusConfig

_BATCH_SLICE_S = 0.005  # recv_batch looks at the queue at least this often while waiting for several

_COUNTERS = ("received", "accepted", "accepted_bytes", "duplicates", "duplicates_by_id", "rejected")


class TrajectoryReceiver:
    """Binds `cfg.bind` and receives trajectories from any number of TrajectorySenders.

    recv() returns trajectories whose arrays are read-only views on the received frames (copy to modify).
    """

    def __init__(
        self,
        cfg: BusConfig,
        current_version: Callable[[], int] | None = None,
        *,
        state: dict[str, Any] | None = None,
        admission_per_step: int | None = None,
        pretraining: Callable[[], bool] | None = None,
        max_ahead: int | None = None,
    ) -> None:
        """`admission_per_step`: trajectories per policy version, for rollout admission (bus.admission with
        bus.max_staleness; None: producers start freely); `pretraining()`: True while takes train no policy version
        (value pre-training), so they do not count towards one; `max_ahead`: see StalenessGate."""
        self.cfg = cfg
        self._counters = Counters(*_COUNTERS, *(f"rejected_{r.value}" for r in Reason))
        self._dedup = DedupState(cfg.dedup_recent_ids, cfg.max_streams)
        self._gate = StalenessGate(
            current_version, cfg.max_staleness, cfg.stale_policy, cfg.stale_log_dir, cfg.stale_recent_ids, max_ahead
        )
        self._inbox = Inbox()
        self._current_version = current_version
        self._pretraining = pretraining
        self._admission = None
        if cfg.admission and cfg.max_staleness is not None and admission_per_step and current_version is not None:
            self._admission = AdmissionBook(cfg.max_staleness, admission_per_step, current_version)
        self._wake_batch = max(1, min(cfg.recv_queue_size, cfg.max_inflight) // 8)
        self._saved_views: list[dict[str, tuple[int, tuple[int, ...]]]] = []  # of the last state_dict() calls
        self._saved_since_commit = False
        self._closed = False
        if state is not None:
            self._load(state)
        self._io = ReceiverIO(cfg, self._counters, self._inbox, self._admission)
        self._io.start()

    # ---- receiving ---------------------------------------------------------------------------------------------

    def recv(self, timeout_s: float | None = None) -> Trajectory | None:
        """The next accepted trajectory, or None when none arrived within timeout_s (None: wait forever)."""
        got = self.recv_batch(1, timeout_s)
        return got[0] if got else None

    def recv_batch(self, n: int, timeout_s: float | None = None) -> list[Trajectory]:
        """Up to n trajectories: waits until n arrived or timeout_s passed (None: until n arrived)."""
        if n < 1:
            raise ValueError(f"recv_batch(n={n}): n must be >= 1")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        out: list[Trajectory] = []
        if self._admission is not None:
            with self._inbox.cv:
                moved = self._count_towards_version(0)
            if moved:  # a new version since the last take makes room before anything arrives
                self._io.wake()
        while len(out) < n:
            items = self._take(n - len(out), deadline)
            if not items:
                break
            for item in items:
                traj = self._admit(item)
                if traj is not None:
                    out.append(traj)
        return out

    def _count_towards_version(self, taken: int) -> bool:
        """Rollout admission (inbox lock held): takes count towards the batch of the version they train at, in the
        same breath as they leave the queue, so a trajectory is always counted somewhere (duplicates and stale
        ones too: counting more only delays a start); value pre-training takes count nothing. True when the
        version moved since the last take: that makes room for starts, so the I/O thread should look at once."""
        version = int(self._current_version())  # type: ignore[misc]
        counts = not (self._pretraining is not None and self._pretraining())
        last, n = self._inbox.taken
        moved = version != last
        self._inbox.taken = (version, (0 if moved else n) + (taken if counts else 0))
        return moved

    def _take(self, want: int, deadline: float | None) -> list[Item]:
        """Up to `want` queued items; [] at the deadline.

        Waiting for several, the I/O thread wakes this thread only once `want` are queued, and this thread looks
        every _BATCH_SLICE_S anyway (the queue may never hold `want`: credits cap it), so a batch costs one
        wake-up rather than one per trajectory.
        """
        inbox = self._inbox
        with inbox.cv:
            sliced = False
            while len(inbox.queue) < want and not (sliced and inbox.queue):
                if inbox.error is not None:
                    raise RuntimeError("bus receiver I/O thread failed; see the log") from inbox.error
                if self._closed:
                    raise RuntimeError("TrajectoryReceiver is closed")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                inbox.waiting_for = want
                if want > 1:
                    remaining = _BATCH_SLICE_S if remaining is None else min(remaining, _BATCH_SLICE_S)
                    sliced = True
                inbox.cv.wait(remaining)
            inbox.waiting_for = 0
            items = [inbox.queue.popleft() for _ in range(min(want, len(inbox.queue)))]
            for item in items:
                inbox.queued_bytes -= item.nbytes
                inbox.freed.append(item.rid)
            if self._admission is not None and items:
                self._count_towards_version(len(items))
            # return credits in batches, but at once when the queue ran dry (the producers must not starve)
            wake = bool(items) and (len(inbox.freed) >= self._wake_batch or not inbox.queue)
        if wake:
            self._io.wake()
        return items

    def _admit(self, item: Item) -> Trajectory | None:
        traj = item.traj
        verdict = self._dedup.check_and_add(item.stream, item.seq, item.base, traj.trajectory_id)
        if verdict != "new":
            self._counters.add("duplicates")
            if verdict == "duplicate_id":
                self._counters.add("duplicates_by_id")
            return None
        if not self._gate.admit(traj):
            return None
        self._counters.add_many(accepted=1, accepted_bytes=item.nbytes)
        return traj

    # ---- durability --------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON/msgpack-able de-dup state covering every trajectory returned so far; save it in the checkpoint.

        It also marks what a later commit() covers (trajectories returned after this call are not included).
        """
        sd = self._dedup.state_dict()
        self._saved_views.append({k: (low, tuple(above)) for k, (low, above) in sd["streams"].items()})
        self._saved_since_commit = True
        return sd

    def commit(self, keep: int = 0) -> None:
        """Tell producers that what a saved state_dict() covered is durable; they may drop it for good.

        Call right after the checkpoint holding the last state_dict() is safely written. `keep` > 0 commits the
        state_dict() saved `keep` checkpoints earlier instead (nothing until there is one), so producers still hold
        everything since: a resume from one of those older checkpoints (the newer ones damaged) gets it all again.
        Without any state_dict() since the last commit, it commits everything returned so far (for runs that never
        checkpoint the bus).
        """
        if not self._saved_since_commit:
            view: dict[str, tuple[int, tuple[int, ...]]] | None = self._dedup.committed_view()
        else:
            view = self._saved_views[-1 - keep] if len(self._saved_views) > keep else None
        self._saved_since_commit = False
        del self._saved_views[: max(0, len(self._saved_views) - keep)]
        if view is not None:
            with self._inbox.cv:
                old = self._inbox.committed
                self._inbox.committed = view
                self._inbox.dirty.update(k for k, v in view.items() if old.get(k) != v)
        with self._inbox.cv:
            latest_base = dict(self._inbox.latest_base)
        forgotten = self._dedup.prune(latest_base)
        if forgotten:
            with self._inbox.cv:
                for key in forgotten:
                    self._inbox.latest_base.pop(key, None)
        self._counters.add("streams_forgotten", len(forgotten))
        self._counters.add("commits")
        self._io.wake()

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore the state saved in the checkpoint the learner resumes from (call before the first recv)."""
        self._load(d)
        self._io.wake()

    def _load(self, d: dict[str, Any]) -> None:
        self._dedup.load_state_dict(d)
        view = self._dedup.committed_view()  # it was in a checkpoint, so it is committed
        self._saved_views = [view]
        self._saved_since_commit = False
        with self._inbox.cv:
            self._inbox.committed = view
            self._inbox.dirty.update(view)

    # ---- introspection and shutdown ------------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """Counters (accepted, duplicates, rejected_<reason>, stale_dropped, bytes, ...) and gauges."""
        out = self._counters.snapshot()
        out.update(self._gate.metrics())
        with self._inbox.cv:
            out["queued"] = float(len(self._inbox.queue))
            out["queued_bytes"] = float(self._inbox.queued_bytes)
        out["sessions"] = float(len(self._io.book.sessions))
        out["streams"] = float(len(self._dedup.streams))
        return out

    def stale_ids(self) -> list[str]:
        """Ids of the most recent trajectories over max_staleness (dropped or kept), oldest first."""
        return list(self._gate.recent)

    @property
    def incarnation(self) -> str:
        """Random id of this receiver process; producers resend everything uncommitted when it changes."""
        return self._io.incarnation

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._inbox.cv:
            self._inbox.cv.notify_all()
        self._io.stop()
        self._gate.close()

    def __enter__(self) -> TrajectoryReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

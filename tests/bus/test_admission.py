"""Rollout admission (bus/admission.py): the receiver grants episode starts so that every trajectory trains within
bus.max_staleness versions of its oldest token, and nothing is generated to be dropped -- with one or several
producers, long episodes among short ones, a slow learner and engines that get each version late. Without admission
the same run drops trajectories as stale (the test can fail)."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import pytest

from megatron_sao.bus import TrajectoryReceiver, TrajectorySender
from megatron_sao.bus.admission import AdmissionBook, StartBook
from megatron_sao.bus.protocol import Starts
from tests.bus.helpers import fast_cfg, free_addr, traj


def test_the_rule_counts_what_is_outstanding_and_how_far_its_oldest_is_behind() -> None:
    version = {"v": 5}
    book = AdmissionBook(bound=2, per_step=4, current_version=lambda: version["v"])
    assert book.room(0, None, (5, 0)) == 12  # nothing outstanding: (B + 1) * N
    assert book.room(3, 5, (5, 2)) == 12 - 3 - 2  # three queued at V, two taken towards V's batch
    assert book.room(0, None, (4, 3)) == 12  # takes of an older version count nothing now
    assert book.room(0, None, (5, 9)) == 12 - 4  # a batch counts at most N
    book.report("a", b"a", Starts(wanted=10, used=6, held=5, oldest=3))
    # five held, granted (= used) 6: nothing pending; the oldest, version 3, is two versions behind
    assert book.room(0, None, (5, 0)) == 12 - 5 - 2 * 4
    assert book.grant(0, None, (5, 0)) == []  # room -1: nothing
    version["v"] = 4  # (a learner cannot go back; this only moves V - v_min to 1)
    assert book.room(0, None, (4, 0)) == 12 - 5 - 4
    assert book.grant(0, None, (4, 0)) == [("a", 9)]  # three granted: 6 -> 9
    assert book.room(0, None, (4, 0)) == 0  # the three pending grants are outstanding


def test_grants_go_round_robin_and_never_beyond_what_a_producer_asked() -> None:
    book = AdmissionBook(bound=0, per_step=5, current_version=lambda: 0)
    book.report("a", b"a", Starts(wanted=10, used=0, held=0, oldest=0))
    book.report("b", b"b", Starts(wanted=1, used=0, held=0, oldest=0))
    granted = dict(book.grant(0, None, (0, 0)))
    assert granted["b"] == 1 and granted["a"] == 4  # five in all; b got what it asked
    book.forget("a")  # gone: what it held no longer counts
    assert book.room(0, None, (0, 0)) == 5 - 1


def test_the_producers_book_reports_running_and_unacked_trajectories_and_its_engines_version() -> None:
    book = StartBook()
    assert book.take(3, floor=7) == 0 and book.starving()
    book.granted = 2
    assert book.take(3, floor=8) == 2  # two granted: made at floor 8
    report = book.report([6, -1])  # two not receipt-acked, one of them version 6
    assert report == Starts(wanted=3 + 0, used=2, held=2 + 2, oldest=6)
    book.end(8)
    book.end(8)
    assert book.report([]) == Starts(wanted=3, used=2, held=0, oldest=8)  # still wants one: its engines' version


@dataclass
class _Episode:
    ends_at: float
    floor: int
    version: int


class _World:
    """Engines that get each new version `push_s` after the learner made it, and the learner's version."""

    def __init__(self, push_s: float) -> None:
        self.learner = 0
        self.engines = 0
        self.push_s = push_s
        self.lock = threading.Lock()

    def stepped(self) -> None:
        with self.lock:
            self.learner += 1
            v = self.learner
        timer = threading.Timer(self.push_s, self._pushed, args=(v,))
        timer.daemon = True
        timer.start()

    def _pushed(self, v: int) -> None:
        with self.lock:
            self.engines = max(self.engines, v)


def _producer(addr: str, name: str, world: _World, stop: threading.Event, concurrency: int, seed: int,
              counts: dict[str, int], admission: bool, bound: int) -> None:  # fmt: skip
    """A rollout worker in small: up to `concurrency` episodes, mostly short, one in ten twenty times longer."""
    rng = random.Random(seed)
    running: list[_Episode] = []
    n = 0
    with TrajectorySender(fast_cfg(addr, max_staleness=bound, admission=admission), name) as sender:
        while not stop.is_set():
            now = time.monotonic()
            for ep in [e for e in running if e.ends_at <= now]:
                running.remove(ep)
                sender.send(traj(n, worker=name, version=ep.version), timeout_s=10)
                n += 1
                if sender.admitting:
                    sender.end_start(ep.floor)
            free = concurrency - len(running)
            if free and sender.admitting is not None:
                floor = world.engines
                made = sender.take_starts(free, floor) if sender.admitting else free
                for _ in range(made):
                    length = 0.6 if rng.random() < 0.1 else rng.uniform(0.01, 0.05)
                    running.append(_Episode(now + length, floor, world.engines))  # its first token's version
            time.sleep(0.005)
        sender.flush(timeout_s=0)
    counts[name] = n


def _run(workers: int, admission: bool, bound: int = 1, steps: int = 14, per_step: int = 4
         ) -> tuple[dict[str, float], int, int]:  # fmt: skip
    addr = free_addr()
    world = _World(push_s=0.03)
    version = lambda: world.learner  # noqa: E731
    stop = threading.Event()
    counts: dict[str, int] = {}
    cfg = fast_cfg(addr, max_staleness=bound, admission=admission, stale_log_dir=None)
    taken = 0
    with TrajectoryReceiver(cfg, version, admission_per_step=per_step) as rx:
        threads = [threading.Thread(target=_producer, args=(addr, f"p{i}", world, stop, 6, i, counts, admission, bound))
                   for i in range(workers)]  # fmt: skip
        for t in threads:
            t.start()
        try:
            for _ in range(steps):
                batch = rx.recv_batch(per_step, timeout_s=30)
                assert len(batch) == per_step, "the learner starved: admission deadlocked"
                taken += len(batch)
                time.sleep(0.08)  # a slow learner: episodes pile up behind it
                world.stepped()
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        metrics = rx.metrics()
    return metrics, taken, sum(counts.values())


@pytest.mark.parametrize(("workers", "bound"), [(1, 1), (3, 1), (2, 0)])
def test_admission_bounds_every_trajectorys_staleness_and_drops_nothing(workers: int, bound: int) -> None:
    metrics, taken, produced = _run(workers, admission=True, bound=bound)
    assert metrics["staleness_max"] <= bound
    assert metrics["stale_dropped"] == 0
    assert taken == 14 * 4
    # what was generated beyond the learner's takes is at most what the rule lets be outstanding at the end
    assert produced - taken <= (bound + 1) * 4


def test_without_admission_the_same_run_drops_stale_trajectories() -> None:
    metrics, _, _ = _run(3, admission=False)
    assert metrics["stale_dropped"] > 0 and metrics["staleness_max"] > 1

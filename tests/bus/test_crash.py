"""Exactly-once as seen by training across SIGKILLs: learner and producers run as separate processes.

The stand-in learner (procs/bus_receiver.py) checkpoints the ids it consumed together with the receiver state and
commits after each checkpoint; the ids in its last checkpoint are what training saw. Producers
(procs/bus_producer.py) send deterministic ids. Whatever gets killed, every id must be in the final checkpoint once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.bus.helpers import fast_cfg, free_addr, wait_for

REPO = Path(__file__).resolve().parents[2]
PROCS = Path(__file__).resolve().parent / "procs"

pytestmark = pytest.mark.multiproc


class Cluster:
    """Starts, kills and restarts the stand-in processes of one test."""

    def __init__(self, tmp: Path, **cfg: object) -> None:
        self.tmp = tmp
        self.cfg = fast_cfg(free_addr(), max_inflight=4, recv_queue_size=16, **cfg)
        self.cfg_json = self.cfg.model_dump_json(exclude_defaults=True)
        self.ckpt, self.stop = tmp / "ckpt.json", tmp / "stop"
        self.procs: list[subprocess.Popen] = []

    def _spawn(self, name: str, *args: object) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.{len(self.procs)}.log", "w")  # noqa: SIM115 - closed with the process
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        p = subprocess.Popen([sys.executable, str(PROCS / name), *map(str, args)], stdout=log, stderr=log, env=env)
        self.procs.append(p)
        return p

    def receiver(self, every: int = 5) -> subprocess.Popen:
        return self._spawn("bus_receiver.py", self.cfg_json, self.ckpt, self.stop, every)

    def producer(self, worker: str, count: int, tokens: int = 64, sleep_s: float = 0.01) -> subprocess.Popen:
        progress = self.tmp / f"{worker}.progress"
        return self._spawn("bus_producer.py", self.cfg_json, worker, count, progress, tokens, sleep_s)

    def checkpointed(self) -> list[str]:
        return json.loads(self.ckpt.read_text())["ids"] if self.ckpt.exists() else []

    def progress(self, worker: str) -> int:
        path = self.tmp / f"{worker}.progress"
        return int(path.read_text()) if path.exists() else 0

    def kill(self, p: subprocess.Popen) -> None:
        p.send_signal(signal.SIGKILL)
        p.wait(10)

    def finish(self, receiver: subprocess.Popen, producers: list[subprocess.Popen], timeout_s: float = 90) -> None:
        for p in producers:
            assert p.wait(timeout_s) == 0, self.logs()
        self.stop.touch()
        assert receiver.wait(30) == 0, self.logs()

    def logs(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(self.tmp.glob("*.log")))

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


@pytest.fixture
def cluster(tmp_path: Path):
    c = Cluster(tmp_path, spool_dir=str(tmp_path / "spool"))
    yield c
    c.close()


def _expected(workers: dict[str, int]) -> Counter:
    return Counter(f"{w}-{k}" for w, n in workers.items() for k in range(n))


def test_receiver_sigkill_and_restart_from_checkpoint_exactly_once(cluster: Cluster) -> None:
    workers = {"p0": 40, "p1": 40}
    r = cluster.receiver()
    producers = [cluster.producer(w, n) for w, n in workers.items()]
    wait_for(lambda: len(cluster.checkpointed()) >= 20, timeout_s=60, what="first checkpoints")
    cluster.kill(r)  # mid-stream: some consumed after the last checkpoint, some queued, some in flight
    assert len(cluster.checkpointed()) < 80
    r = cluster.receiver()
    cluster.finish(r, producers)
    assert Counter(cluster.checkpointed()) == _expected(workers)


def test_producer_sigkill_and_restart_with_its_spool_exactly_once(cluster: Cluster) -> None:
    workers = {"p0": 40, "p1": 30}
    r = cluster.receiver(every=20)
    p0 = cluster.producer("p0", workers["p0"], sleep_s=0.02)
    p1 = cluster.producer("p1", workers["p1"])
    spool = cluster.tmp / "spool" / "p0"
    # kill while p0 has uncommitted trajectories on disk. A commit can empty the spool between a look and the kill,
    # so the receiver is frozen first (no more acks), its acks already sent are given time to land, then p0 dies.
    wait_for(lambda: cluster.progress("p0") >= 15, timeout_s=60, what="p0 mid-stream")
    r.send_signal(signal.SIGSTOP)
    try:
        time.sleep(0.5)
        wait_for(lambda: any(spool.glob("*.traj")), timeout_s=30, what="p0 to spool past the last commit")
        cluster.kill(p0)
    finally:
        r.send_signal(signal.SIGCONT)
    spooled = list(spool.glob("*.traj"))
    assert spooled, "the kill should leave uncommitted trajectories in the spool"
    p0 = cluster.producer("p0", workers["p0"])
    cluster.finish(r, [p0, p1])
    assert Counter(cluster.checkpointed()) == _expected(workers)
    assert not list((cluster.tmp / "spool" / "p0").glob("*.traj"))


@pytest.mark.slow
def test_repeated_kills_of_both_sides_exactly_once(cluster: Cluster) -> None:
    workers = {f"p{i}": 150 for i in range(4)}
    r = cluster.receiver(every=16)
    producers = {w: cluster.producer(w, n, tokens=512, sleep_s=0.005) for w, n in workers.items()}
    total = sum(workers.values())
    for round_, victim in enumerate(("p0", "p2")):
        wait_for(lambda n=round_: len(cluster.checkpointed()) >= (n + 1) * total // 4, timeout_s=120, what="progress")
        cluster.kill(r)
        cluster.kill(producers[victim])
        r = cluster.receiver(every=16)
        producers[victim] = cluster.producer(victim, workers[victim], tokens=512, sleep_s=0.005)
    wait_for(lambda: len(cluster.checkpointed()) >= 3 * total // 4, timeout_s=120, what="progress")
    cluster.kill(producers["p1"])  # a producer alone, while the learner keeps going
    producers["p1"] = cluster.producer("p1", workers["p1"], tokens=512, sleep_s=0.005)
    cluster.finish(r, list(producers.values()), timeout_s=180)
    assert Counter(cluster.checkpointed()) == _expected(workers)

"""Load: producers offering ten times the trajectory rate a deliberately slow learner consumes. Memory stays bounded
on both sides (the learner's queue holds no more than the credits it granted; a producer blocks instead of
buffering), the producers back off to the learner's pace, and nothing is dropped: every id is trained exactly once.

The producers are processes (tests/bus/procs/bus_producer.py, with a spool as in a run); the learner is this test
(the real receiver, a fixed time per step, a commit after each step as after a checkpoint)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from megatron_sao.bus import TrajectoryReceiver
from tests.bus.helpers import fast_cfg, free_addr
from tests.chaos.report import write_report

REPO = Path(__file__).resolve().parents[2]
PRODUCER = REPO / "tests" / "bus" / "procs" / "bus_producer.py"

PRODUCERS, EACH, TOKENS = 4, 300, 8192  # 1200 trajectories of ~106 KB: ~127 MB through the bus
STEP, STEP_S = 10, 0.1  # the learner: 100 trajectories/s
OFFERED_S = PRODUCERS / (10 * STEP / STEP_S)  # each producer's pause between sends: together 10x the learner's rate


@pytest.mark.multiproc
def test_ten_times_the_rate_into_a_slow_learner_bounds_memory_backs_off_and_drops_nothing(tmp_path: Path) -> None:
    addr = free_addr()
    cfg = fast_cfg(addr, max_inflight=16, spool_dir=str(tmp_path / "spool"))
    as_json = cfg.model_dump_json(exclude_defaults=True)
    me = psutil.Process()
    seen: Counter[str] = Counter()
    rss: list[int] = []
    queued: list[float] = []
    producer_rss: dict[int, list[int]] = {}
    with TrajectoryReceiver(cfg) as receiver:
        started = time.monotonic()
        procs = [subprocess.Popen([sys.executable, str(PRODUCER), as_json, f"p{i}", str(EACH),
                                   str(tmp_path / f"progress-{i}"), str(TOKENS), str(OFFERED_S)],
                                  cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for i in range(PRODUCERS)]  # fmt: skip
        deadline = time.monotonic() + 240
        while sum(seen.values()) < PRODUCERS * EACH:
            assert time.monotonic() < deadline, f"only {sum(seen.values())} trained after 240 s"
            batch = receiver.recv_batch(STEP, timeout_s=5.0)
            time.sleep(STEP_S)  # the slow learner's step
            seen.update(t.trajectory_id for t in batch)
            receiver.state_dict()
            receiver.commit()  # as after a checkpoint: producers may forget these
            rss.append(me.memory_info().rss)
            queued.append(receiver.metrics()["queued"])
            for p in procs:
                if p.poll() is None:
                    producer_rss.setdefault(p.pid, []).append(psutil.Process(p.pid).memory_info().rss)
        elapsed = time.monotonic() - started
        for p in procs:
            assert p.wait(timeout=60) == 0, p.stderr.read() if p.stderr else ""
    total = PRODUCERS * EACH
    assert sorted(seen) == sorted(f"p{i}-{k}" for i in range(PRODUCERS) for k in range(EACH))  # nothing dropped
    assert set(seen.values()) == {1}  # nothing twice
    offered, achieved = PRODUCERS / OFFERED_S, total / elapsed
    assert achieved < offered / 3, (achieved, offered)  # the producers went at the learner's pace, not theirs
    warm = len(rss) // 5  # after the first fifth: imports and first buffers are in
    growth_mb = (max(rss[warm:]) - rss[warm]) / 2**20
    payload_mb = total * TOKENS * 13 / 2**20
    assert growth_mb < 48, f"the learner's memory grew {growth_mb:.0f} MB over {payload_mb:.0f} MB of trajectories"
    assert max(queued) <= PRODUCERS * cfg.max_inflight  # no more than the credits it granted
    producer_growth_mb = max((max(r[len(r) // 5 :]) - r[len(r) // 5]) / 2**20 for r in producer_rss.values() if r)
    assert producer_growth_mb < 48, f"a producer's memory grew {producer_growth_mb:.0f} MB while blocked"
    write_report("load-10x", {
        "faults": [{"fault": f"{offered:.0f} trajectories/s offered to a learner taking {STEP / STEP_S:.0f}/s",
                    "achieved_per_s": round(achieved, 1), "learner_rss_growth_mb": round(growth_mb, 1),
                    "producer_rss_growth_mb": round(producer_growth_mb, 1), "max_queued": max(queued),
                    "payload_mb": round(payload_mb)}],
        "ledger": {"produced": total, "consumed": sum(seen.values())}, "ok": True, "seconds": round(elapsed, 1),
    })  # fmt: skip

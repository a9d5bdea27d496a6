"""Shared helpers of the bus tests: loopback addresses, fast-timing configs, trajectories, waiting."""

from __future__ import annotations

import time
from collections.abc import Callable

from megatron_sao.bus.schema import Trajectory
from megatron_sao.bus.synthetic import make_trajectory
from megatron_sao.config.bus import BusConfig
from megatron_sao.distributed.spawn import find_free_port


def free_addr() -> str:
    return f"tcp://127.0.0.1:{find_free_port()}"


def fast_cfg(addr: str, **overrides: object) -> BusConfig:
    """Short heartbeats and timeouts so restarts are noticed within a second."""
    kw: dict[str, object] = {"bind": addr, "heartbeat_s": 0.1, "peer_timeout_s": 1.0, "resend_after_s": 2.0}
    kw.update(overrides)
    return BusConfig(**kw)


def traj(i: int | str, n: int = 32, *, worker: str = "w", version: int = 0) -> Trajectory:
    tid = i if isinstance(i, str) else f"{worker}-{i}"
    return make_trajectory(tid, n, worker_id=worker, version=version, seed=hash(tid) % 1000)


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.01)

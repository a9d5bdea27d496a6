"""The learner's batching (run/batches.py) on a fake receiver: when it gives up waiting so that the engines get a
push, and when it keeps waiting."""

from __future__ import annotations

import time
from typing import Any

from megatron_sao.learner.synthetic import make_batch
from megatron_sao.run import batches as B


class _Receiver:
    """Hands out `arrivals` one call at a time (an empty list: nothing came within the timeout)."""

    def __init__(self, arrivals: list[list[Any]], stale: float = 0.0) -> None:
        self.arrivals, self.stale, self.calls = arrivals, stale, 0

    def recv_batch(self, n: int, timeout_s: float) -> list[Any]:
        self.calls += 1
        return self.arrivals.pop(0) if self.arrivals else []

    def metrics(self) -> dict[str, float]:
        return {"stale_dropped": self.stale}


def test_a_batch_is_the_first_n_arrivals_and_the_rest_is_held(monkeypatch: Any) -> None:
    monkeypatch.setattr(B, "ENGINE_CHECK_S", 0.0)
    t = make_batch(5)
    batches = B.Batches(_Receiver([t[:2], [], t[2:]]), 3, None)
    assert batches.next(False) == t[:3] and batches.held == t[3:]


def test_an_engine_that_came_back_ends_the_wait_at_the_next_check(monkeypatch: Any) -> None:
    """Nothing arrives (the restarted engine generates at version 0, dropped as stale): the learner does not wait
    RESYNC_AFTER_S for it once it sees that the engines serving changed."""
    monkeypatch.setattr(B, "ENGINE_CHECK_S", 0.0)
    checks: list[float] = []

    def changed() -> bool:
        checks.append(time.monotonic())
        return len(checks) >= 2

    receiver = _Receiver([])
    assert B.Batches(receiver, 3, None).next(False, engines_changed=changed) is None
    assert receiver.calls == 2 and len(checks) == 2


def test_without_a_reason_to_push_it_waits_on(monkeypatch: Any) -> None:
    monkeypatch.setattr(B, "ENGINE_CHECK_S", 1.0)
    monkeypatch.setattr(B, "RESYNC_AFTER_S", 3.0)
    t = make_batch(3)
    receiver = _Receiver([[], [], [], [], [], t])  # 5 quiet slices: nothing went stale, no engine changed
    assert B.Batches(receiver, 3, None).next(False, engines_changed=lambda: False) == t
    stale = _Receiver([[], [], [], t], stale=1.0)  # grows from the first look: dropped as stale -> push
    stale_batches = B.Batches(stale, 3, None)
    stale.stale = 0.0
    stale_calls = []

    def growing() -> bool:
        stale_calls.append(1)
        stale.stale = float(len(stale_calls))
        return False

    assert stale_batches.next(False, engines_changed=growing) is None and stale.calls == 3  # after RESYNC_AFTER_S


def test_with_no_rollout_worker_connected_the_wait_ends_naming_the_bus(monkeypatch: Any) -> None:
    """bus.producer_wait_s: no session on the bus for that long while waiting ends the wait with NoProducers, which
    names the address and the field; a worker connected in between starts the count again; 0 waits for ever."""
    import pytest

    from megatron_sao.config.bus import BusConfig
    from megatron_sao.learner.errors import NoProducers

    monkeypatch.setattr(B, "ENGINE_CHECK_S", 1.0)
    monkeypatch.setattr(B, "RESYNC_AFTER_S", 5.0)
    bus = BusConfig(producer_wait_s=20.0, bind="tcp://127.0.0.1:5599")

    class Alone(_Receiver):
        def __init__(self, sessions: list[int]) -> None:
            super().__init__([])
            self.sessions = sessions

        def metrics(self) -> dict[str, float]:
            return {"stale_dropped": 0.0, "sessions": float(self.sessions.pop(0) if self.sessions else 0)}

    lonely = Alone([])
    with pytest.raises(NoProducers, match=r"tcp://127.0.0.1:5599.*20 s.*bus.producer_wait_s"):
        B.Batches(lonely, 3, None, bus=bus).next(False)
    assert lonely.calls == 20  # 20 s of quiet slices, looked at every RESYNC_AFTER_S
    back = Alone([0, 0, 0, 1, 0, 0])  # (the first before the wait) a worker connected at the third look: counted anew
    with pytest.raises(NoProducers):
        B.Batches(back, 3, None, bus=bus).next(False)
    assert back.calls == 35
    forever = Alone([])
    t = make_batch(3)
    forever.arrivals = [[]] * 60 + [t]
    assert B.Batches(forever, 3, None, bus=BusConfig(producer_wait_s=0.0)).next(False) == t

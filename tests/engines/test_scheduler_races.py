"""The engine scheduler under commands that arrive while a forward pass runs (abort, retract pause): only the
named requests are affected, the others keep generating."""

from __future__ import annotations

import threading

import torch

from megatron_sao.engines.embedded.model_runner import SamplingParams
from megatron_sao.engines.embedded.scheduler import Request, Scheduler

VOCAB = 16


class GatedRunner:
    """Stands in for ModelRunner: logits favour token (last input + 1); a prefill can be held at a gate."""

    def __init__(self) -> None:
        self.hold_prefill = threading.Event()
        self.in_prefill = threading.Event()
        self.release = threading.Event()
        self.slotless_calls = 0  # forwards over a request that had lost its KV slot (aborted / retracted)

    def forward(self, cache, slots, lengths, ids):
        if not all(isinstance(slot, int) for slot in slots):  # the real KV cache indexes by slot
            self.slotless_calls += 1
            raise TypeError(f"forward over a request without a KV slot: {slots}")
        if self.hold_prefill.is_set() and ids.shape[1] > 1:  # a prefill (several tokens at once)
            self.in_prefill.set()
            assert self.release.wait(10)
        logits = torch.full((ids.shape[0], VOCAB), -10.0)
        logits[torch.arange(ids.shape[0]), (ids[:, -1] + 1) % VOCAB] = 10.0
        return logits


def _scheduler(runner: GatedRunner, context_len: int = 64) -> Scheduler:
    s = Scheduler(runner, updater=None, max_running=4, context_len=context_len, eos_ids=(), weight_version="0")
    s.start()
    return s


def _request(rid: str, first: int, n: int = 30) -> Request:
    return Request(rid, [first, first], SamplingParams(max_new_tokens=n, temperature=0.0))


def test_abort_during_another_requests_prefill_touches_only_the_aborted_one():
    runner = GatedRunner()
    sched = _scheduler(runner, context_len=1 << 20)  # a must still be decoding when the test thread gets to run
    try:
        a = _request("a", 1, n=1 << 19)
        sched.submit(a)
        while len(a.output_ids) < 3:  # a is decoding
            pass
        runner.hold_prefill.set()
        b = _request("b", 5, n=10)
        sched.submit(b)
        assert runner.in_prefill.wait(10)  # the scheduler is inside b's prefill, a is in the decode snapshot
        assert sched.abort("a") == 1
        runner.release.set()
        assert b.done.wait(10) and a.done.wait(10)
        assert a.finish_reason["type"] == "abort" and "abort_request" in a.finish_reason["message"]
        assert b.finish_reason == {"type": "length", "length": 10}
        assert b.output_ids == [(5 + i + 1) % VOCAB for i in range(10)]
        assert runner.slotless_calls == 0
    finally:
        runner.release.set()
        sched.stop()


def test_retract_during_a_prefill_requeues_instead_of_aborting():
    runner = GatedRunner()
    sched = _scheduler(runner)
    try:
        a = _request("a", 1, n=40)
        sched.submit(a)
        while len(a.output_ids) < 3:
            pass
        runner.hold_prefill.set()
        b = _request("b", 5, n=10)
        sched.submit(b)
        assert runner.in_prefill.wait(10)
        pauser = threading.Thread(target=sched.pause, args=("retract",))
        pauser.start()
        runner.hold_prefill.clear()
        runner.release.set()
        pauser.join(10)
        sched.resume()
        assert a.done.wait(10) and b.done.wait(10)
        assert a.finish_reason == {"type": "length", "length": 40}
        assert a.output_ids == [(1 + i + 1) % VOCAB for i in range(40)]  # recomputed, same tokens
        assert b.finish_reason == {"type": "length", "length": 10}
        assert runner.slotless_calls == 0
    finally:
        runner.release.set()
        sched.stop()


def test_the_engine_counts_the_time_a_push_stopped_it_for():
    """load()'s boundary_s: time spent in calls run at a token boundary (a push's commit); paused_s: time between
    /pause_generation and /continue_generation (a call run while paused counts there, not twice). Neither counts
    decoding."""
    import time

    runner = GatedRunner()
    sched = _scheduler(runner)
    try:
        before = sched.load()
        assert before["boundary_s"] == 0.0 and before["paused_s"] == 0.0
        sched.at_boundary(lambda: time.sleep(0.2))
        assert 0.2 <= sched.load()["boundary_s"] < 5.0
        sched.pause("in_place")
        time.sleep(0.2)
        assert sched.load()["paused_s"] >= 0.2  # counted while still paused
        boundary = sched.load()["boundary_s"]
        sched.at_boundary(lambda: time.sleep(0.2))  # a commit while paused: counted once, in paused_s
        assert sched.load()["boundary_s"] == boundary and sched.load()["paused_s"] >= 0.4
        sched.resume()
        paused = sched.load()["paused_s"]
        time.sleep(0.1)
        assert sched.load()["paused_s"] == paused  # not after the continue
    finally:
        sched.stop()

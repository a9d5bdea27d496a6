"""The one order of a push across stages (weight_sync/sender.py PushOrder), over a real TCPStore shared by threads as
the stage sources share the learner's store: round by round over the stages; a bucket goes only once the one before
it landed; a failure stops the stages after it at once; a waiting source never blocks its own publisher."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from megatron_sao.distributed.spawn import find_free_port
from megatron_sao.weight_sync.sender import PushOrder, WeightSyncError


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", find_free_port(), 1, is_master=True, wait_for_workers=False)


def test_the_order_is_round_by_round_and_a_bucket_waits_for_the_one_before() -> None:
    store = _store()
    first, second = PushOrder([3, 1], 0, 1, 10.0, store=store), PushOrder([3, 1], 1, 1, 10.0, store=store)
    assert first.sequence == [(0, 0), (1, 0), (0, 1), (0, 2)]
    first.wait_turn(0)  # the first bucket of the push never waits
    went: list[str] = []
    waiter = threading.Thread(target=lambda: (second.wait_turn(0), went.append("1/0")))
    waiter.start()
    time.sleep(0.3)
    assert not went, "stage 1's first bucket went before stage 0's first landed"
    first.publish(0, "landed")  # from another thread while the waiter polls the same store: no deadlock
    waiter.join(10)
    assert went == ["1/0"]
    second.publish(0, "landed")
    first.wait_turn(1)
    first.publish(1, "landed")
    first.wait_turn(2)  # stage 1 has no bucket 1: stage 0's bucket 2 follows its bucket 1


def test_a_failed_bucket_stops_the_ones_after_it_and_finish_publishes_the_rest() -> None:
    store = _store()
    first, second = PushOrder([2, 2], 0, 7, 10.0, store=store), PushOrder([2, 2], 1, 7, 10.0, store=store)
    first.publish(0, "landed")
    second.wait_turn(0)
    second.publish(0, "failed: engine refused")
    with pytest.raises(WeightSyncError, match="before it in the push order failed: failed: engine refused"):
        first.wait_turn(1)
    first.finish("stage 0 stopped")  # its bucket 1 is published failed: stage 1's bucket 1 does not wait it out
    with pytest.raises(WeightSyncError, match="stage 0 stopped"):
        second.wait_turn(1)
    first.cleanup()
    second.cleanup()
    assert not store.check(["weight_sync/order/7/0/0"])


def test_a_bucket_before_that_never_lands_times_out_naming_it() -> None:
    late = PushOrder([1, 1], 1, 1, 0.3, store=_store())
    with pytest.raises(WeightSyncError, match="bucket 0/0 .* did not land within 0s"):
        late.wait_turn(0)


def test_one_stage_needs_no_store() -> None:
    alone = PushOrder([5], 0, 1, 10.0)
    assert alone.store is None
    alone.wait_turn(3)
    alone.publish(3, "landed")
    alone.finish(None)


def test_a_bucket_lands_for_the_order_only_once_every_engine_answered() -> None:
    """The source's broadcast completes once its bytes left (a small bucket before any engine joined it), and with
    more than two receivers gloo's and NCCL's broadcasts forward through them: were the next stage's bucket announced
    then, an engine could take it first and wait on a peer still forwarding this one, which waits on it. So the
    order hears "landed" only when every engine answered for the bucket."""
    from types import SimpleNamespace

    from megatron_sao.weight_sync.sender import _PendingSend

    store = _store()
    order, after = PushOrder([1, 1], 0, 3, 10.0, store=store), PushOrder([1, 1], 1, 3, 10.0, store=store)
    answered = threading.Event()
    answers: dict[str, object] = {}
    engine = threading.Thread(target=lambda: (answered.wait(10), answers.update({"http://e": {"success": True}})))
    engine.start()
    done = SimpleNamespace(is_completed=lambda: True, wait=lambda: None)  # the source's broadcast: completed
    sender = SimpleNamespace(stage=0, clients={"http://e": None}, broken=False, meter=None, recycle=lambda b: None,
                             spec=SimpleNamespace(bucket_timeout_s=10.0))  # fmt: skip
    pending = _PendingSend(sender, SimpleNamespace(index=0, slots=[]), [engine], answers, [done],  # type: ignore[arg-type]
                           time.monotonic() + 10.0)  # fmt: skip
    publisher = threading.Thread(target=pending.publish_landing, args=(order,))
    publisher.start()
    time.sleep(0.3)
    assert not store.check(["weight_sync/order/3/0/0"]), "landed before the engine answered"
    answered.set()
    publisher.join(10)
    after.wait_turn(0)  # the next stage's bucket goes now

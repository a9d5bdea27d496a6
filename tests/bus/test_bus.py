"""Sender -> receiver in one process: delivery, back-pressure, commits, restarts of either side, limits."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import msgspec
import pytest

from megatron_sao.bus import Trajectory, TrajectoryReceiver, TrajectorySender
from megatron_sao.config.bus import BusConfig
from tests.bus.helpers import fast_cfg, free_addr, traj, wait_for


def _drain(r: TrajectoryReceiver, n: int, timeout_s: float = 20.0) -> list[str]:
    got = r.recv_batch(n, timeout_s=timeout_s)
    return [t.trajectory_id for t in got]


def test_many_producers_every_id_exactly_once() -> None:
    cfg = fast_cfg(free_addr(), max_inflight=4, recv_queue_size=8)
    with TrajectoryReceiver(cfg) as r:
        senders = [TrajectorySender(cfg, f"p{i}") for i in range(3)]
        threads = [
            threading.Thread(target=lambda s=s, i=i: [s.send(traj(k, worker=f"p{i}"), timeout_s=20) for k in range(60)])
            for i, s in enumerate(senders)
        ]
        for t in threads:
            t.start()
        ids = _drain(r, 180)
        for t in threads:
            t.join(20)
        r.commit()
        assert all(s.flush(10) for s in senders)
        for s in senders:
            s.close()
        assert Counter(ids) == Counter(f"p{i}-{k}" for i in range(3) for k in range(60))
        m = r.metrics()
        assert m["accepted"] == 180 and m["duplicates"] == 0 and m["rejected"] == 0


def test_slow_learner_blocks_producers_and_bounds_memory() -> None:
    cfg = fast_cfg(free_addr(), max_inflight=3, recv_queue_size=4)
    with TrajectoryReceiver(cfg) as r, TrajectorySender(cfg, "p") as s:
        sent = 0
        with pytest.raises(TimeoutError, match="credits"):
            for k in range(50):
                s.send(traj(k, 256), timeout_s=0.5)
                sent += 1
        # sender: max_inflight waiting + max_inflight on the wire; receiver: its queue never exceeds its credits
        assert sent <= 2 * 3
        wait_for(lambda: r.metrics()["queued"] == 3, what="three queued")
        time.sleep(0.2)
        assert r.metrics()["queued"] == 3  # no more than the credits it granted
        assert len(_drain(r, sent)) == sent
        s.send(traj(99), timeout_s=5)  # room again
        assert _drain(r, 1) == ["w-99"]


def test_flush_waits_for_commit_and_commit_covers_the_last_state_dict() -> None:
    cfg = fast_cfg(free_addr())
    with TrajectoryReceiver(cfg) as r, TrajectorySender(cfg, "p") as s:
        for k in range(4):
            s.send(traj(k), timeout_s=5)
        assert len(_drain(r, 2)) == 2
        r.state_dict()  # the "checkpoint" covers the first two
        assert len(_drain(r, 2)) == 2
        assert not s.flush(0.3)  # received is not committed
        r.commit()
        wait_for(lambda: s.metrics()["uncommitted"] == 2, what="first two committed")
        assert s.pending_ids() == ["w-2", "w-3"]
        r.commit()  # no state_dict since: commits everything returned so far
        assert s.flush(5)


def test_receiver_restart_from_checkpoint_redelivers_exactly_the_uncheckpointed() -> None:
    addr = free_addr()
    cfg = fast_cfg(addr)
    s = TrajectorySender(cfg, "p")
    for k in range(10):
        s.send(traj(k), timeout_s=5)
    r1 = TrajectoryReceiver(cfg)
    trained = _drain(r1, 4)
    ckpt = msgspec.json.decode(msgspec.json.encode(r1.state_dict()))  # saved with the learner checkpoint
    r1.commit()
    _drain(r1, 3)  # consumed, never checkpointed: the learner "crashes" now
    r1.close()
    r2 = TrajectoryReceiver(cfg, state=ckpt)
    trained += _drain(r2, 6)
    assert r2.recv(timeout_s=0.5) is None
    r2.commit()
    assert s.flush(5)
    s.close()
    r2.close()
    assert sorted(trained) == sorted(f"w-{k}" for k in range(10))
    assert s.metrics()["receiver_restarts"] >= 1


def test_sender_restart_resumes_its_spool(tmp_path) -> None:
    cfg = fast_cfg(free_addr(), spool_dir=str(tmp_path))
    s1 = TrajectorySender(cfg, "p")
    for k in range(6):
        s1.send(traj(k), timeout_s=5)
    s1.close()  # before any receiver: everything stays spooled
    with TrajectoryReceiver(cfg) as r:
        s2 = TrajectorySender(cfg, "p")
        assert s2.pending_ids() == [f"w-{k}" for k in range(6)]
        s2.send(traj(2), timeout_s=5)  # still pending: idempotent
        s2.send(traj(6), timeout_s=5)
        ids = _drain(r, 7)
        r.commit()
        assert s2.flush(5)
        assert r.recv(timeout_s=0.3) is None
        s2.close()
    assert sorted(ids) == [f"w-{k}" for k in range(7)]
    assert not list((tmp_path / "p").glob("*.traj"))  # committed -> unspooled


def test_an_id_sent_again_under_a_new_seq_is_dropped_as_duplicate() -> None:
    cfg = fast_cfg(free_addr())
    with TrajectoryReceiver(cfg) as r, TrajectorySender(cfg, "p") as s:
        s.send(traj(0), timeout_s=5)
        assert _drain(r, 1) == ["w-0"]
        r.commit()
        assert s.flush(5)
        s.send(traj(0), timeout_s=5)  # committed and forgotten by the sender, so it goes out again
        s.send(traj(1), timeout_s=5)
        assert _drain(r, 1) == ["w-1"]
        r.commit()
        assert s.flush(5)  # the duplicate was handled (committed), not lost in limbo
        assert r.metrics()["duplicates_by_id"] == 1


def test_stale_trajectories_are_dropped_recorded_and_still_committed(tmp_path) -> None:
    cfg = fast_cfg(free_addr(), max_staleness=2, stale_log_dir=str(tmp_path))
    with TrajectoryReceiver(cfg, current_version=lambda: 10) as r, TrajectorySender(cfg, "p") as s:
        for k, v in enumerate((10, 5, 8, 1)):
            s.send(traj(k, version=v), timeout_s=5)
        got = r.recv_batch(2, timeout_s=5)
        assert r.recv(timeout_s=0.3) is None
        assert [t.trajectory_id for t in got] == ["w-0", "w-2"]
        assert r.stale_ids() == ["w-1", "w-3"]
        assert r.metrics()["stale_dropped"] == 2
        r.commit()
        assert s.flush(5)
    lines = [json.loads(x) for x in (tmp_path / "stale.jsonl").read_text().splitlines()]
    assert [x["trajectory_id"] for x in lines] == ["w-1", "w-3"]
    sent = {t.trajectory_id: t for t in (traj(1, version=5), traj(3, version=1))}
    for x in lines:  # what was dropped, comparable with what was trained
        h = sent[x["trajectory_id"]].header
        assert (x["reward"], x["turns"], x["tokens"], x["finish_reason"], x["metadata"]) == (
            h.reward, len(h.turns), h.num_tokens, h.finish_reason, dict(h.metadata))  # fmt: skip
        assert x["action_tokens"] == int(sent[x["trajectory_id"]].action_mask.sum())


def test_malformed_or_oversized_trajectories_fail_at_send() -> None:
    cfg = fast_cfg(free_addr(), max_frame_bytes=4096, max_message_bytes=16384, max_header_bytes=4096)
    with TrajectorySender(cfg, "p") as s:
        with pytest.raises(ValueError, match="over the bus limits"):
            s.send(traj(0, 2048), timeout_s=1)
        t = traj(1)
        short = Trajectory(t.header, t.tokens[:-1], t.rollout_logprobs, t.action_mask, t.weight_versions)
        with pytest.raises(ValueError, match="tokens: length"):
            s.send(short, timeout_s=1)
    with TrajectorySender(fast_cfg(free_addr(), validate_on_send=True), "p") as s:
        bad = traj(2)
        bad.rollout_logprobs[-1] = float("nan")
        with pytest.raises(ValueError, match="rollout_logprobs"):
            s.send(bad, timeout_s=1)


def test_invalid_values_are_refused_by_the_receiver_and_reported_to_the_producer() -> None:
    cfg = fast_cfg(free_addr())
    with TrajectoryReceiver(cfg) as r, TrajectorySender(cfg, "p") as s:
        bad = traj(0)
        bad.rollout_logprobs[-1] = float("nan")
        s.send(bad, timeout_s=5)  # validate_on_send is off: the learner's check is the one that counts
        s.send(traj(1), timeout_s=5)
        assert _drain(r, 1) == ["w-1"]
        wait_for(lambda: s.rejected(), what="reject")
        assert s.rejected()[0][:2] == ("w-0", "invalid")
        assert r.metrics()["rejected_invalid"] == 1
        r.commit()
        assert s.flush(5)


def test_receiver_refusal_reaches_the_producer_and_is_not_retried() -> None:
    addr = free_addr()
    with TrajectoryReceiver(fast_cfg(addr, max_frame_bytes=4096, max_message_bytes=65536, max_header_bytes=4096)) as r:
        with TrajectorySender(fast_cfg(addr), "p") as s:  # a producer with larger limits than the learner
            s.send(traj(0, 4096), timeout_s=5)
            s.send(traj(1, 16), timeout_s=5)
            assert _drain(r, 1) == ["w-1"]
            wait_for(lambda: s.rejected(), what="reject")
            assert s.rejected()[0][:2] == ("w-0", "frame_too_large")
            r.commit()
            assert s.flush(5)
        assert r.metrics()["rejected_frame_too_large"] == 1


def test_config_checks_addresses_limits_and_key_pairs() -> None:
    assert BusConfig(bind="tcp://0.0.0.0:5555").binds_every_interface  # allowed, warned about without CURVE
    assert not BusConfig().binds_every_interface  # the default is loopback
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        BusConfig(bind="127.0.0.1:5555")
    with pytest.raises(ValueError, match="go together"):
        BusConfig(curve_server_key="k")
    with pytest.raises(ValueError, match="go together"):
        BusConfig(curve_client_key="k")
    with pytest.raises(ValueError, match="max_frame_bytes"):
        BusConfig(max_frame_bytes=2 << 30)
    with pytest.raises(ValueError, match="peer_timeout_s"):
        BusConfig(heartbeat_s=5.0, peer_timeout_s=6.0)


def test_binding_a_taken_address_is_a_clear_error() -> None:
    cfg = fast_cfg(free_addr())
    with TrajectoryReceiver(cfg), pytest.raises(ValueError, match="cannot bind"):
        TrajectoryReceiver(cfg)


def test_received_but_uncommitted_trajectories_are_not_resent_on_a_timer() -> None:
    cfg = fast_cfg(free_addr(), resend_after_s=0.3)
    with TrajectoryReceiver(cfg) as r, TrajectorySender(cfg, "p") as s:
        for k in range(3):
            s.send(traj(k), timeout_s=5)
        assert len(_drain(r, 3)) == 3
        time.sleep(1.0)  # the learner trains, no checkpoint yet
        m = s.metrics()
        assert m.get("resend_timeouts", 0) == 0 and m["resent"] == 0 and m["uncommitted"] == 3
        assert r.recv(timeout_s=0.1) is None


def test_uncommitted_window_blocks_until_the_learner_commits() -> None:
    cfg = fast_cfg(free_addr(), max_uncommitted=4)
    with TrajectoryReceiver(cfg) as r, TrajectorySender(cfg, "p") as s:
        for k in range(4):
            s.send(traj(k), timeout_s=5)
        assert len(_drain(r, 4)) == 4
        with pytest.raises(TimeoutError, match="commit"):
            s.send(traj(4), timeout_s=0.3)
        r.commit()
        s.send(traj(4), timeout_s=5)
        assert _drain(r, 1) == ["w-4"]


def test_settled_streams_are_forgotten_so_the_state_stays_bounded() -> None:
    cfg = fast_cfg(free_addr(), max_streams=1)
    with TrajectoryReceiver(cfg) as r:
        for w in ("a", "b", "c"):  # three producer incarnations without a spool: three streams
            with TrajectorySender(cfg, w) as s:
                s.send(traj(0, worker=w), timeout_s=5)
                assert _drain(r, 1) == [f"{w}-0"]
                r.commit()
                assert s.flush(5)
            wait_for(lambda: r.metrics()["sessions"] == 0, what="bye")  # its Bye says it holds nothing
        r.commit()
        m = r.metrics()
        assert m["streams"] == 1 and m["streams_forgotten"] == 2
        assert [k.split("#")[0] for k in r.state_dict()["streams"]] == ["c"]


def test_spool_restart_with_a_small_window_loses_nothing(tmp_path) -> None:
    """The receiver takes seq only inside [base, base + max_uncommitted); after a restart the spool resumes past its
    reservation, so the sender must keep new sequence numbers inside that window (it used to get them refused)."""
    cfg = fast_cfg(free_addr(), spool_dir=str(tmp_path), max_uncommitted=8)
    got: set[str] = set()
    with TrajectoryReceiver(cfg) as r:
        s = TrajectorySender(cfg, "w")
        for i in range(3):
            s.send(traj(i), timeout_s=5)
        s.close(timeout_s=0.5)  # nothing committed: all three stay in the spool
        s = TrajectorySender(cfg, "w")
        for i in range(3, 12):
            s.send(traj(i), timeout_s=10)  # blocks while the window is full, until the learner commits
            got |= {t.trajectory_id for t in r.recv_batch(8, timeout_s=0.2)}
            r.commit()
        deadline = time.monotonic() + 10
        while len(got) < 12 and time.monotonic() < deadline:
            got |= {t.trajectory_id for t in r.recv_batch(12, timeout_s=0.2)}
            r.commit()
        assert s.rejected() == [] and r.metrics()["rejected"] == 0
        s.close()
    assert got == {f"w-{i}" for i in range(12)}


def test_send_reports_a_dead_io_thread_instead_of_hanging(monkeypatch) -> None:
    from megatron_sao.bus import sender_io

    def broken_loop(self, *sockets) -> None:
        raise OSError("simulated socket failure")

    monkeypatch.setattr(sender_io.SenderIO, "loop", broken_loop)
    s = TrajectorySender(fast_cfg(free_addr()), "w")
    wait_for(lambda: s._outbox.error is not None, what="the I/O thread's failure")
    done = threading.Event()
    errors: list[BaseException] = []

    def send() -> None:
        try:
            s.send(traj(0), timeout_s=2)
        except RuntimeError as e:
            errors.append(e)
        done.set()

    threading.Thread(target=send, daemon=True).start()
    try:
        assert done.wait(5), "send() hung after the I/O thread died"
        assert errors and "I/O thread failed" in str(errors[0])
    finally:
        s.close()  # a dead I/O thread must not stop close(); an unclosed context would hang at GC


def test_a_late_commit_keeps_a_checkpoint_back_so_a_fallback_trains_it_again() -> None:
    """commit(keep=1), as the learner loop does (learner.fallback_checkpoints): producers hold everything since the
    checkpoint before the newest; a receiver resumed from that older checkpoint gets the newer steps' trajectories
    again and takes them (they are not in its de-dup state)."""
    cfg = fast_cfg(free_addr())
    s = TrajectorySender(cfg, "p")
    for k in range(6):
        s.send(traj(k), timeout_s=5)
    r1 = TrajectoryReceiver(cfg)
    first = _drain(r1, 2)
    older = msgspec.json.decode(msgspec.json.encode(r1.state_dict()))  # checkpoint A covers w-0, w-1
    r1.commit(keep=1)  # no checkpoint before A: nothing committed yet
    time.sleep(0.3)
    assert s.metrics()["uncommitted"] == 6
    abandoned = _drain(r1, 2)
    r1.state_dict()  # checkpoint B covers w-0..w-3
    r1.commit(keep=1)  # commits A only
    wait_for(lambda: s.metrics()["uncommitted"] == 4, what="A committed")
    assert s.pending_ids() == ["w-2", "w-3", "w-4", "w-5"]
    r1.close()
    r2 = TrajectoryReceiver(cfg, state=older)  # B is damaged: the learner resumes from A
    again = _drain(r2, 4)
    assert r2.recv(timeout_s=0.5) is None
    assert sorted(again) == sorted([*abandoned, "w-4", "w-5"]) and not set(first) & set(again)
    r2.close()
    s.close()

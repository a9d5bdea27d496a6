"""Hostile input: random, truncated, re-versioned and oversized frames are refused and counted; the receiver keeps
serving valid producers, and its memory stays bounded under a flood."""

from __future__ import annotations

import gc

import msgspec
import psutil
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_sao.bus import TrajectoryReceiver, TrajectorySender, codec
from megatron_sao.bus.schema import SCHEMA_VERSION
from tests.bus.helpers import fast_cfg, free_addr, traj, wait_for
from tests.bus.rawclient import RawClient

LIMITS = {"max_frame_bytes": 64 << 10, "max_message_bytes": 256 << 10, "max_header_bytes": 8 << 10}
QUIET_OK = {"peer_timeout_s": 120.0}
"""For a raw client that never pings: with fast_cfg's 1 s peer timeout, a stall of a second between two hypothesis
examples (a loaded CI machine) expired its session and every later send waited for credit in vain (the test ran 600 s).
It says Bye when done, which frees its credit for the producers after it."""
VALID = [bytes(f) for f in codec.encode(traj("fuzz-template", 200))]


@st.composite
def hostile_payloads(draw: st.DrawFn) -> list[bytes]:
    """Payload frames (after the envelope): garbage, or the valid template broken in one way."""
    kind = draw(st.sampled_from(["random", "truncate", "drop", "extra", "version", "oversize", "flip"]))
    frames = list(VALID)
    if kind == "random":
        return draw(st.lists(st.binary(max_size=512), max_size=8))
    i = draw(st.integers(0, len(frames) - 1))
    if kind == "truncate":
        frames[i] = frames[i][: draw(st.integers(0, max(0, len(frames[i]) - 1)))]
    elif kind == "drop":
        del frames[i]
    elif kind == "extra":
        frames.insert(i, draw(st.binary(max_size=64)))
    elif kind == "version":
        header = msgspec.msgpack.decode(frames[0])
        header["schema_version"] = draw(st.integers(-5, 50).filter(lambda v: v != SCHEMA_VERSION))
        frames[0] = msgspec.msgpack.encode(header)
    elif kind == "oversize":
        frames[i] = bytes(draw(st.integers((64 << 10) + 1, 200 << 10)))
    else:  # flip bytes of the header (may still decode, then must still validate or be refused)
        head = bytearray(frames[0])
        for pos in draw(st.lists(st.integers(0, len(head) - 1), min_size=1, max_size=4)):
            head[pos] ^= 0xFF
        frames[0] = bytes(head)
    return frames


def test_hostile_frames_are_refused_counted_and_valid_traffic_still_flows() -> None:
    cfg = fast_cfg(free_addr(), max_inflight=64, recv_queue_size=64, **LIMITS, **QUIET_OK)
    with TrajectoryReceiver(cfg) as r:
        raw = RawClient(cfg.bind)
        sent = {"n": 0}

        @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(payload=hostile_payloads(), garbage_envelope=st.booleans())
        def send_one(payload: list[bytes], garbage_envelope: bool) -> None:
            envelope = b"\x93\xff" if garbage_envelope else raw.data_envelope()
            raw.send_raw([envelope, *payload], with_credit=not garbage_envelope)
            sent["n"] += 1

        send_one()
        raw.send_raw([b""])  # empty envelope, too
        sent["n"] += 1

        def outcomes() -> float:
            m = r.metrics()
            return m["rejected"] + m["received"]

        wait_for(lambda: outcomes() == sent["n"], what="every hostile message accounted for")
        for t in r.recv_batch(1000, timeout_s=0.2):  # whatever survived must be a valid trajectory
            t.validate()
        m = r.metrics()
        assert m["rejected"] >= sent["n"] - m["received"] > 0
        for reason in ("malformed", "frame_count", "array_size", "schema_version", "frame_too_large"):
            assert m[f"rejected_{reason}"] > 0, reason
        raw.bye()
        with TrajectorySender(cfg, "honest") as s:
            for k in range(5):
                s.send(traj(k, worker="honest"), timeout_s=5)
            assert sorted(t.trajectory_id for t in r.recv_batch(5, timeout_s=10)) == [f"honest-{k}" for k in range(5)]
        raw.close()


def test_frame_over_the_hard_limit_drops_the_connection_not_the_receiver() -> None:
    cfg = fast_cfg(free_addr(), **LIMITS)
    with TrajectoryReceiver(cfg) as r:
        raw = RawClient(cfg.bind)
        raw.send_raw([raw.data_envelope(), bytes((256 << 10) + 1)])  # libzmq refuses it before allocating
        wait_for(lambda: r.metrics().get("disconnects", 0) >= 1, what="peer disconnected")
        assert r.metrics()["received"] == 0
        with TrajectorySender(cfg, "honest") as s:
            s.send(traj(0, worker="honest"), timeout_s=5)
            assert r.recv(timeout_s=10) is not None
        raw.close()


def test_memory_stays_bounded_under_a_flood() -> None:
    cfg = fast_cfg(free_addr(), max_inflight=16, recv_queue_size=16, **LIMITS)
    big = [bytes(f) for f in codec.encode(traj("flood", 4096))]  # ~53 KB, valid
    with TrajectoryReceiver(cfg) as r:
        raw = RawClient(cfg.bind)
        proc = psutil.Process()

        def flood(n: int) -> None:
            for i in range(n):
                broken = [big[0], big[1][:-4], *big[2:]] if i % 2 else [b"\xc1" * 40_000, *big[1:]]
                raw.send_raw([raw.data_envelope(), *broken], with_credit=False)  # credit-less, then refused
                raw.send_raw([raw.data_envelope(), *big], with_credit=False)  # valid, beyond credits
                if i % 64 == 0:
                    raw.pump()

        flood(200)
        handled = 400
        wait_for(lambda: r.metrics()["rejected"] + r.metrics()["received"] >= handled, what="warm-up flood handled")
        rss = []
        for _ in range(4):  # ~100 MB of frames per round: a leak of whole messages shows as growth per round
            flood(1000)
            handled += 2000
            wait_for(lambda h=handled: r.metrics()["rejected"] + r.metrics()["received"] >= h, timeout_s=60,
                     what="flood")  # fmt: skip
            gc.collect()
            rss.append(proc.memory_info().rss)
        m = r.metrics()
        assert m["queued"] <= 16, m  # never more than the credits it granted
        assert m["rejected_no_credit"] > 0
        grown = [(x - rss[0]) / 2**20 for x in rss]
        # after the first round (allocator pools warm) ~300 MB more flow through: RSS moves by allocator noise
        # (seen: +-35 MB), while keeping even a sixth of the refused messages would add > 50 MB
        assert max(grown) < 64, f"RSS after each flood round, relative to the first: {grown} MB"
        raw.close()

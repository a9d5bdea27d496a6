"""De-dup state: exactly-once by (stream, seq) and by id, bounded over millions of trajectories, checkpointable."""

from __future__ import annotations

import json
import random

import pytest

from megatron_sao.bus.dedup import DedupState, StreamState


def test_out_of_order_seqs_fold_into_the_watermark() -> None:
    st = StreamState()
    for seq in (2, 0, 3, 1, 5):
        assert not st.seen(seq)
        st.add(seq)
    assert (st.low, st.above) == (4, {5})
    assert all(st.seen(s) for s in (0, 1, 2, 3, 5)) and not st.seen(4)


def test_base_drops_seqs_the_producer_will_never_send() -> None:
    st = StreamState(low=0, above={5, 9})
    st.advance(5)  # 0..4 committed or abandoned on the producer side
    assert (st.low, st.above) == (6, {9})


def test_duplicates_by_seq_and_by_id_are_caught() -> None:
    d = DedupState(recent_ids=100, max_streams=10)
    assert d.check_and_add("w#e", 0, 0, "a") == "new"
    assert d.check_and_add("w#e", 0, 0, "a") == "duplicate_seq"
    assert d.check_and_add("w#e", 1, 0, "a") == "duplicate_id"  # same id re-sent under a new seq
    assert d.check_and_add("w#e", 1, 0, "a") == "duplicate_seq"  # and that seq is handled now
    assert d.check_and_add("w#f", 0, 0, "b") == "new"  # another stream


def test_state_is_bounded_over_a_million_in_order_trajectories() -> None:
    d = DedupState(recent_ids=1000, max_streams=10)
    rng = random.Random(0)
    seqs = list(range(1_000_000))
    for start in range(0, len(seqs), 64):  # shuffled within windows, as a resend after reconnect would
        window = seqs[start : start + 64]
        rng.shuffle(window)
        seqs[start : start + 64] = window
    for seq in seqs:
        assert d.check_and_add("w#e", seq, max(0, seq - 128), f"id{seq}") == "new"
    state = d.state_dict()
    assert state["streams"]["w#e"] == [1_000_000, []]
    assert len(state["recent_ids"]) == 1000
    assert len(json.dumps(state)) < 50_000


def test_state_dict_round_trips_through_json() -> None:
    d = DedupState(recent_ids=10, max_streams=10)
    for seq in (0, 1, 3):
        d.check_and_add("w#e", seq, 0, f"t{seq}")
    restored = DedupState(recent_ids=10, max_streams=10)
    restored.load_state_dict(json.loads(json.dumps(d.state_dict())))
    assert restored.check_and_add("w#e", 3, 0, "t3") == "duplicate_seq"
    assert restored.check_and_add("w#e", 2, 0, "t1") == "duplicate_id"
    assert restored.check_and_add("w#e", 4, 0, "t4") == "new"


def test_load_refuses_foreign_state_with_a_fix() -> None:
    with pytest.raises(ValueError, match="state_dict"):
        DedupState(10, 10).load_state_dict({"format": 99})
    with pytest.raises(ValueError, match="corrupt"):
        DedupState(10, 10).load_state_dict({"format": 1, "streams": {"w#e": 5}, "recent_ids": []})


def test_only_settled_streams_are_forgotten() -> None:
    d = DedupState(recent_ids=0, max_streams=2)
    for key in ("a#1", "b#1", "c#1"):
        d.check_and_add(key, 0, 0, key)
    d.check_and_add("c#1", 2, 0, "c2")  # c has a gap: not settled
    # a: producer's base 1 == low (settled, nothing it still holds); b: producer never said -> kept
    assert d.prune({"a#1": 1, "c#1": 1}) == ["a#1"]
    assert list(d.streams) == ["b#1", "c#1"]
    # a forgotten stream re-created from the producer's base describes the same consumed set
    assert d.check_and_add("a#1", 0, 1, "a-again") == "duplicate_seq"

"""Credit pool: bounded receiver memory, per-session cap, fair round-robin, reclaim on close/expiry."""

from __future__ import annotations

from megatron_sao.bus.credits import CreditBook


def test_grants_never_exceed_the_pool_or_the_per_session_cap() -> None:
    book = CreditBook(slots=10, per_session=4)
    sessions = [book.open(bytes([i]), f"s{i}#e", f"s{i}", demand=100, now=0.0) for i in range(3)]
    book.allocate(True)
    assert [s.granted for s in sessions] == [4, 4, 2]
    assert book.outstanding == 10
    # s0 uses its credits; its trajectories hold their slots (and its per-session cap) while queued
    for _ in range(4):
        assert book.on_data(sessions[0])
        book.enqueued(sessions[0])
    assert book.allocate(True) == []  # pool exhausted: 4 queued + 6 outstanding
    book.freed([b"\x00"] * 4)  # the learner took them: 4 slots for s0 (4 short of its cap) and s2 (2 short)
    book.allocate(True)
    assert [s.granted for s in sessions] == [6, 4, 4]
    assert book.outstanding + book.slots_used == 10


def test_a_session_never_holds_more_than_max_inflight_queued_or_granted() -> None:
    book = CreditBook(slots=100, per_session=3)
    s = book.open(b"a", "a#e", "a", demand=100, now=0.0)
    for _ in range(5):
        book.allocate(True)
        while s.outstanding:
            assert book.on_data(s)
            book.enqueued(s)
        assert s.queued + s.outstanding <= 3
    assert s.granted == 3  # the learner took nothing, so nothing more was granted
    book.freed([b"a"])
    book.allocate(True)
    assert s.granted == 4


def test_no_credit_without_demand_and_none_while_memory_is_over_budget() -> None:
    book = CreditBook(slots=10, per_session=4)
    s = book.open(b"a", "a#e", "a", demand=1, now=0.0)
    assert book.allocate(False) == []
    book.allocate(True)
    assert s.granted == 1
    book.update_demand(s, 3)
    book.allocate(True)
    assert s.granted == 3


def test_data_beyond_credit_is_refused() -> None:
    book = CreditBook(slots=10, per_session=4)
    s = book.open(b"a", "a#e", "a", demand=1, now=0.0)
    book.allocate(True)
    assert book.on_data(s)
    assert not book.on_data(s)


def test_closed_and_expired_sessions_return_their_credits() -> None:
    book = CreditBook(slots=4, per_session=4)
    a = book.open(b"a", "a#e", "a", demand=10, now=0.0)
    book.allocate(True)
    assert a.granted == 4
    b = book.open(b"b", "b#e", "b", demand=10, now=5.0)
    assert book.allocate(True) == []
    assert book.expire(now=6.0, timeout_s=2.0) == [a]
    book.allocate(True)
    assert b.granted == 4
    # a reconnect (new routing id, same stream) replaces the old session
    b2 = book.open(b"b2", "b#e", "b", demand=10, now=6.0)
    assert b"b" not in book.sessions and book.by_stream["b#e"] == b"b2"
    book.allocate(True)
    assert b2.granted == 4


def test_outstanding_count_matches_the_sessions() -> None:
    book = CreditBook(slots=50, per_session=7)
    sessions = [book.open(bytes([i]), f"s{i}#e", f"s{i}", demand=20, now=0.0) for i in range(5)]
    book.allocate(True)
    for s in sessions[:3]:
        for _ in range(4):
            book.on_data(s)
    book.on_data(sessions[0])  # more than granted later on is counted in `received` only
    book.close(sessions[4].rid)
    assert book.outstanding == sum(s.outstanding for s in book.sessions.values())

"""Producer spool: durable, atomic, checksummed files; one owner; sequence numbers never reused."""

from __future__ import annotations

import pytest

from megatron_sao.bus import codec
from megatron_sao.bus.spool import RESERVE_BLOCK, Spool
from tests.bus.helpers import traj


def test_spooled_frames_survive_a_reopen(tmp_path) -> None:
    frames = codec.encode(traj(1, 100))
    sp = Spool(tmp_path, "node/0:gpu1", fsync=True)
    seq = sp.next_seq()
    sp.write(seq, "w-1", frames)
    sp.close()
    sp2 = Spool(tmp_path, "node/0:gpu1", fsync=False)
    assert [(e.seq, e.trajectory_id) for e in sp2.entries] == [(seq, "w-1")]
    assert [bytes(f) for f in sp2.read(seq)] == [bytes(f) for f in frames]
    assert sp2.next_seq() > seq  # never reused
    sp2.delete(seq)
    sp2.close()
    assert Spool(tmp_path, "node/0:gpu1", fsync=False).entries == []


def test_epoch_and_sequence_reservation_persist(tmp_path) -> None:
    sp = Spool(tmp_path, "w", fsync=False)
    epoch = sp.epoch
    last = [sp.next_seq() for _ in range(RESERVE_BLOCK + 5)][-1]
    sp.close()  # a crash here loses nothing but the unused rest of the reservation
    sp2 = Spool(tmp_path, "w", fsync=False)
    assert sp2.epoch == epoch and sp2.next_seq() > last


def test_one_live_sender_per_spool(tmp_path) -> None:
    sp = Spool(tmp_path, "w", fsync=False)
    with pytest.raises(ValueError, match="held by another live TrajectorySender"):
        Spool(tmp_path, "w", fsync=False)
    sp.close()
    Spool(tmp_path, "w", fsync=False).close()


def test_corrupt_and_partial_files_are_quarantined_not_sent(tmp_path) -> None:
    sp = Spool(tmp_path, "w", fsync=False)
    for _ in range(2):
        seq = sp.next_seq()
        sp.write(seq, f"t{seq}", codec.encode(traj(seq)))
    path = sp.dir / f"{1:020d}.traj"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # flip a payload byte: size checks pass, the checksum does not
    path.write_bytes(bytes(data))
    (sp.dir / f"{7:020d}.tmp").write_bytes(b"half a write")
    (sp.dir / f"{9:020d}.traj").write_bytes(b"SAOSPOOL1\nshort")
    sp.close()
    sp2 = Spool(tmp_path, "w", fsync=False)
    assert [e.seq for e in sp2.entries] == [0, 1]
    assert sp2.quarantined == [f"{9:020d}.traj"]
    assert [tid for tid, _ in sp2.lost_at_open] == [f"<unreadable {9:020d}.traj>"]  # its header is cut too
    assert not (sp2.dir / f"{7:020d}.tmp").exists()
    with pytest.raises(ValueError, match="checksum"):
        sp2.read(1)
    assert (sp2.dir / "corrupt" / path.name).exists()
    sp2.close()


def test_a_file_cut_after_its_header_names_the_lost_trajectory_to_the_sender(tmp_path) -> None:
    """A torn write that survived the rename (power loss without bus.spool_fsync): the sender reports the id as lost
    (rejected(), reason spool_corrupt) so that the producer generates its prompt again."""
    from megatron_sao.bus import TrajectorySender
    from megatron_sao.config.bus import BusConfig

    sp = Spool(tmp_path, "w", fsync=False)
    for _ in range(3):
        seq = sp.next_seq()
        sp.write(seq, f"t{seq}", codec.encode(traj(seq, 200)))
    path = sp.dir / f"{1:020d}.traj"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    sp.close()
    cfg = BusConfig(bind="tcp://127.0.0.1:1", spool_dir=str(tmp_path))  # nothing listens: only the spool matters
    with TrajectorySender(cfg, "w") as sender:
        assert sender.pending_ids() == ["t0", "t2"]
        ((tid, reason, detail),) = sender.rejected()
        assert (tid, reason) == ("t1", "spool_corrupt") and "size" in detail
    assert (tmp_path / "w" / "corrupt" / path.name).exists()
    with TrajectorySender(cfg, "w") as sender:  # the producer died before recording it: reported again
        assert [(t, r) for t, r, _ in sender.rejected()] == [("t1", "spool_corrupt")]
        sender.acknowledge_lost("t1")
    with TrajectorySender(cfg, "w") as sender:  # recorded: no more
        assert sender.rejected() == [] and sender.pending_ids() == ["t0", "t2"]

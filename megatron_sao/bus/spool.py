"""Producer-side spool: uncommitted trajectories on disk, so they survive a producer crash or restart.

Owned here: the spool directory of one worker (`<spool_dir>/<quoted worker_id>/`), its exclusive lock, the stream
epoch and sequence-number reservation (meta.json), and one file per uncommitted trajectory (`<seq>.traj`, written
to a temp file and renamed, so a crash never leaves half a file). Called by sender.py: write() inside send()
before it returns, delete() when the learner commits, read() when a trajectory must be resent.

File layout (little-endian): MAGIC | u64 seq | u32 n_frames | u32 id_len | id (utf-8) | n_frames x u64 length |
frames | u32 crc32 of everything before it.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from megatron_sao.files.jsonl import FULL_ERRNOS, DiskFull, no_space

MAGIC = b"SAOSPOOL1\n"
_FIXED = struct.Struct("<QII")
_LEN = struct.Struct("<Q")
_CRC = struct.Struct("<I")
RESERVE_BLOCK = 1024
"""Sequence numbers reserved per meta.json write (skipped ones after a crash are harmless: see dedup.py)."""


class SpoolCorrupt(ValueError):
    """A spool file failed its checks (disk fault or foreign file); the sender quarantines it."""


@dataclass(frozen=True)
class SpooledEntry:
    seq: int
    trajectory_id: str
    nbytes: int


class Spool:
    """The spool directory of one worker; one live TrajectorySender per directory (flock)."""

    def __init__(self, root: str | Path, worker_id: str, fsync: bool, reserve_block: int = RESERVE_BLOCK) -> None:
        """`reserve_block`: sequence numbers reserved per meta.json write; a restart skips at most that many, so
        the sender keeps it well inside bus.max_uncommitted (the receiver's sequence window)."""
        self._reserve_block = max(1, reserve_block)
        self.dir = Path(root) / quote(worker_id, safe="")
        self.dir.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._lock_fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            os.close(self._lock_fd)
            raise ValueError(
                f"spool {self.dir} is held by another live TrajectorySender for worker {worker_id!r}; "
                "give each producer its own worker_id"
            ) from e
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink()
        meta_path = self.dir / "meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        self.epoch: str = meta.get("epoch") or secrets.token_hex(8)
        self.entries: list[SpooledEntry] = []
        self.quarantined: list[str] = []
        self.lost_at_open: list[tuple[str, str]] = []  # (trajectory id, or the file when unreadable; what is wrong)
        for path in sorted(self.dir.glob("*.traj")):
            try:
                self.entries.append(self._scan(path))
            except (SpoolCorrupt, struct.error) as e:
                self._quarantine(path, str(e) or "cut short")
        for path in sorted((self.dir / "corrupt").glob("*.traj")):  # this start's, and any a dead producer left
            why = (path.with_suffix(".why").read_text() if path.with_suffix(".why").is_file() else "") or "damaged"
            self.lost_at_open.append((_peek_id(path) or f"<unreadable {path.name}>", why))
        self.entries.sort(key=lambda e: e.seq)
        start = max([int(meta.get("reserved", 0))] + [e.seq + 1 for e in self.entries])
        self._next = start
        self._reserved = start
        self._reserve()

    def _path(self, seq: int) -> Path:
        return self.dir / f"{seq:020d}.traj"

    def _reserve(self) -> None:
        self._reserved = self._next + self._reserve_block
        self._write_atomic(self.dir / "meta.json", [json.dumps({"epoch": self.epoch, "reserved": self._reserved})])

    def next_seq(self) -> int:
        """Allocate the next sequence number (persisting a new reservation block when needed)."""
        seq = self._next
        self._next += 1
        if self._next > self._reserved:
            self._reserve()
        return seq

    @property
    def peek_next_seq(self) -> int:
        return self._next

    def write(self, seq: int, trajectory_id: str, frames: Sequence[bytes | memoryview]) -> None:
        tid = trajectory_id.encode()
        parts: list[bytes | memoryview] = [MAGIC, _FIXED.pack(seq, len(frames), len(tid)), tid]
        parts += [_LEN.pack(len(f)) for f in frames]
        parts += list(frames)
        crc = 0
        for p in parts:
            crc = zlib.crc32(p, crc)
        parts.append(_CRC.pack(crc))
        self._write_atomic(self._path(seq), parts)

    def _write_atomic(self, path: Path, parts: Sequence[bytes | memoryview | str]) -> None:
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                for p in parts:
                    f.write(p.encode() if isinstance(p, str) else p)
                if self._fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)  # never half a file
            if e.errno in FULL_ERRNOS:
                raise DiskFull(e.errno, no_space(self.dir, "bus.spool_dir", path.name)) from e
            raise
        if self._fsync:
            dir_fd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def _scan(self, path: Path) -> SpooledEntry:
        """Read only the prefix (the payload's crc is checked by read())."""
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(len(MAGIC) + _FIXED.size)
            if len(head) != len(MAGIC) + _FIXED.size or not head.startswith(MAGIC):
                raise SpoolCorrupt(f"{path}: bad magic")
            seq, n_frames, id_len = _FIXED.unpack_from(head, len(MAGIC))
            if n_frames > 64 or id_len > 4096:
                raise SpoolCorrupt(f"{path}: implausible frame count {n_frames} or id length {id_len}")
            tid = f.read(id_len).decode(errors="replace")
            lens = [_LEN.unpack(f.read(_LEN.size))[0] for _ in range(n_frames)]
        nbytes = sum(lens)
        expected = len(MAGIC) + _FIXED.size + id_len + n_frames * _LEN.size + nbytes + _CRC.size
        if size != expected or path.name != self._path(seq).name:
            raise SpoolCorrupt(f"{path}: size {size} != {expected} or name does not match seq {seq}")
        return SpooledEntry(seq, tid, nbytes)

    def read(self, seq: int) -> list[memoryview]:
        """The frames of a spooled trajectory (views on one bytes object). Raises SpoolCorrupt."""
        path = self._path(seq)
        data = path.read_bytes()
        if (
            len(data) < len(MAGIC) + _FIXED.size + _CRC.size
            or zlib.crc32(memoryview(data)[: -_CRC.size]) != (_CRC.unpack_from(data, len(data) - _CRC.size)[0])
        ):
            self._quarantine(path, "checksum mismatch")
            raise SpoolCorrupt(f"{path}: checksum mismatch (moved to {self.dir / 'corrupt'})")
        off = len(MAGIC)
        _seq, n_frames, id_len = _FIXED.unpack_from(data, off)
        off += _FIXED.size + id_len
        lens = [_LEN.unpack_from(data, off + i * _LEN.size)[0] for i in range(n_frames)]
        off += n_frames * _LEN.size
        view = memoryview(data)
        frames = []
        for n in lens:
            frames.append(view[off : off + n])
            off += n
        return frames

    def delete(self, seq: int) -> None:
        self._path(seq).unlink(missing_ok=True)

    def _quarantine(self, path: Path, why: str = "") -> None:
        """Move a damaged file to corrupt/, where every start reports it (lost_at_open) until acknowledge_lost()."""
        bad = self.dir / "corrupt"
        bad.mkdir(exist_ok=True)
        (bad / path.name).with_suffix(".why").write_text(why)
        os.replace(path, bad / path.name)
        self.quarantined.append(path.name)

    def acknowledge_lost(self, trajectory_id: str) -> None:
        """The producer recorded the loss (and re-opened its prompt): stop reporting the damaged file at start."""
        for path in (self.dir / "corrupt").glob("*.traj"):
            if (_peek_id(path) or f"<unreadable {path.name}>") == trajectory_id:
                path.rename(path.with_suffix(".reported"))

    def close(self) -> None:
        if self._lock_fd >= 0:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = -1


def _peek_id(path: Path) -> str | None:
    """The trajectory id in a spool file's header, when that much of it is readable."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC) + _FIXED.size)
            if len(head) != len(MAGIC) + _FIXED.size or not head.startswith(MAGIC):
                return None
            _, _, id_len = _FIXED.unpack_from(head, len(MAGIC))
            tid = f.read(min(id_len, 4096))
    except OSError:
        return None
    return tid.decode() if tid and len(tid) == id_len and tid.isascii() else None

"""Append-only JSON-lines files that stay whole, and a full disk named: the run's logs (metrics.jsonl,
trajectories.jsonl, ledger/<worker>.jsonl, stale.jsonl, rollout_metrics_<worker>.jsonl, eval/results.jsonl).

Owned here:
- `JsonlAppender`: records go in whole lines or not at all (one O_APPEND descriptor; a write cut short by a full disk
  is cut back to where it began), and a full disk raises `DiskFull` naming the directory and the config field that
  put the file there. Opening a file whose last line is torn (a crash or a full disk under an older release) repairs
  it first: the torn tail is cut off, with a warning.
- `read_records`: every record of such a file; a torn last line is left out and reported once per file (the next
  writer repairs it; a reader never changes a file a live run may be appending to). Other unreadable lines come back
  as `{"event": "unreadable", "where": "<path>:<line>"}` for the caller to judge.
- `no_space` / `is_disk_full`: the one wording of "no space left on <dir> (<field>)" for every writer.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_reported: set[str] = set()


class DiskFull(OSError):
    """No space (or quota) left where the run writes; the message names the directory and the config field."""


def no_space(where: str | Path, field: str, what: str = "") -> str:
    doing = f" writing {what}" if what else ""
    return (f"no space left on {where} ({field}){doing}: free space there or point {field} elsewhere, then rerun "
            "(files are whole; the run resumes from its last checkpoint)")  # fmt: skip


def is_disk_full(e: BaseException | None) -> bool:
    """Whether `e`, or an exception it was raised from, is ENOSPC / EDQUOT."""
    seen = 0
    while e is not None and seen < 16:
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            return True
        e = e.__cause__ or e.__context__
        seen += 1
    return False


def _last_newline_end(fd: int, size: int) -> int:
    """Offset just after the last b'\\n' in the file (0 when there is none)."""
    pos = size
    while pos > 0:
        start = max(0, pos - 65536)
        chunk = os.pread(fd, pos - start, start)
        i = chunk.rfind(b"\n")
        if i >= 0:
            return start + i + 1
        pos = start
    return 0


def _parses(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


class JsonlAppender:
    """Appends JSON records to `path`, each a whole line. `field` is the config field that chose the directory
    (named in DiskFull). Thread-safe only under the caller's lock (one writer per file)."""

    def __init__(self, path: str | Path, field: str) -> None:
        self.path = Path(path)
        self.field = field
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise self._named(e) from e
        self._repair()

    def _named(self, e: OSError) -> OSError:
        if e.errno in FULL_ERRNOS:
            return DiskFull(e.errno, no_space(self.path.parent, self.field, self.path.name))
        return e

    def _repair(self) -> None:
        """A torn last line (no newline at the end) is cut off -- or, when it is a whole record that only lost its
        newline, given one back."""
        size = os.fstat(self.fd).st_size
        if size == 0 or os.pread(self.fd, 1, size - 1) == b"\n":
            return
        end = _last_newline_end(self.fd, size)
        tail = os.pread(self.fd, size - end, end)
        try:
            if _parses(tail):
                os.write(self.fd, b"\n")
                return
            os.ftruncate(self.fd, end)
        except OSError as e:
            raise self._named(e) from e
        log.warning("%s: its last line was torn (%d bytes, cut by a crash or a full disk); removed it", self.path,
                    size - end)  # fmt: skip

    def write(self, record: Mapping[str, Any], sort_keys: bool = False) -> None:
        self.write_many([record], sort_keys)

    def write_many(self, records: Iterable[Mapping[str, Any]], sort_keys: bool = False) -> None:
        """All of `records`, or -- on a full disk, raising DiskFull -- none of them."""
        data = "".join(json.dumps(r, sort_keys=sort_keys) + "\n" for r in records).encode()
        if not data:
            return
        start = os.fstat(self.fd).st_size
        view = memoryview(data)
        try:
            while view:
                n = os.write(self.fd, view)
                if n == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                view = view[n:]
        except OSError as e:
            try:
                os.ftruncate(self.fd, start)  # whole lines or nothing
            except OSError:
                log.error("%s: could not cut a partial write back to %d bytes", self.path, start)
            raise self._named(e) from e

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file ([] when it does not exist); see the module docstring for torn lines."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    torn = lines.pop() if lines else b""  # after the last newline: b"" for a whole file
    out: list[dict[str, Any]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        # a line that is not a JSON object (garbage, or valid JSON of another shape) is kept as what it is
        out.append(record if isinstance(record, dict) else {"event": "unreadable", "where": f"{path}:{n}"})
    if torn.strip():
        if _parses(torn):
            out.append(json.loads(torn))
        elif str(path) not in _reported:
            _reported.add(str(path))
            log.warning("%s: its last line is torn (%d bytes: a write cut by a crash or a full disk); left out -- "
                        "the run's next start repairs the file", path, len(torn))  # fmt: skip
    return out

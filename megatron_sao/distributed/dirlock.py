"""One process per role per run directory (shared by run/ and rollout/): `run` holds `<run_dir>/.run.lock`, the
learner's rank 0 `.learn.lock`, each rollout worker `.rollout-<worker>.lock`, taken before anything is written.

The lock is an flock on the file (the kernel drops it when its holder dies, however it dies) and the file says who
holds it (pid, host, start time, command). A second holder is refused at once, naming the first and how to stop it;
a lock file left by a holder that is gone is taken over with a warning. On a cluster the launcher's step and the
roles' own locks sit on the shared run directory (flock over NFS v4 / Lustre; a filesystem without it is named).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class DirLocked(RuntimeError):
    """The lock cannot be had: another live process holds it (the message names it and how to stop it), or the
    directory cannot be written."""


class DirLock:
    """`with DirLock(run_dir, "run"):` -- held until the block ends (or the process dies)."""

    def __init__(self, directory: str | Path, role: str, what: str = "launch.run_dir") -> None:
        self.path = Path(directory) / f".{role}.lock"
        self.role, self.what = role, what
        self._fd = -1

    def acquire(self) -> DirLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a file in the way, no permission, a read-only or full filesystem
            raise DirLocked(f"{self.what}='{self.path.parent}' is not writable ({e.strerror}: {e.filename}); choose "
                            "a directory this user can write") from None  # fmt: skip
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            pid, command = holder.get("pid", "?"), str(holder.get("command", "?"))[:120]
            raise DirLocked(
                f"{self.path.parent} ({self.what}) is in use by another {self.role}: pid {pid} on "
                f"{holder.get('host', '?')}, started {holder.get('started', '?')} ({command}). "
                f"Wait for it, stop it (kill {pid}: it checkpoints first), or choose another {self.what}"
            ) from None
        except OSError as e:  # no flock on this filesystem
            os.close(fd)
            raise DirLocked(f"cannot lock {self.path} ({e.strerror}): {self.what} must be on a filesystem with "
                            "flock (local, NFS v4, Lustre)") from None  # fmt: skip
        old = _read(fd)
        if old.get("pid") is not None:
            log.warning("%s: taking over the lock of %s pid %s on %s (started %s), which is gone", self.path.parent,
                        self.role, old.get("pid"), old.get("host"), old.get("started"))  # fmt: skip
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)}  # fmt: skip
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)  # a clean exit leaves no holder to take over from
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _read(fd: int) -> dict[str, Any]:
    try:
        data = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        return json.loads(data) if data else {}
    except (OSError, ValueError):
        return {}

"""Run a function on N local torch.distributed ranks (gloo on CPU): tests, tools/check_parity.py, benchmarks.

`spawn_ranks(fn, 2, ...)` starts fresh processes on a free port, one thread each, captures each rank's
output (Python and C level) to a log, enforces a timeout (dumping every rank's stack first), tears
everything down, and on failure raises `RankFailure` carrying the failing rank's traceback and log.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import queue
import random
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class RankFailure(RuntimeError):
    """A spawned rank raised, crashed or timed out; the message holds its traceback and output."""


_start_lock = threading.Lock()  # ranks inherit os.environ at start: concurrent spawn_ranks calls take turns
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port free right now, outside the kernel's ephemeral range and not handed out before by this process.

    The port is bound later by another process (an engine, the bus, a rendezvous store), seconds after it was
    chosen. A port from the ephemeral range (what binding port 0 returns) can be taken in between by any
    outgoing connection on the machine, so the choice is made outside that range, where only explicit binds
    go; the handed-out set keeps concurrent callers of this process (two jobs spawned side by side) apart."""
    pick = random.Random(os.getpid() ^ time.time_ns())
    first, last = _explicit_bind_range()
    for _ in range(1000):
        if first > last:  # the ephemeral range covers everything: the kernel's choice is all there is
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = int(s.getsockname()[1])
        else:
            port = pick.randint(first, last)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
        with _handed_out_lock:
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise RuntimeError(f"no free port on {host} in {first}..{last} after 1000 tries")


def _explicit_bind_range() -> tuple[int, int]:
    """Ports outside the kernel's range for outgoing connections (Linux's ip_local_port_range, else IANA's)."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 49152, 65535
    if low > 21000:
        return 20000, low - 1
    return high + 1, 65535  # empty when the ephemeral range reaches the top


@contextlib.contextmanager
def _environ(updates: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    log_path: str,
    results: Any,
    release: Any,
    threads: int,
    dump_after_s: float,
) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives as long as the process
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    faulthandler.dump_traceback_later(dump_after_s, exit=False)
    import torch

    torch.set_num_threads(threads)
    try:
        value = fn(*args, **kwargs)
    except BaseException:  # reported to the parent with the traceback, then the rank exits non-zero
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        results.put((rank, False, tb))
        sys.stdout.flush()
        os._exit(1)
    faulthandler.cancel_dump_traceback_later()
    results.put((rank, True, value))
    # Tensors travel through shared memory owned by this process: stay alive until the parent has them.
    release.wait(timeout=dump_after_s)


def _tail(path: Path, lines: int = 60) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "<no output>"
    return "\n".join(text[-lines:]) or "<no output>"


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    threads_per_rank: int = 1,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Call `fn(*args, **kwargs)` on `world_size` fresh processes with RANK/WORLD_SIZE/MASTER_* set.

    `fn` must be importable (a module-level function). Returns the per-rank return values, rank order.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    release = ctx.Event()
    port = find_free_port()
    logdir = Path(tempfile.mkdtemp(prefix="sao_ranks_"))
    procs: list[Any] = []
    common = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": str(threads_per_rank),
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    try:
        with _start_lock:
            for rank in range(world_size):
                with _environ({**common, "RANK": str(rank), "LOCAL_RANK": str(rank)}):
                    p = ctx.Process(
                        target=_rank_main,
                        args=(
                            fn,
                            rank,
                            args,
                            kwargs,
                            str(logdir / f"rank{rank}.log"),
                            results,
                            release,
                            threads_per_rank,
                            max(1.0, timeout_s - 5.0),
                        ),
                        name=f"rank{rank}",
                    )
                    p.start()
                procs.append(p)
        return _collect(procs, results, release, logdir, timeout_s)
    finally:
        release.set()
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
        results.close()
        shutil.rmtree(logdir, ignore_errors=True)  # a failure's RankFailure already carries the output tails


def _collect(procs: list[Any], results: Any, release: Any, logdir: Path, timeout_s: float) -> list[Any]:
    world_size = len(procs)
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    failure: tuple[int, str, float] | None = None  # (rank, traceback or reason, when)
    while len(values) < world_size:
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            pass
        except (EOFError, OSError) as e:  # a rank died while writing its result
            if failure is None:
                failure = (-1, f"result channel broke ({e!r}); a rank crashed", time.monotonic())
        else:
            if ok:
                values[rank] = value
            elif failure is None:
                failure = (rank, value, time.monotonic())
        for rank, p in enumerate(procs):
            if failure is None and p.exitcode not in (None, 0) and rank not in values:
                failure = (rank, f"rank {rank} exited with code {p.exitcode} (crash or kill)", time.monotonic())
        now = time.monotonic()
        if failure is not None:
            rank, reason, since = failure
            # Give the failing rank's own traceback a moment to arrive, then stop the others.
            if now - since > 5.0 or not any(p.is_alive() for p in procs):
                ranks = [rank] if rank >= 0 else list(range(world_size))
                output = "\n".join(f"--- rank {r} output ---\n{_tail(logdir / f'rank{r}.log')}" for r in ranks)
                raise RankFailure(f"rank {rank} of {world_size} failed:\n{reason}\n{output}")
        if now > deadline:
            pending = [r for r in range(world_size) if r not in values]
            time.sleep(6.0)  # faulthandler dumps the stuck ranks' stacks into their logs
            logs = "\n".join(f"--- rank {r} output ---\n{_tail(logdir / f'rank{r}.log')}" for r in pending)
            raise RankFailure(f"ranks {pending} of {world_size} did not finish within {timeout_s:.0f}s\n{logs}")
    release.set()
    for p in procs:
        p.join(timeout=30)
    return [values[r] for r in range(world_size)]


DIE_WITH_PARENT = "SAO_DIE_WITH_PARENT"
"""Set in the environment of the processes a local run starts, to the run's pid: they end when that process dies."""


def child_env() -> dict[str, str]:
    """The environment of a process a local launcher starts (engines, rollout workers): it dies with the launcher."""
    return {**os.environ, DIE_WITH_PARENT: str(os.getpid())}


def die_with_parent_if_asked() -> None:
    """Called first by the engine and rollout commands: when started by a local run (DIE_WITH_PARENT holds its pid),
    ask Linux for SIGKILL when the parent dies, so no engine or worker outlives its run (a leftover would hold the
    ports and answer the next run). SIGKILL, not SIGTERM: a worker told to stop finishes its in-flight episodes,
    which with the run and its engine gone can wait out request timeouts and retries (the chaos suite caught one
    alive 30 s later); an abrupt end loses nothing the next run needs (the cursor and the spool are on disk, as
    after any worker crash). A parent that died before the request -- while this process was still starting -- is
    seen after it: the parent is then no longer the pid the run wrote, and this exits now."""
    import ctypes
    import signal
    import sys

    launcher = os.environ.get(DIE_WITH_PARENT, "")
    if not launcher.isdigit() or not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != int(launcher):  # the run died before the request was made
        raise SystemExit(1)

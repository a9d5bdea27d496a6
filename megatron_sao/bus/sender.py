"""TrajectorySender: a rollout worker's end of the bus (the API producers code against).

Owned here: accepting a finished trajectory from the caller (validate, encode zero-copy, size limits, spool it,
back-pressure: block while the local queue or the uncommitted window is full), flush/close, and the sender's
metrics. Called by rollout workers (one thread; the socket lives on the I/O thread in sender_io.py).

Zero-copy contract: send() keeps references to the trajectory's numpy arrays until the learner commits it (or,
with a spool, until the receiver acknowledges receipt); do not modify them after send().
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from megatron_sao.bus import auth, codec, protocol
from megatron_sao.bus.admission import StartBook
from megatron_sao.bus.schema import Trajectory
from megatron_sao.bus.sender_io import HANDSHAKE_EVENTS, Entry, Outbox, SenderIO
from megatron_sao.bus.spool import RESERVE_BLOCK, Spool
from megatron_sao.config.bus import BusConfig

log = logging.getLogger(__name__)


class TrajectorySender:
    """Connects to `cfg.connect_address`; resumes the spool of `worker_id` when cfg.spool_dir is set."""

    def __init__(self, cfg: BusConfig, worker_id: str) -> None:
        if not worker_id:
            raise ValueError("TrajectorySender needs a non-empty worker_id (unique per producer)")
        self.cfg = cfg
        self.worker_id = worker_id
        self._limits = codec.Limits(cfg.max_frame_bytes, cfg.max_message_bytes, cfg.max_header_bytes)
        keys = auth.load_client_keys(cfg)  # config errors first, before anything is created
        reserve = min(RESERVE_BLOCK, max(1, cfg.max_uncommitted // 4))
        self._spool = Spool(cfg.spool_dir, worker_id, cfg.spool_fsync, reserve) if cfg.spool_dir else None
        epoch = self._spool.epoch if self._spool else secrets.token_hex(8)
        self._outbox = Outbox(next_seq=self._spool.peek_next_seq if self._spool else 0)
        if self._spool is not None:
            self._resume_spool()
        self._closed = False
        self._ctx = zmq.Context()
        try:
            sock, monitor = self._open_socket(keys)
            wake_addr = f"inproc://sao-bus-send-{epoch}-{id(self)}"
            self._wake_rx = self._ctx.socket(zmq.PAIR)
            self._wake_rx.bind(wake_addr)
            self._wake_tx = self._ctx.socket(zmq.PAIR)
            self._wake_tx.connect(wake_addr)
        except (zmq.ZMQError, ValueError):
            self._ctx.destroy(linger=0)
            if self._spool is not None:
                self._spool.close()
            raise
        self._wake_lock = threading.Lock()
        self._io = SenderIO(cfg, worker_id, epoch, sock, self._outbox, self._spool)
        self._monitor = monitor
        self._thread = threading.Thread(target=self._run, name=f"sao-bus-sender-{worker_id}", daemon=True)
        self._thread.start()

    def _resume_spool(self) -> None:
        assert self._spool is not None
        for se in self._spool.entries:
            self._outbox.add(Entry(se.seq, se.trajectory_id, se.nbytes, None))
        for tid, why in self._spool.lost_at_open:  # the producer re-opens their prompts (see rejected())
            self._outbox.rejected.append((tid, "spool_corrupt", why))
            log.error("bus: trajectory %s lost: its spool file is damaged (%s)", tid, why)
        if self._spool.entries or self._spool.quarantined:
            log.info(
                "bus: worker %s resumes %d spooled trajectories (%d corrupt files quarantined)",
                self.worker_id,
                len(self._spool.entries),
                len(self._spool.quarantined),
            )

    def _open_socket(self, keys: auth.ClientKeys | None) -> tuple[zmq.Socket, zmq.Socket]:
        """The DEALER connected to the receiver and its handshake monitor, attached before the connect so that a
        handshake refused at once (a loaded machine can be slower to start the I/O thread) is heard."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a live connection; a dead one is resent after Hello
        sock.setsockopt(zmq.SNDHWM, self.cfg.max_inflight + 64)
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * protocol.MAX_ENVELOPE_BYTES)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        auth.configure_client(sock, keys)
        monitor = sock.get_monitor_socket(HANDSHAKE_EVENTS)
        try:
            sock.connect(self.cfg.connect_address)
        except zmq.ZMQError as e:
            raise ValueError(f"bus sender cannot connect to {self.cfg.connect_address} ({e}); fix bus.connect") from e
        return sock, monitor

    def _run(self) -> None:
        try:
            self._io.loop(self._wake_rx, self._monitor)
        except Exception as e:  # not hidden: logged, stored and re-raised to the caller by send()/flush()
            log.exception("bus sender I/O thread failed")
            with self._outbox.cv:
                self._outbox.error = e
                self._outbox.cv.notify_all()
        finally:  # the thread owns its sockets from here (an unclosed one would hang close()'s Context.term)
            with contextlib.suppress(zmq.ZMQError):
                self._io.sock.disable_monitor()
            self._monitor.close(linger=0)
            self._io.sock.close(linger=0)
            self._wake_rx.close(linger=0)

    def _wake(self) -> None:
        with self._outbox.cv:
            if self._outbox.wake_pending:
                return
            self._outbox.wake_pending = True
        # NOBLOCK: once the I/O thread is gone nobody reads the pair socket (send() then reports its error)
        with self._wake_lock, contextlib.suppress(zmq.Again):
            self._wake_tx.send(b"", zmq.NOBLOCK)

    # ---- public API --------------------------------------------------------------------------------------------

    def send(self, traj: Trajectory, timeout_s: float | None = None) -> None:
        """Queue `traj`; returns once it is queued (and spooled, with a spool). Idempotent for a pending id.

        Blocks while max_inflight trajectories wait for credits or the uncommitted window is full; raises
        TimeoutError after timeout_s (None: wait forever), ValueError when traj is malformed (shapes, ids, turn
        ranges; every value too with bus.validate_on_send) or over the size limits. A trajectory the receiver
        refuses is logged as an error and listed by rejected().
        """
        if self._closed:
            raise RuntimeError("TrajectorySender is closed")
        self._check_io()
        if self.cfg.validate_on_send:
            traj.validate()
        else:
            traj.check_shapes()  # what encoding relies on; the values are checked by the receiver
        h = traj.header
        stamped = msgspec.structs.replace(h, timings=msgspec.structs.replace(h.timings, sent_at=time.time()))
        frames = codec.encode(dataclasses.replace(traj, header=stamped, extras={}))
        try:
            nbytes = codec.check_sizes(frames, self._limits)
        except codec.FrameError as e:
            raise ValueError(
                f"trajectory {h.trajectory_id} ({h.num_tokens} tokens) is over the bus limits: {e.detail}; "
                "raise bus.max_frame_bytes / bus.max_message_bytes / bus.max_header_bytes on both sides"
            ) from e
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        ob = self._outbox
        with ob.cv:
            if h.trajectory_id in ob.ids:
                self._io.counters.add("duplicate_sends")
                return
            if not self._has_room(nbytes, 0):  # blocked: resume once half the queue left, not per trajectory
                slack = self.cfg.max_inflight // 2
                self._wait(lambda: self._has_room(nbytes, slack), deadline, lambda: self._why_blocked(slack))
            seq = self._spool.next_seq() if self._spool is not None else ob.next_seq
            ob.next_seq = seq + 1
            if self._spool is not None:
                self._spool.write(seq, h.trajectory_id, frames)
            oldest = traj.oldest_version()
            ob.add(Entry(seq, h.trajectory_id, nbytes, frames, oldest=-1 if oldest is None else oldest))
        self._wake()

    def take_starts(self, k: int, floor: int) -> int:
        """Rollout admission (bus/admission.py): ask to start `k` episodes with the engines at weight version `floor`;
        returns how many may start now (0..k). Each one counts as running from `floor` until end_start(floor), which
        comes after its trajectory went to send() (or after it was given up). The learner grants the rest as room
        appears; ask again then."""
        if k < 0 or floor < 0:
            raise ValueError(f"take_starts(k={k}, floor={floor}): both must be >= 0")
        self._check_io()
        ob = self._outbox
        with ob.cv:
            if ob.starts is None:
                ob.starts = StartBook()
            made = ob.starts.take(k, floor)
            ask = made < k
        if ask:
            self._wake()  # the I/O thread reports the ask at once
        return made

    def end_start(self, floor: int) -> None:
        """An episode started by take_starts(.., floor) ended (its trajectory was sent, or it was given up)."""
        with self._outbox.cv:
            if self._outbox.starts is not None:
                self._outbox.starts.end(floor)

    def wait_starts(self, timeout_s: float) -> None:
        """Wait until the learner granted starts not yet taken, or timeout_s passed."""
        ob = self._outbox
        deadline = time.monotonic() + timeout_s
        with ob.cv:
            while ob.starts is not None and ob.starts.granted <= ob.starts.used and ob.error is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                ob.cv.wait(remaining)
        self._check_io()

    @property
    def admitting(self) -> bool | None:
        """Whether the producer must ask take_starts before each episode: the config asks for rollout admission
        (bus.admission with bus.max_staleness) and the receiver grants starts (it said so when it welcomed this
        producer). None: configured, but no receiver answered yet (wait: nothing can be sent either)."""
        if not self.cfg.admission or self.cfg.max_staleness is None:
            return False
        self._check_io()
        return self._io.admits

    def _check_io(self) -> None:
        """Raise the I/O thread's failure (a refused handshake, a broken socket) to the producer's thread."""
        if self._outbox.error is not None:
            raise RuntimeError(f"bus sender I/O thread failed: {self._outbox.error}") from self._outbox.error

    def _has_room(self, nbytes: int, slack: int) -> bool:
        ob = self._outbox
        if len(ob.unsent) + slack >= self.cfg.max_inflight or len(ob.entries) >= self.cfg.max_uncommitted:
            return False
        # the receiver only takes seq in [base, base + max_uncommitted): gaps left by out-of-order commits,
        # rejects or a spool restart count too, or the next trajectory would be refused (and lost)
        next_seq = self._spool.peek_next_seq if self._spool is not None else ob.next_seq
        if next_seq - ob.base() >= self.cfg.max_uncommitted:
            return False
        return self._spool is not None or not ob.entries or ob.mem_bytes + nbytes <= self.cfg.max_uncommitted_bytes

    def _wait(self, ready: Callable[[], bool], deadline: float | None, why: Callable[[], str] | None) -> bool:
        """Wait on the outbox condition (held by the caller) until ready(); at the deadline raise TimeoutError(why())
        or, without `why` (flush), return False."""
        ob = self._outbox
        while not ready():
            self._check_io()
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                if why is None:
                    return False
                raise TimeoutError(why())
            ob.cv.wait(remaining if remaining is None else min(remaining, 1.0))
        return True

    def _why_blocked(self, slack: int) -> str:
        ob, io = self._outbox, self._io
        if not io.welcomed:
            return f"bus: no receiver answers at {self.cfg.connect_address} (is the learner up? same CURVE keys?)"
        if len(ob.unsent) + slack >= self.cfg.max_inflight:
            return (
                f"bus: {len(ob.unsent)} trajectories wait for credits (bus.max_inflight={self.cfg.max_inflight}): "
                "the learner is not taking trajectories fast enough"
            )
        return (
            f"bus: {len(ob.entries)} trajectories ({ob.mem_bytes} bytes in memory) are not yet committed: the "
            "learner must call receiver.commit() after each checkpoint; or set bus.spool_dir, or raise "
            "bus.max_uncommitted / bus.max_uncommitted_bytes"
        )

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything sent so far is committed by the learner; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._wake()
        with self._outbox.cv:
            return self._wait(lambda: not self._outbox.entries, deadline, None)

    @property
    def durable(self) -> bool:
        """Whether a sent trajectory survives this process's crash (it is spooled) before the learner commits it."""
        return self._spool is not None

    def pending_ids(self) -> list[str]:
        """Ids of trajectories sent (or spooled) but not yet committed, oldest first."""
        with self._outbox.cv:
            return [e.trajectory_id for e in self._outbox.entries.values()]

    def acknowledge_lost(self, trajectory_id: str) -> None:
        """The producer has recorded that `trajectory_id` was lost from a damaged spool file (rejected() reason
        spool_corrupt) and acted on it; later starts stop reporting it. Until then every start reports it again."""
        if self._spool is not None:
            self._spool.acknowledge_lost(trajectory_id)

    def rejected(self) -> list[tuple[str, str, str]]:
        """(trajectory_id, reason, detail) of recent trajectories the receiver refused for good, or lost from a damaged
        spool file (reason "spool_corrupt": the producer should generate its prompt again)."""
        with self._outbox.cv:
            return list(self._outbox.rejected)

    def metrics(self) -> dict[str, float]:
        out = self._io.counters.snapshot()
        with self._outbox.cv:
            out["uncommitted"] = float(len(self._outbox.entries))
            out["unsent"] = float(len(self._outbox.unsent))
            out["memory_bytes"] = float(self._outbox.mem_bytes)
        out["credits"] = float(max(self._io.granted - self._io.sent, 0))
        return out

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the I/O thread. Uncommitted trajectories stay in the spool (or are lost without one: flush first)."""
        if self._closed:
            return
        self._closed = True
        with self._outbox.cv:
            self._outbox.stopping = True
            left = len(self._outbox.entries)
        self._wake()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"bus sender I/O thread did not stop within {timeout_s}s")
        self._wake_tx.close(linger=0)
        self._ctx.term()
        if self._spool is not None:
            self._spool.close()
        if left:
            where = "stay in the spool for the next start" if self._spool else "are lost (no bus.spool_dir)"
            log.warning("bus: sender %s closed with %d uncommitted trajectories; they %s", self.worker_id, left, where)

    def __enter__(self) -> TrajectorySender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

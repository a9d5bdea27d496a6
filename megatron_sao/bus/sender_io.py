"""The sender's I/O thread: owns the DEALER socket, the session with the receiver, credits, acks and resends.

Owned here: the producer half of the protocol in docs/bus.md -- Hello/Welcome (with the receiver incarnation that
tells a restarted learner apart), sending data only against credits, receipt acks (which let spooled payloads leave
memory), commits (which drop trajectories for good), rejects, heartbeats, and the resend rules (everything
uncommitted after a new receiver incarnation; everything not receipt-acked after a reconnect, a peer timeout or
resend_after_s). Called only by sender.py, which shares `Outbox` with it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from megatron_sao.bus import protocol
from megatron_sao.bus.admission import StartBook
from megatron_sao.bus.metrics import Counters
from megatron_sao.bus.spool import Spool, SpoolCorrupt
from megatron_sao.config.bus import BusConfig

log = logging.getLogger(__name__)

HANDSHAKE_FAILURES = 1
"""Failed security handshakes in a row before the sender gives up: a key the receiver refuses, a server key that is
not the receiver's or a security mechanism it does not share never heals, and libzmq does not retry the handshake of a
connection it refused (a sender would wait forever)."""
HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                     | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)  # fmt: skip


class BusHandshakeError(RuntimeError):
    """The receiver answers but never completes the CURVE handshake: the keys do not match."""


UNSENT, SENT, RECEIVED = 0, 1, 2
_EVENTS, _POLLIN, _NOBLOCK, _SNDMORE = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK), int(zmq.SNDMORE)


@dataclass(slots=True)
class Entry:
    """One uncommitted trajectory."""

    seq: int
    trajectory_id: str
    nbytes: int
    frames: list[bytes | memoryview] | None  # payload frames in memory; None: only in the spool
    state: int = UNSENT
    sent_at: float = 0.0
    oldest: int = -1  # the lowest weight version of its action tokens (-1: none or not known), for rollout admission


class Outbox:
    """The sender's uncommitted trajectories, shared by the caller and the I/O thread; guarded by `cv`."""

    def __init__(self, next_seq: int) -> None:
        self.cv = threading.Condition()
        self.entries: dict[int, Entry] = {}  # by seq, in increasing seq order
        self.ids: dict[str, int] = {}  # trajectory_id -> seq of the entries
        self.unsent: deque[int] = deque()  # seqs waiting for a credit, increasing
        self.mem_bytes = 0  # payload bytes of entries whose frames are in memory
        self.next_seq = next_seq  # without a spool; the spool allocates its own
        self.rejected: deque[tuple[str, str, str]] = deque(maxlen=1024)  # (trajectory_id, reason, detail)
        self.error: BaseException | None = None
        self.stopping = False
        self.wake_pending = False
        self.starts: StartBook | None = None  # rollout admission, once the producer asks for starts

    def add(self, entry: Entry) -> None:
        self.entries[entry.seq] = entry
        self.ids[entry.trajectory_id] = entry.seq
        self.unsent.append(entry.seq)
        if entry.frames is not None:
            self.mem_bytes += entry.nbytes

    def remove(self, seq: int) -> Entry | None:
        e = self.entries.pop(seq, None)
        if e is not None:
            self.ids.pop(e.trajectory_id, None)
            if e.frames is not None:
                self.mem_bytes -= e.nbytes
        return e

    def base(self) -> int:
        """Lowest seq not yet committed (or the next seq when everything is)."""
        return next(iter(self.entries), self.next_seq)

    def drop_frames(self, e: Entry) -> None:
        if e.frames is not None:
            e.frames = None
            self.mem_bytes -= e.nbytes


class SenderIO:
    """Session state lives here and is touched by the I/O thread only."""

    def __init__(
        self, cfg: BusConfig, worker_id: str, epoch: str, sock: zmq.Socket, outbox: Outbox, spool: Spool | None
    ) -> None:
        self.cfg = cfg
        self.worker_id = worker_id
        self.epoch = epoch
        self.sock = sock
        self.outbox = outbox
        self.spool = spool
        self.counters = Counters("sent", "resent", "committed", "rejected")
        self.incarnation: str | None = None
        self.session = 0  # number of the latest Hello
        self.welcomed = False
        self.granted = 0
        self.sent = 0
        self.reported_demand = 0
        self.reported_starts: protocol.Starts | None = None
        self.admits: bool | None = None  # whether the receiver grants starts (None: no Welcome yet)
        self.last_heard = time.monotonic()
        self.last_hello = -float("inf")
        self.hello_sent = False
        self.last_ping = -float("inf")
        self.inflight: deque[tuple[float, int]] = deque()  # (sent_at, seq) of data not yet receipt-acked
        self.failed_handshakes = 0  # in a row, since the last that succeeded

    # ---- the loop ----------------------------------------------------------------------------------------------

    def loop(self, wake_rx: zmq.Socket, monitor: zmq.Socket) -> None:
        """Runs until Bye; `monitor` hears the socket's handshakes (attached before it connected: a refusal that comes
        at once is not missed, and libzmq does not retry it); the caller closes the sockets."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(wake_rx, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        tick_ms = min(self.cfg.heartbeat_s / 2, 0.1) * 1000
        while True:
            ready = dict(poller.poll(tick_ms))
            if monitor in ready:
                self._on_handshake(recv_monitor_message(monitor)["event"])
            if wake_rx in ready:
                wake_rx.recv()  # exactly one: the caller sends only while wake_pending was False
                with self.outbox.cv:
                    self.outbox.wake_pending = False
                    if self.outbox.stopping:
                        self._send_control(protocol.Bye(self.outbox.base()))
                        return
            if self.sock in ready:
                self._drain()
            self._housekeeping(time.monotonic())
            if self.welcomed:
                self._send_data()

    def _on_handshake(self, event: int) -> None:
        """A security handshake's outcome; HANDSHAKE_FAILURES failures in a row end the sender (BusHandshakeError):
        a receiver that is reachable but refuses the keys would otherwise be retried forever in silence."""
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.failed_handshakes = 0
            return
        self.failed_handshakes += 1
        if self.failed_handshakes >= HANDSHAKE_FAILURES:
            key = self.cfg.curve_server_public_key
            mine = (f"The producer's copy of the server's public key (bus.curve_server_public_key: {key}) must be the "
                    "learner's and its client public key must be in the learner's bus.curve_client_keys_dir"
                    if key else "The producer has no CURVE keys (bus.curve off, or no key files given) while the "
                    "learner's bus requires them: bus.curve must be the same on both sides")  # fmt: skip
            raise BusHandshakeError(
                f"bus: the security handshake with {self.cfg.connect_address} failed: "
                f"the learner's bus is there but does not take this producer's keys. {mine}. A run makes its own "
                "keys in <launch.run_dir>/bus_keys, or generate them with `python tools/bus_keygen.py`"
            )

    def _housekeeping(self, now: float) -> None:
        if not self.welcomed:
            # a Hello that went out gets time for its Welcome (a retry would obsolete it); a dropped one is retried
            wait = self.cfg.peer_timeout_s / 2 if self.hello_sent else self.cfg.heartbeat_s
            if now - self.last_hello >= wait:
                self._hello(now)
            return
        if now - self.last_heard > self.cfg.peer_timeout_s:
            silent = now - self.last_heard
            log.warning("bus: no answer from %s for %.1fs; reconnecting", self.cfg.connect_address, silent)
            self.counters.add("peer_timeouts")
            return self._hello(now)
        while self.inflight and not self._awaiting_receipt(self.inflight[0][1]):
            self.inflight.popleft()
        if self.inflight and now - self.inflight[0][0] > self.cfg.resend_after_s:
            self.counters.add("resend_timeouts")
            return self._hello(now)
        with self.outbox.cv:
            demand = self.sent + len(self.outbox.unsent)
            base = self.outbox.base()
            starts = self._starts_report()
            # a producer waiting for starts reports whatever changed at once (the receiver may grant on it)
            waiting = starts is not None and starts.wanted > self.outbox.starts.granted  # type: ignore[union-attr]
        starving = demand > self.reported_demand and self.sent >= self.granted  # tell the receiver at once
        waiting = waiting and starts != self.reported_starts
        if now - self.last_ping >= self.cfg.heartbeat_s or starving or waiting:
            self.last_ping = now
            self.reported_demand = demand
            self.reported_starts = starts
            self._send_control(protocol.Ping(base, demand, starts))
        return None

    def _starts_report(self) -> protocol.Starts | None:
        """Rollout admission (outbox lock held): the starts report, counting every trajectory not receipt-acked."""
        book = self.outbox.starts
        if book is None:
            return None
        return book.report(e.oldest for e in self.outbox.entries.values() if e.state != RECEIVED)

    def _awaiting_receipt(self, seq: int) -> bool:
        e = self.outbox.entries.get(seq)
        return e is not None and e.state == SENT

    def _hello(self, now: float) -> None:
        """(Re)open the session; whatever the answer, data waits for its Welcome."""
        self.welcomed = False
        self.session += 1
        self.last_hello = now
        self.last_heard = now  # the timeout restarts from this attempt
        with self.outbox.cv:
            base = self.outbox.base()
        hello = protocol.Hello(protocol.PROTOCOL_VERSION, self.session, self.worker_id, self.epoch, base, 0)
        self.hello_sent = self._send_control(hello)  # demand follows in a Ping right after the Welcome

    def _send_control(self, msg: protocol.ToReceiver) -> bool:
        try:
            self.sock.send(protocol.encode(msg), _NOBLOCK)
        except zmq.Again:
            self.counters.add("control_dropped")  # not connected yet (IMMEDIATE) or HWM: retried on the next tick
            return False
        return True

    # ---- incoming ----------------------------------------------------------------------------------------------

    def _drain(self) -> None:
        """Handle every message from the receiver that is there (poll said at least one)."""
        first = True
        while first or self.sock.getsockopt(_EVENTS) & _POLLIN:
            first = False
            parts = self.sock.recv_multipart()
            try:
                msg = protocol.decode_to_sender(parts[0]) if len(parts) == 1 else None
            except msgspec.DecodeError:
                msg = None
            if msg is None:
                self.counters.add("bad_replies")
                log.warning("bus: ignoring a malformed message from the receiver (%d frames)", len(parts))
                continue
            self.last_heard = time.monotonic()
            self._dispatch(msg)

    def _dispatch(self, msg: protocol.ToSender) -> None:
        if isinstance(msg, protocol.Commit):
            return self._on_commit(msg.low, msg.above)
        if isinstance(msg, protocol.Reject):
            return self._on_reject(msg)
        if isinstance(msg, protocol.Welcome):
            return self._on_welcome(msg)
        if isinstance(msg, protocol.Pong):
            if msg.incarnation != self.incarnation or not msg.known or msg.session != self.session:
                if self.welcomed:
                    self._hello(time.monotonic())  # receiver restarted or forgot us
                return None
            self.granted = max(self.granted, msg.granted)
            return self._on_starts(msg.starts_granted)
        assert isinstance(msg, protocol.Ack)
        if not self.welcomed or msg.session != self.session or msg.incarnation != self.incarnation:
            return None
        self.granted = max(self.granted, msg.granted)
        self._on_starts(msg.starts_granted)
        with self.outbox.cv:
            for seq in msg.seqs:
                e = self.outbox.entries.get(seq)
                if e is not None and e.state == SENT:
                    e.state = RECEIVED
                    if self.spool is not None:
                        self.outbox.drop_frames(e)  # it is on disk; reread only if it must be resent
            self.outbox.cv.notify_all()
        return None

    def _on_starts(self, granted: int) -> None:
        """Rollout admission: the receiver's cumulative grant (a restarted receiver starts again from our count)."""
        with self.outbox.cv:
            book = self.outbox.starts
            if book is not None and granted > book.granted:
                book.granted = granted
                self.outbox.cv.notify_all()

    def _on_welcome(self, msg: protocol.Welcome) -> None:
        if msg.proto != protocol.PROTOCOL_VERSION:
            raise ValueError(
                f"bus receiver at {self.cfg.connect_address} speaks protocol {msg.proto}, this producer "
                f"{protocol.PROTOCOL_VERSION}: run the same megatron-sao version on both sides"
            )
        if msg.session != self.session or self.welcomed:
            return
        new_receiver = msg.incarnation != self.incarnation
        if new_receiver and self.incarnation is not None:
            log.info("bus: receiver restarted (incarnation %s); resending everything uncommitted", msg.incarnation)
            self.counters.add("receiver_restarts")
        self.incarnation = msg.incarnation
        self.admits = msg.admits
        if new_receiver:
            with self.outbox.cv:
                if self.outbox.starts is not None:  # grants of a receiver that is gone are void
                    self.outbox.starts.granted = self.outbox.starts.used
        self._on_commit(msg.committed_low, msg.committed_above)
        with self.outbox.cv:
            for e in self.outbox.entries.values():
                if e.state == SENT or (new_receiver and e.state == RECEIVED):
                    e.state = UNSENT
            self.outbox.unsent = deque(s for s, e in self.outbox.entries.items() if e.state == UNSENT)
        self.inflight.clear()
        self.welcomed = True
        self.granted = msg.granted
        self.sent = 0
        self.reported_demand = 0
        self.reported_starts = None
        self.last_ping = -float("inf")  # report demand at once

    def _on_commit(self, low: int, above: list[int]) -> None:
        removed = []
        with self.outbox.cv:
            entries = self.outbox.entries
            while entries and (seq := next(iter(entries))) < low:
                removed.append(self.outbox.remove(seq))
            removed += [self.outbox.remove(seq) for seq in above]
            self.outbox.cv.notify_all()
        n = 0
        for e in removed:
            if e is not None:
                n += 1
                if self.spool is not None:
                    self.spool.delete(e.seq)
        self.counters.add("committed", n)

    def _on_reject(self, msg: protocol.Reject) -> None:
        with self.outbox.cv:
            e = self.outbox.remove(msg.seq)
            if e is not None:
                self.outbox.rejected.append((e.trajectory_id, msg.reason, msg.detail))
            self.outbox.cv.notify_all()
        if e is None:
            return
        if self.spool is not None:
            self.spool.delete(e.seq)
        self.counters.add("rejected")
        log.error("bus: receiver rejected trajectory %s (%s): %s", e.trajectory_id, msg.reason, msg.detail)

    # ---- outgoing data -----------------------------------------------------------------------------------------

    def _next_unsent(self) -> tuple[Entry, int, int] | None:
        with self.outbox.cv:
            while self.outbox.unsent:
                seq = self.outbox.unsent.popleft()
                e = self.outbox.entries.get(seq)
                if e is not None and e.state == UNSENT:
                    if len(self.outbox.unsent) + self.cfg.max_inflight // 2 < self.cfg.max_inflight:
                        self.outbox.cv.notify_all()  # a blocked send() resumes below half the queue
                    return e, self.outbox.base(), self.sent + 1 + len(self.outbox.unsent)
        return None

    def _send_data(self) -> None:
        while self.sent < self.granted:
            nxt = self._next_unsent()
            if nxt is None:
                return
            e, base, demand = nxt
            frames = e.frames
            if frames is None:
                frames = self._reload(e)
                if frames is None:
                    continue
            env = protocol.encode(protocol.Data(e.seq, base, demand))
            try:
                self.sock.send(env, _NOBLOCK | _SNDMORE)  # once the first part is taken, the rest is too
            except zmq.Again:
                with self.outbox.cv:
                    self.outbox.unsent.appendleft(e.seq)
                return
            send = self.sock.send
            for f in frames[:-1]:
                send(f, _SNDMORE, copy=False)
            send(frames[-1], 0, copy=False)
            now = time.monotonic()
            self.counters.add("resent" if e.sent_at else "sent")
            e.state, e.sent_at = SENT, now
            self.inflight.append((now, e.seq))
            self.sent += 1
            self.reported_demand = demand

    def _reload(self, e: Entry) -> list[bytes | memoryview] | None:
        assert self.spool is not None, "an entry without frames must be spooled"
        try:
            return self.spool.read(e.seq)  # type: ignore[return-value]
        except SpoolCorrupt as err:
            with self.outbox.cv:
                self.outbox.remove(e.seq)
                self.outbox.rejected.append((e.trajectory_id, "spool_corrupt", str(err)))
                self.outbox.cv.notify_all()
            self.counters.add("spool_corrupt")
            log.error("bus: trajectory %s lost: %s", e.trajectory_id, err)
            return None

"""The receiver's I/O thread: owns the ROUTER socket, checks every incoming frame, queues trajectories, acks.

Owned here: the socket loop, the limits and checks applied before anything reaches the learner (sizes, envelope,
session, credit, sequence window, codec.decode + validate), receipt acks and credits (via credits.py), episode
starts under rollout admission (via admission.py), commit acks to producers, and socket events (auth failures,
disconnects). Called only by receiver.py, which starts it and
talks to it through `Inbox` (the queue and the commit state) plus a wake-up socket. Nothing here raises on bad
input: every refusal is counted as rejected_<reason> and, when it names a seq, answered with a Reject.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from megatron_sao.bus import auth, codec, protocol
from megatron_sao.bus.admission import AdmissionBook
from megatron_sao.bus.credits import CreditBook, Session
from megatron_sao.bus.dedup import stream_key
from megatron_sao.bus.metrics import Counters
from megatron_sao.bus.protocol import Reason
from megatron_sao.bus.schema import Trajectory
from megatron_sao.config.bus import BusConfig

log = logging.getLogger(__name__)

# plain ints: operators on pyzmq's enum flags run Python code on every call
_EVENTS, _POLLIN, _NOBLOCK, _SNDMORE = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK), int(zmq.SNDMORE)
_DRAIN_BATCH = 256  # messages read per loop iteration before acks and credits go out
_ACK_BATCH = 32  # receipt acks sent together (credits are never held back)
_MAX_ENVELOPE_BYTES = protocol.MAX_ENVELOPE_BYTES
_Data, _decode_envelope, _monotonic = protocol.Data, protocol.decode_to_receiver, time.monotonic
_decode_payload = codec.decode
_MONITOR_EVENTS = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth_failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake_failed",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_failed",
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "connections",
    zmq.EVENT_DISCONNECTED: "disconnects",
}


@dataclass(slots=True)
class Item:
    """A checked trajectory waiting for the learner."""

    traj: Trajectory
    rid: bytes  # routing id of the connection it came on (its credit returns there)
    stream: str  # dedup.stream_key of its producer
    seq: int  # its sequence number in the stream
    base: int  # the producer's base when it was sent
    nbytes: int  # payload bytes (queue accounting)
    oldest: int = -1  # the lowest weight version of its action tokens (-1: none), for rollout admission


class Inbox:
    """What the learner thread and the I/O thread share; every field is guarded by `cv`."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.queue: deque[Item] = deque()
        self.queued_bytes = 0
        self.waiting_for = 0  # how many queued items the learner waits for (0: it is not waiting)
        self.freed: list[bytes] = []  # routing ids of the trajectories the learner took since the I/O thread looked
        self.committed: dict[str, tuple[int, tuple[int, ...]]] = {}  # stream -> (low, above): in a checkpoint
        self.dirty: set[str] = set()  # streams whose commit state changed and must be told
        self.latest_base: dict[str, int] = {}  # stream -> the producer's latest base (for dedup pruning)
        self.taken: tuple[int, int] = (-1, 0)  # (version, takes accepted at it towards its batch): rollout admission
        self.error: BaseException | None = None  # set when the I/O thread died
        self.stopping = False
        self.wake_pending = False


class ReceiverIO:
    """Binds at construction (errors surface in the caller), then serves from its own thread until stop()."""

    def __init__(
        self, cfg: BusConfig, counters: Counters, inbox: Inbox, admission: AdmissionBook | None = None
    ) -> None:
        self.cfg = cfg
        self.counters = counters
        self.inbox = inbox
        self.admission = admission
        self.incarnation = secrets.token_hex(8)
        self.limits = codec.Limits(cfg.max_frame_bytes, cfg.max_message_bytes, cfg.max_header_bytes)
        self.book = CreditBook(cfg.recv_queue_size, cfg.max_inflight)
        self._to_ack: dict[bytes, Session] = {}
        self._received = 0  # data messages queued since the counters were last updated
        self.ctx = zmq.Context()
        try:
            self._auth = auth.start_server_auth(self.ctx, cfg)
        except BaseException:
            self.ctx.term()  # nothing else was created yet
            raise
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # replies to vanished peers fail loudly (EHOSTUNREACH)
        self.router.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)  # libzmq drops larger frames unallocated
        self.router.setsockopt(zmq.RCVHWM, cfg.max_inflight + 64)  # per connection: credits + control traffic
        self.router.setsockopt(zmq.SNDHWM, 1024)
        self.router.setsockopt(zmq.LINGER, 0)
        auth.configure_server(self.router, cfg)
        try:
            self.router.bind(cfg.bind)
        except zmq.ZMQError as e:
            self._close_sockets()
            if self._auth is not None:
                self._auth.stop()
            self.ctx.term()
            raise ValueError(f"bus receiver cannot bind {cfg.bind} ({e}); choose a free address in bus.bind") from e
        if cfg.binds_every_interface and cfg.curve_server_key is None:
            log.warning(
                "bus: receiver listens on every interface (%s) without CURVE: anyone who reaches the port can send; "
                "bind one address or set bus.curve_server_key / bus.curve_client_keys_dir (tools/bus_keygen.py)",
                cfg.bind,
            )
        self.monitor = self.router.get_monitor_socket(sum(_MONITOR_EVENTS))
        wake_addr = f"inproc://sao-bus-wake-{self.incarnation}"
        self._wake_rx = self.ctx.socket(zmq.PAIR)
        self._wake_rx.bind(wake_addr)
        self._wake_tx = self.ctx.socket(zmq.PAIR)
        self._wake_tx.connect(wake_addr)
        self._wake_lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="sao-bus-receiver", daemon=True)

    # ---- learner thread ----------------------------------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def wake(self) -> None:
        """Make the I/O thread look at the inbox (freed slots, commits, stop); cheap when already pending."""
        with self.inbox.cv:
            if self.inbox.wake_pending:
                return
            self.inbox.wake_pending = True
        with self._wake_lock:
            self._wake_tx.send(b"")

    def stop(self, timeout_s: float = 5.0) -> None:
        with self.inbox.cv:
            self.inbox.stopping = True
        self.wake()
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise RuntimeError(f"bus receiver I/O thread did not stop within {timeout_s}s")
        self._wake_tx.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()

    # ---- I/O thread --------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as e:  # not hidden: logged, stored and re-raised on the learner thread by recv()
            log.exception("bus receiver I/O thread failed")
            with self.inbox.cv:
                self.inbox.error = e
                self.inbox.cv.notify_all()
        finally:
            self._close_sockets()

    def _close_sockets(self) -> None:
        for name in ("router", "monitor", "_wake_rx"):
            sock = getattr(self, name, None)
            if sock is not None and not sock.closed:
                if name == "router" and getattr(self, "monitor", None) is not None:
                    self.router.disable_monitor()
                sock.close(linger=0)

    def _loop(self) -> None:
        poller = zmq.Poller()
        for sock in (self.router, self._wake_rx, self.monitor):
            poller.register(sock, zmq.POLLIN)
        tick = min(self.cfg.heartbeat_s, self.cfg.resend_after_s / 4, 0.5)
        next_tick = time.monotonic() + tick
        while True:
            ready = dict(poller.poll(max(0.0, next_tick - time.monotonic()) * 1000))
            if self._wake_rx in ready and self._on_wake():
                return
            if self.router in ready:
                self._drain_router()
                if self._received:
                    self.counters.add("received", self._received)
                    self._received = 0
            if self.monitor in ready:
                self._drain_monitor()
            now = time.monotonic()
            tick_due = now >= next_tick
            if tick_due:
                self._take_freed()
                for s in self.book.expire(now, self.cfg.peer_timeout_s):
                    self.counters.add("sessions_expired")
                    self._to_ack.pop(s.rid, None)
                    if self.admission is not None:
                        self.admission.forget(s.stream)
                next_tick = now + tick
            self._grant_and_ack(force=tick_due)

    def _on_wake(self) -> bool:
        """Take freed slots and new commits from the inbox; True when asked to stop."""
        self._wake_rx.recv()  # exactly one: wake() sends only while wake_pending was False
        with self.inbox.cv:
            self.inbox.wake_pending = False
            freed, self.inbox.freed = self.inbox.freed, []
            dirty, self.inbox.dirty = self.inbox.dirty, set()
            committed = self.inbox.committed
            stopping = self.inbox.stopping
        self.book.freed(freed)
        for stream in dirty:
            rid = self.book.by_stream.get(stream)
            if rid is not None and stream in committed:
                low, above = committed[stream]
                self._send(rid, protocol.Commit(self.incarnation, low, list(above)))
        return stopping

    def _take_freed(self) -> None:
        with self.inbox.cv:
            freed, self.inbox.freed = self.inbox.freed, []
        self.book.freed(freed)

    def _grant_and_ack(self, force: bool) -> None:
        """Send credits at once; receipt acks alone wait for _ACK_BATCH of them or the next tick (force)."""
        allow = self.inbox.queued_bytes < self.cfg.recv_queue_bytes  # int read; a stale value only delays a grant
        for s in self.book.allocate(allow):
            self._to_ack[s.rid] = s
        self._grant_starts()
        if not self._to_ack:
            return
        pending, self._to_ack = self._to_ack, {}
        for rid, s in pending.items():
            if rid not in self.book.sessions:
                continue
            starts = self._starts_granted(s)
            if (s.granted != s.granted_sent or starts != s.starts_sent or len(s.acks) >= _ACK_BATCH
                    or (force and s.acks)):  # fmt: skip
                self._send(rid, protocol.Ack(self.incarnation, s.nonce, s.acks, s.granted, starts))
                s.acks = []
                s.granted_sent, s.starts_sent = s.granted, starts
            elif s.acks:
                self._to_ack[rid] = s

    def _grant_starts(self) -> None:
        """Rollout admission: grant the starts the rule allows now (admission.py); their sessions get an Ack."""
        if self.admission is None or not self.admission.producers:
            return
        with self.inbox.cv:
            queued = len(self.inbox.queue)
            oldest = min((i.oldest for i in self.inbox.queue if i.oldest >= 0), default=None)
            taken = self.inbox.taken
        for stream, _ in self.admission.grant(queued, oldest, taken):
            rid = self.book.by_stream.get(stream)
            s = self.book.sessions.get(rid) if rid is not None else None
            if s is not None:
                self._to_ack[rid] = s  # type: ignore[index]

    def _starts_granted(self, s: Session) -> int:
        return 0 if self.admission is None else self.admission.granted(s.stream)

    def _send(self, rid: bytes, msg: protocol.ToSender) -> None:
        try:
            self.router.send(rid, _NOBLOCK | _SNDMORE)
            self.router.send(protocol.encode(msg), _NOBLOCK)
        except zmq.Again:
            self.counters.add("control_dropped")  # peer not reading; all state is re-sent on its next ping
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self.book.close(rid)  # the connection is gone
            self.counters.add("peers_gone")

    def _drain_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            name = _MONITOR_EVENTS.get(event["event"])
            if name is not None:
                self.counters.add(name)

    def _drain_router(self) -> None:
        """Read up to _DRAIN_BATCH messages (poll said at least one is there).

        Per message: the routing id, then at most 1 + codec.NUM_PAYLOAD_FRAMES parts; past that frame count, or
        past the byte limit, the rest is read and dropped at once and the message is refused.
        """
        recv, getsockopt, handle = self.router.recv, self.router.getsockopt, self._handle
        max_parts = 1 + codec.NUM_PAYLOAD_FRAMES
        max_total = self.cfg.max_message_bytes + protocol.MAX_ENVELOPE_BYTES
        for i in range(_DRAIN_BATCH):
            if i and not getsockopt(_EVENTS) & _POLLIN:  # cheaper than catching zmq.Again
                return
            head = recv(0, False)
            more = head.more
            frames: list[zmq.Frame] = []
            while more and len(frames) < max_parts:
                part = recv(0, False)
                frames.append(part)
                more = part.more
            early: Reason | None = None
            if more or (frames and sum(map(len, frames)) > max_total):
                early = Reason.MESSAGE_TOO_LARGE if sum(map(len, frames)) > max_total else Reason.FRAME_COUNT
                del frames[1:]  # keep the envelope (to name the seq in the Reject), free the payload
                while more:
                    more = recv(0, False).more
            handle(head.bytes, frames, early)

    def _reject(self, reason: Reason, detail: str, rid: bytes | None = None, seq: int | None = None) -> None:
        self.counters.add("rejected")
        self.counters.add(f"rejected_{reason.value}")
        log.debug("bus: rejected a message (%s): %s", reason.value, detail)
        if rid is not None and seq is not None:
            self._send(rid, protocol.Reject(self.incarnation, seq, reason.value, detail[:500]))

    def _handle(self, rid: bytes, frames: list[zmq.Frame], early: Reason | None) -> None:
        if not frames:
            return self._reject(Reason.MALFORMED, "message without an envelope frame")
        if len(frames[0]) > _MAX_ENVELOPE_BYTES:
            return self._reject(Reason.FRAME_TOO_LARGE, f"envelope of {len(frames[0])} bytes")
        try:
            env = _decode_envelope(frames[0])
        except msgspec.DecodeError as e:
            return self._reject(Reason.MALFORMED, f"envelope: {e}")
        s = self.book.sessions.get(rid)
        if s is not None:
            s.last_seen = _monotonic()
        if type(env) is _Data:
            return self._on_data(rid, s, env, frames[1:], early)  # type: ignore[arg-type]
        if len(frames) != 1 or early is not None:
            return self._reject(Reason.PROTOCOL, f"{type(env).__name__} with {len(frames) - 1} extra frames")
        if isinstance(env, protocol.Hello):
            return self._on_hello(rid, env)
        if isinstance(env, protocol.Ping):
            return self._on_ping(rid, s, env)
        assert isinstance(env, protocol.Bye)
        if s is not None:
            self._set_latest_base(s.stream, env.base)
            self.book.close(rid)
            self._to_ack.pop(rid, None)
            if self.admission is not None:
                self.admission.forget(s.stream)
        return None

    def _set_latest_base(self, stream: str, base: int) -> None:
        with self.inbox.cv:
            self.inbox.latest_base[stream] = base

    def _on_hello(self, rid: bytes, env: protocol.Hello) -> None:
        if env.proto != protocol.PROTOCOL_VERSION:
            self._reject(Reason.PROTOCOL, f"producer speaks protocol {env.proto}")
            return self._send(rid, protocol.Welcome(protocol.PROTOCOL_VERSION, env.session, self.incarnation, 0, [], 0))
        stream = stream_key(env.worker_id, env.epoch)
        old = self.book.by_stream.get(stream)
        if old is not None and old != rid:
            self._to_ack.pop(old, None)
        self.book.open(rid, stream, env.worker_id, env.demand, time.monotonic()).nonce = env.session
        self._to_ack.pop(rid, None)
        with self.inbox.cv:
            self.inbox.latest_base[stream] = env.base
            low, above = self.inbox.committed.get(stream, (0, ()))
        self.counters.add("hellos")
        above_base = [a for a in above if a >= env.base]
        welcome = protocol.Welcome(protocol.PROTOCOL_VERSION, env.session, self.incarnation, low, above_base, 0,
                                   self.admission is not None)  # fmt: skip
        return self._send(rid, welcome)

    def _on_ping(self, rid: bytes, s: Session | None, env: protocol.Ping) -> None:
        if s is None:
            return self._send(rid, protocol.Pong(self.incarnation, -1, False, 0))
        self.book.update_demand(s, env.demand)
        if env.starts is not None and self.admission is not None:
            self.admission.report(s.stream, rid, env.starts)
            self._grant_starts()
        with self.inbox.cv:
            self.inbox.latest_base[s.stream] = env.base
            low, above = self.inbox.committed.get(s.stream, (0, ()))
        starts = self._starts_granted(s)
        self._send(rid, protocol.Pong(self.incarnation, s.nonce, True, s.granted, starts))
        s.granted_sent, s.starts_sent = s.granted, starts
        if low > env.base:  # the producer missed a commit (e.g. a dropped control message): say it again
            self._send(rid, protocol.Commit(self.incarnation, low, list(above)))
        return None

    def _on_data(
        self, rid: bytes, s: Session | None, env: protocol.Data, payload: list[zmq.Frame], early: Reason | None
    ) -> None:
        if s is None:
            self._reject(Reason.NO_SESSION, f"data seq {env.seq} from a connection without Hello")
            return self._send(rid, protocol.Pong(self.incarnation, -1, False, 0))
        book, seq, base = self.book, env.seq, env.base
        book.update_demand(s, env.demand)
        if not book.on_data(s):
            return self._reject(Reason.NO_CREDIT, f"{s.worker_id} sent seq {seq} beyond its credits")
        if early is not None:
            return self._reject(early, f"seq {seq} refused while reading frames", rid, seq)
        if not base <= seq < base + self.cfg.max_uncommitted:
            detail = f"seq {seq} outside [base {base}, base + max_uncommitted {self.cfg.max_uncommitted})"
            return self._reject(Reason.PROTOCOL, detail, rid, seq)
        try:
            traj, nbytes = _decode_payload(payload, self.limits)
        except codec.FrameError as e:
            return self._reject(e.reason, e.detail, rid, seq)
        inbox = self.inbox
        oldest = None
        if self.admission is not None:
            oldest = traj.extras["oldest_version"] = traj.oldest_version()  # the staleness gate reads it too
        with inbox.cv:
            inbox.queue.append(Item(traj, rid, s.stream, seq, base, nbytes, -1 if oldest is None else oldest))
            inbox.queued_bytes += nbytes
            if 0 < inbox.waiting_for <= len(inbox.queue):
                inbox.cv.notify()
        book.enqueued(s)
        s.acks.append(seq)
        self._to_ack[rid] = s
        self._received += 1  # added to the counters once per drained batch
        return None

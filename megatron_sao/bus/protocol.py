"""Control messages of the bus protocol: the msgpack envelope that is frame 0 of every bus message.

Owned here: every message kind, its fields, and how an envelope is encoded/decoded (tagged msgspec union).
Called by sender.py and receiver_io.py; the frames that follow a `Data` envelope are codec.py's business.
The protocol (sessions, credits, receipt vs commit acks) is described in docs/bus.md.
"""

from __future__ import annotations

import enum

import msgspec

PROTOCOL_VERSION = 1
"""Bump on any incompatible change to the messages below; peers with another version are refused."""


class Reason(enum.StrEnum):
    """Why the receiver refused a message; each has a `rejected_<reason>` counter."""

    MALFORMED = "malformed"  # envelope or header frame is not valid msgpack of the expected struct
    SCHEMA_VERSION = "schema_version"  # header.schema_version != SCHEMA_VERSION
    PROTOCOL = "protocol"  # wrong protocol version, unexpected message kind, or sequence number out of window
    FRAME_COUNT = "frame_count"  # a data message without exactly one header frame and one frame per array
    FRAME_TOO_LARGE = "frame_too_large"  # one frame over max_frame_bytes (or the header over max_header_bytes)
    MESSAGE_TOO_LARGE = "message_too_large"  # all frames together over max_message_bytes
    ARRAY_SIZE = "array_size"  # an array frame's length is not num_tokens * itemsize
    INVALID = "invalid"  # decoded fine but Trajectory.validate() failed (inconsistent values)
    ROUTES = "routes"  # MoE routes that disagree with header.routes (frame size) or name impossible experts
    NO_SESSION = "no_session"  # data or ping from a connection that never said Hello (e.g. after a restart)
    NO_CREDIT = "no_credit"  # data beyond the credits the receiver granted


# ---- producer -> learner ----------------------------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """Opens a session on this connection; resets both sides' credit counters for it."""

    proto: int  # PROTOCOL_VERSION of the producer
    session: int  # producer-chosen session number, echoed in Welcome/Pong/Ack (stale answers are ignored)
    worker_id: str  # the producer's worker id
    epoch: str  # stream incarnation: persisted in the spool, random per process without one
    base: int  # every sequence number below it is committed or abandoned: the producer never sends it again
    demand: int  # cumulative count of data messages the producer wants to send in this session


class Starts(msgspec.Struct, frozen=True):
    """A producer's episode starts under rollout admission (bus/admission.py): what it asks for and what it holds.
    Counters are cumulative over the producer process, so a new session or a restarted receiver picks them up."""

    wanted: int  # starts asked for: those made plus those the producer could make now
    used: int  # starts made, each under a grant
    held: int  # trajectories started that the receiver may not hold: running, or sent and not receipt-acked
    oldest: int  # lowest weight version among them (a running episode counts its engines' version at its start) and,
    # while it wants starts, its engines' version now; -1: none


class Ping(msgspec.Struct, tag="ping", frozen=True):
    """Heartbeat and credit request; with rollout admission, the producer's starts."""

    base: int  # as in Hello
    demand: int  # as in Hello (sent messages + messages waiting for credit)
    starts: Starts | None = None  # None: the producer starts episodes without asking


class Data(msgspec.Struct, tag="data", frozen=True):
    """Frame 0 of a trajectory message; the header and array frames follow (codec.py)."""

    seq: int  # per-stream sequence number, increasing by send() order; the de-dup key with the stream
    base: int  # as in Hello
    demand: int  # as in Hello, counting this message


class Bye(msgspec.Struct, tag="bye", frozen=True):
    """The producer closes; the receiver reclaims the session's credits at once."""

    base: int  # as in Hello


# ---- learner -> producer ----------------------------------------------------------------------------------------


class Welcome(msgspec.Struct, tag="welcome", frozen=True):
    """Answer to Hello: who the receiver is and what of this stream is already committed."""

    proto: int  # PROTOCOL_VERSION of the receiver
    session: int  # the Hello's session number
    incarnation: str  # random per receiver process; a new value means: resend everything not committed
    committed_low: int  # every seq below it is committed
    committed_above: list[int]  # committed seqs at or above committed_low
    granted: int  # cumulative credits granted in this session
    admits: bool = False  # the receiver grants episode starts (rollout admission): ask before starting one


class Pong(msgspec.Struct, tag="pong", frozen=True):
    """Answer to Ping (and to anything from a connection without a session)."""

    incarnation: str  # as in Welcome
    session: int  # the session number the receiver knows for this connection (-1 when not known)
    known: bool  # False: the receiver has no session for this connection -> say Hello again
    granted: int  # cumulative credits granted in this session (0 when not known)
    starts_granted: int = 0  # rollout admission: cumulative starts granted to the producer (Starts.used counts them)


class Ack(msgspec.Struct, tag="ack", frozen=True):
    """Receipt acknowledgements (flow control) and credits; says nothing about durability."""

    incarnation: str  # as in Welcome
    session: int  # as in Welcome
    seqs: list[int]  # sequence numbers that arrived intact and were queued for the learner
    granted: int  # cumulative credits granted in this session
    starts_granted: int = 0  # as in Pong


class Commit(msgspec.Struct, tag="commit", frozen=True):
    """Durability: these seqs are in a learner checkpoint; the producer may forget (unspool) them."""

    incarnation: str  # as in Welcome
    low: int  # every seq below it is committed
    above: list[int]  # committed seqs at or above low


class Reject(msgspec.Struct, tag="reject", frozen=True):
    """A data message the receiver will never accept (the producer drops it and logs the reason)."""

    incarnation: str  # as in Welcome
    seq: int  # the refused sequence number
    reason: str  # a Reason value
    detail: str  # human-readable explanation


ToReceiver = Hello | Ping | Data | Bye
ToSender = Welcome | Pong | Ack | Commit | Reject

_ENCODER = msgspec.msgpack.Encoder()
_TO_RECEIVER = msgspec.msgpack.Decoder(ToReceiver)
_TO_SENDER = msgspec.msgpack.Decoder(ToSender)

MAX_ENVELOPE_BYTES = 1 << 20
"""Largest accepted envelope frame (a Commit lists at most max_uncommitted seqs)."""


def encode(msg: ToReceiver | ToSender) -> bytes:
    return _ENCODER.encode(msg)


def decode_to_receiver(buf: memoryview | bytes) -> ToReceiver:
    """Raises msgspec.DecodeError (incl. ValidationError) on anything but a well-formed producer message."""
    return _TO_RECEIVER.decode(buf)


def decode_to_sender(buf: memoryview | bytes) -> ToSender:
    """Raises msgspec.DecodeError (incl. ValidationError) on anything but a well-formed receiver message."""
    return _TO_SENDER.decode(buf)

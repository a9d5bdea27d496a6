"""`bus` section: the ZeroMQ trajectory bus between rollout workers and the learner.

Read by megatron_sao.bus (sender, receiver, auth); the protocol these knobs steer is described in docs/bus.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from megatron_sao.config.base import Section

_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")


class BusConfig(Section):
    bind: str = "tcp://127.0.0.1:5555"
    """Address the learner's receiver binds (explicit interface; never 0.0.0.0 by default). Binding every interface
    (tcp://0.0.0.0:PORT, tcp://*:PORT) is allowed but logs a warning unless CURVE is on."""

    connect: str | None = None
    """Address producers connect to; None uses `bind`."""

    max_inflight: int = Field(default=64, ge=1)
    """Credits: trajectories one producer may have sent but the learner not yet taken (back-pressure)."""

    recv_queue_size: int = Field(default=256, ge=1)
    """Receiver-wide credits: trajectories queued in the learner process plus credits granted and not yet used."""

    recv_queue_bytes: int = Field(default=4 << 30, gt=0)
    """No new credits are granted while the learner's queue holds more than this many payload bytes."""

    max_uncommitted: int = Field(default=65536, ge=1)
    """Per producer: trajectories sent but not yet covered by a learner checkpoint (commit); send() blocks at it.
    Also bounds the receiver's de-duplication window per producer."""

    max_uncommitted_bytes: int = Field(default=2 << 30, gt=0)
    """Per producer without a spool: payload bytes kept in memory until committed; send() blocks at it.
    With spool_dir set, committed-pending payloads live on disk and only in-flight ones stay in memory."""

    max_message_bytes: int = Field(default=256 << 20, gt=0)
    """Largest accepted trajectory message, all frames together (128k tokens take ~1.7 MB)."""

    max_frame_bytes: int = Field(default=128 << 20, gt=0)
    """Largest accepted single frame; frames over max_message_bytes are refused by libzmq before allocation."""

    max_header_bytes: int = Field(default=1 << 20, gt=0)
    """Largest accepted msgpack header frame (ids, turns, metadata)."""

    validate_on_send: bool = False
    """Producer: run the full Trajectory.validate() (O(T) passes over the arrays) in send(). Off by default: the
    agent loop validates every trajectory it builds and the receiver validates every arrival (refusals come back to
    the producer as errors); send() always checks ids, dtypes, lengths, turn ranges and size limits."""

    spool_dir: str | None = None
    """Producer-side directory keeping uncommitted trajectories across producer restarts (one subdir per worker), so
    a trajectory sent but not yet in a learner checkpoint survives a crash and a clean finish alike (it is resent to
    the next run, exactly once as training sees it). Left unset in a run's config: <launch.run_dir>/spool; null: no
    spool (what is not committed when a worker stops is lost, and counted)."""

    spool_fsync: bool = False
    """fsync each spool file: survives machine crashes, not only process crashes (slower)."""

    resend_after_s: float = Field(default=10.0, gt=0.0)
    """Restart the session (and resend) when a sent trajectory has no receipt acknowledgement within this time."""

    heartbeat_s: float = Field(default=1.0, gt=0.0)
    """Producers ping the receiver this often; the receiver answers with credits and commits."""

    peer_timeout_s: float = Field(default=10.0, gt=0.0)
    """Silence after which either side declares the other gone (producer: reconnect and resend; receiver: reclaim
    the producer's credits). Must exceed heartbeat_s."""

    producer_wait_s: float = Field(default=900.0, ge=0.0)
    """The learner gives up, exiting non-zero with a message naming the bus address, when it waits for a batch and no
    rollout worker has been connected for this long (they died, never started, or dial another address). 0: wait
    for ever."""

    dedup_recent_ids: int = Field(default=65536, ge=0)
    """Receiver: remember this many recently consumed trajectory ids (saved with checkpoints) to drop an id that
    comes back under a new sequence number; 0 disables (per-producer sequence numbers still de-duplicate)."""

    max_streams: int = Field(default=65536, ge=1)
    """Receiver: producer streams kept in the de-dup state; fully committed idle streams are forgotten first."""

    max_staleness: int | None = Field(default=None, ge=0)
    """Largest allowed gap, in weight versions, between the learner and a trajectory's oldest token."""

    stale_policy: Literal["drop", "keep"] = "drop"
    """What to do with trajectories over max_staleness (both are counted and recorded by id). With `admission` none
    started under it goes over; what still does (started before a learner restart, or by a producer that does not
    ask) meets this policy."""

    admission: bool = True
    """Rollout admission (bus/admission.py, docs/bus.md): with max_staleness set, the streaming arms start an episode
    only while it can be trained within max_staleness versions of its oldest token, so nothing is generated to be
    dropped as stale; the learner grants the starts over the bus. false: episodes start freely and those over the
    bound meet stale_policy. Group arms (grpo, grpo_async) bound their batches by the rollout's batch gate instead."""

    stale_log_dir: str | None = None
    """Directory of `stale.jsonl`: one line per trajectory over max_staleness (dropped or kept). Left unset in a run's
    config: <launch.run_dir> (the trajectory ledger's check reads it); null: not written."""

    stale_recent_ids: int = Field(default=1024, ge=0)
    """How many recent over-stale trajectory ids the receiver keeps in memory (receiver.stale_ids())."""

    curve: bool = True
    """Authenticate the bus with CurveZMQ (encrypted; only producers holding an authorized key get in). With no
    curve_* key file given, a run makes its own keys in curve_keys_dir (default <launch.run_dir>/bus_keys, owner-only)
    when its first role starts, and every role reads them there (a shared run dir on a cluster). false: any process
    that reaches bus.bind can send trajectories that will be trained (a warning says so)."""

    curve_keys_dir: str | None = None
    """Where the run's own CURVE keys are made and read (set to <launch.run_dir>/bus_keys when bus.curve is on and no
    curve_* key file is given); None: the key files below are used as given."""

    curve_server_key: str | None = None
    """CurveZMQ: the server's secret key file; set with curve_client_keys_dir to require authentication."""

    curve_client_keys_dir: str | None = None
    """CurveZMQ: directory of authorized client public keys."""

    curve_server_public_key: str | None = None
    """CurveZMQ, producer side: the server's public key file (tools/bus_keygen.py writes it)."""

    curve_client_key: str | None = None
    """CurveZMQ, producer side: this producer's secret key file."""

    @property
    def connect_address(self) -> str:
        """Where producers connect."""
        return self.connect or self.bind

    @property
    def binds_every_interface(self) -> bool:
        host = self.bind.removeprefix("tcp://").rsplit(":", 1)[0] if self.bind.startswith("tcp://") else ""
        return host in _WILDCARD_HOSTS

    @property
    def curve_enabled(self) -> bool:
        return self.curve_server_key is not None or self.curve_server_public_key is not None

    @model_validator(mode="after")
    def _check(self) -> BusConfig:
        for name in ("bind", "connect"):
            addr = getattr(self, name)
            if addr is not None and not addr.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"bus.{name}={addr!r}: use tcp://HOST:PORT, ipc://PATH or inproc://NAME")
        if self.max_frame_bytes > self.max_message_bytes:
            raise ValueError("bus.max_frame_bytes exceeds bus.max_message_bytes; lower it to at most max_message_bytes")
        if self.max_header_bytes > self.max_frame_bytes:
            raise ValueError("bus.max_header_bytes exceeds bus.max_frame_bytes; lower it")
        if self.peer_timeout_s <= 2 * self.heartbeat_s:
            raise ValueError(
                f"bus.peer_timeout_s={self.peer_timeout_s} must exceed 2 * heartbeat_s={self.heartbeat_s}; "
                "raise peer_timeout_s or lower heartbeat_s"
            )
        if (self.curve_server_key is None) != (self.curve_client_keys_dir is None):
            raise ValueError(
                "bus.curve_server_key and bus.curve_client_keys_dir go together (receiver side of CURVE: its secret "
                "key and the directory of authorized client public keys); set both or neither"
            )
        if (self.curve_server_public_key is None) != (self.curve_client_key is None):
            raise ValueError(
                "bus.curve_server_public_key and bus.curve_client_key go together (producer side of CURVE); "
                "set both or neither"
            )
        if not self.curve and (self.curve_enabled or self.curve_keys_dir is not None):
            raise ValueError("bus.curve=false but CURVE key files are given (bus.curve_*): set bus.curve=true to use "
                             "them, or drop them for an unauthenticated bus")  # fmt: skip
        return self

    def with_run_keys(self, run_dir: str) -> None:
        """bus.curve with no key file given: the run's own keys under curve_keys_dir (default <run_dir>/bus_keys);
        bus/auth.py ensure_run_keys makes them."""
        if not self.curve or self.curve_enabled:
            return
        keys = Path(self.curve_keys_dir or Path(run_dir) / "bus_keys")
        filled = {"curve_keys_dir": str(keys), "curve_server_key": str(keys / "server.key_secret"),
                  "curve_client_keys_dir": str(keys / "clients"), "curve_server_public_key": str(keys / "server.key"),
                  "curve_client_key": str(keys / "client.key_secret")}  # fmt: skip
        self.__dict__.update(filled)  # together: the pairwise checks hold for the whole set, not each assignment

"""The protocol between the two learner jobs of a critic on its own ranks (config.roles.Jobs.value): the messages,
the value job's side (ValueJob: its learner answering requests) and the policy job's client of it (RemoteCritic).
run/critic.py starts and stops the value job's process; run/learn.py's Steps drive RemoteCritic.

The value job (`python -m megatron_sao critic CONFIG --bridge tcp://HOST:PORT`, every rank; torchrun for more than
one) is a torch.distributed world of its own with the critic's layout (learner.value_parallel, else `parallel`) and
only the value model. The policy job (`learn`) holds only the policy and drives it over a bridge between the two
rank 0s (distributed/bridge.py), one request at a time, replies in order:

    policy job (RemoteCritic)                   value job (serve)
    Begin(checkpoint or None)          ->       load the value checkpoint of the same step, or the HF weights
                                       <-       Ready
    Work(batch, version)               ->       values_old, GAE
                                       <-       Advantages (per trajectory)       the policy updates now, and pushes,
                                                K critic updates                  while the critic trains
                                       <-       Done(critic metrics)
    Work(batch, pretrain=True)         ->       values, K critic updates (value pre-training: no advantages)
                                       <-       Done
    Save(name)                         ->       checkpoint <save_dir>/value/<name>    (before the policy's own, so a
                                       <-       Saved                                  policy checkpoint always has its
    Stop                               ->       exit                                   critic)

So a learner step costs values + max(policy update + push, K critic updates) instead of values + K critic updates +
policy update. With a look-ahead (run/learn.py `Steps`) the policy job sends the next step's batch as soon as it
has this step's advantages, when a whole batch is already waiting on the bus: the value job starts on it the
moment its K updates of this step end, so its values are ready when the policy's update ends and a step costs
max(policy update + push, K critic updates). Two requests are then in flight; the value job still answers them in
order, and the policy job reads the replies of each in turn. Inside each job, rank 0 shares what crossed the bridge
with its other ranks. An error in the value job travels back as Failed and is raised in the policy job with the
value job's message.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from megatron_sao.bus.schema import Trajectory
from megatron_sao.config.roles import POLICY_DIR, VALUE_DIR
from megatron_sao.config.tree import SAOConfig
from megatron_sao.distributed.bootstrap import DistContext
from megatron_sao.distributed.bridge import Bridge
from megatron_sao.distributed.collectives import gather_to_rank0, share
from megatron_sao.learner.errors import NonFiniteTraining

log = logging.getLogger(__name__)

BRIDGE_TIMEOUT_S = 3600.0
"""How long either job waits on the other (a step of a large critic, a checkpoint); a dead peer fails at once."""


# ---------------------------------------------------------------------------------------------- the wire messages


class Begin(msgspec.Struct, tag="begin", frozen=True):
    checkpoint: str | None  # the policy job's checkpoint it resumed from (the critic loads its own of that step)


class Work(msgspec.Struct, tag="work", frozen=True):
    seq: int
    version: int  # the policy version before this step (staleness, checkpoints)
    pretrain: bool  # value pre-training: critic updates only, no advantages sent
    trajectories: list[list[bytes]]  # the bus's wire encoding, one frame list per trajectory


class Save(msgspec.Struct, tag="save", frozen=True):
    seq: int
    name: str  # iter_<version> or pretrain_<step>: the policy job's checkpoint of the same moment


class Stop(msgspec.Struct, tag="stop", frozen=True):
    pass


class Ready(msgspec.Struct, tag="ready", frozen=True):
    version: int


class Advantages(msgspec.Struct, tag="advantages", frozen=True):
    seq: int
    ids: list[str]
    lengths: list[int]  # positions per trajectory (T - 1); `values` holds them back to back
    values: bytes  # float32, little-endian


class Done(msgspec.Struct, tag="done", frozen=True):
    seq: int
    metrics: dict[str, float]
    first_values: dict[str, float] = {}  # each trajectory's value at its first action token (the ledger's)


class Saved(msgspec.Struct, tag="saved", frozen=True):
    seq: int
    path: str


class Failed(msgspec.Struct, tag="failed", frozen=True):
    error: str  # the value job's message
    kind: str  # its exception's class name


Request = Begin | Work | Save | Stop
Reply = Ready | Advantages | Done | Saved | Failed
_REQUESTS = msgspec.msgpack.Decoder(Request)
_REPLIES = msgspec.msgpack.Decoder(Reply)
_ENCODER = msgspec.msgpack.Encoder()


class CriticJobError(RuntimeError):
    """The value job failed, or what it sent does not fit; the message says what happened there."""


def value_job_config(cfg: SAOConfig) -> SAOConfig:
    """The config the value job runs with: `parallel` is the critic's layout (config.roles: learner.value_parallel,
    else the policy's). ValueError when the run has no value job."""
    job = cfg.jobs.value
    if job is None:
        raise ValueError("the value job runs only with learner.value_on_separate_ranks=true")
    return cfg.model_copy(update={"parallel": job.parallel})


def _encode_batch(trajectories: Sequence[Trajectory]) -> list[list[bytes]]:
    from megatron_sao.bus.codec import encode

    return [[bytes(f) for f in encode(t)] for t in trajectories]


def _decode_batch(frames: list[list[bytes]], cfg: SAOConfig) -> list[Trajectory]:
    from megatron_sao.bus.codec import Limits, decode

    b = cfg.bus
    limits = Limits(b.max_frame_bytes, b.max_message_bytes, b.max_header_bytes)
    return [decode(f, limits)[0] for f in frames]


# ------------------------------------------------------------------------------------------------- the value job


class ValueJob:
    """Every rank of the value job: its learner (value role only) and, on rank 0, its end of the bridge. `cfg`:
    value_job_config's; `layout`: what init_distributed returned for it (run/critic.py starts both)."""

    def __init__(self, cfg: SAOConfig, bridge: Bridge | None, layout: DistContext) -> None:
        from megatron_sao.learner.learner import Learner

        self.cfg, self.bridge = cfg, bridge
        self.learner = Learner(cfg, roles={"value"}, layout=layout)

    def serve(self) -> None:
        """Answer the policy job until it says Stop; an error is sent back (Failed) and raised here."""
        while True:
            msg = self.recv()
            try:
                if isinstance(msg, Stop):
                    return
                {Begin: self.begin, Work: self.work, Save: self.save}[type(msg)](msg)
            except Exception as e:
                self.reply(Failed(str(e), type(e).__name__))
                raise

    def close(self) -> None:
        """Its end of the bridge (rank 0); the world stays (run/critic.py tears it down)."""
        if self.bridge is not None:
            self.bridge.close()
            self.bridge = None

    def recv(self) -> Request:
        msg = _REQUESTS.decode(self.bridge.recv()) if self.bridge is not None else None
        return share(msg)

    def reply(self, msg: Reply) -> None:
        """Posted: the value job goes on (to its next update, or to a batch handed over ahead) while the policy job
        is still busy with its own update and has not come for the reply yet. An error waits until it is received."""
        if self.bridge is not None:
            (self.bridge.send if isinstance(msg, Failed) else self.bridge.post)(_ENCODER.encode(msg))

    def begin(self, msg: Begin) -> None:
        from megatron_sao.learner.checkpoint import load_checkpoint

        if msg.checkpoint is None:
            if not self.cfg.model.hf_path:
                raise ValueError("model.hf_path is not set and the policy job resumed from no checkpoint")
            self.learner.load_hf(self.cfg.model.hf_path)
        else:
            load_checkpoint(self.learner, critic_checkpoint(Path(msg.checkpoint)))
        self.reply(Ready(self.learner.version))

    def work(self, msg: Work) -> None:
        trajectories = _decode_batch(msg.trajectories, self.cfg)
        self.learner.version = msg.version
        t0 = time.monotonic()

        def publish(local: dict[str, np.ndarray]) -> None:
            merged = gather_to_rank0(local)
            if merged is not None and not msg.pretrain:
                ids = sorted(merged)
                arrays = [np.ascontiguousarray(merged[i], dtype="<f4") for i in ids]
                values = np.concatenate(arrays).tobytes() if arrays else b""
                self.reply(Advantages(msg.seq, ids, [int(a.size) for a in arrays], values))

        metrics = self.learner.critic_step(trajectories, publish, update_version=not msg.pretrain)
        metrics["time/critic"] = time.monotonic() - t0
        self.reply(Done(msg.seq, metrics, self.learner.first_values))

    def save(self, msg: Save) -> None:
        from megatron_sao.learner.checkpoint import checkpoint_dir, save_checkpoint

        path = save_checkpoint(self.learner, checkpoint_dir(self.cfg), tag=msg.name)
        self.reply(Saved(msg.seq, str(path)))


def critic_checkpoint(policy_checkpoint: Path) -> Path:
    """The value job's checkpoint of the step a policy job's checkpoint holds: the sibling under <save_dir>/value for
    one of a policy job (<save_dir>/policy/<name>), or that checkpoint itself for one of a learner that held both
    models. CriticJobError naming the path when it is missing."""
    if policy_checkpoint.parent.name == POLICY_DIR:
        path = policy_checkpoint.parent.parent / VALUE_DIR / policy_checkpoint.name
        if not (path / "metadata.json").is_file():
            raise CriticJobError(f"the policy job resumed from {policy_checkpoint} but {path} holds no value "
                                 "checkpoint of that step: restore it, or set learner.load to a step both "
                                 "have")  # fmt: skip
        return path
    return policy_checkpoint


# --------------------------------------------------------------------------------------- the policy job's client


class RemoteCritic:
    """The policy job's handle on the value job; every method is collective over the policy job (rank 0 talks over
    the bridge, the others get what it got)."""

    def __init__(self, cfg: SAOConfig, address: str, layout: DistContext) -> None:
        """Collective over the policy job; `layout`: its DistContext (rank 0 hosts the bridge at `address`)."""
        self.cfg = cfg
        rank0 = layout.is_rank0
        if rank0:
            print(f"[learner] waiting for the value job on {address}", flush=True)
        self.bridge = Bridge.open(address, host=True, timeout_s=BRIDGE_TIMEOUT_S) if rank0 else None
        self.seq = 0
        # the submitted Work requests whose Advantages / Done are still to be read, oldest first
        self._advantages_due: deque[int] = deque()
        self._done_due: deque[int] = deque()
        self.first_values: dict[str, float] = {}  # of the last step's Done

    def _send(self, msg: Request, wait: bool = True) -> None:
        if self.bridge is not None:
            (self.bridge.send if wait else self.bridge.post)(_ENCODER.encode(msg))

    def _expect(self, kind: type, seq: int | None = None) -> Any:
        """Rank 0: the next reply, which must be a `kind` (for request `seq`); the value job's error raised here."""
        assert self.bridge is not None
        reply = _REPLIES.decode(self.bridge.recv())
        if isinstance(reply, Failed):
            error = NonFiniteTraining if reply.kind == "NonFiniteTraining" else CriticJobError
            raise error(f"the value job failed: {reply.error}")
        if not isinstance(reply, kind) or (seq is not None and reply.seq != seq):
            raise CriticJobError(f"the value job sent {reply!r} where a {kind.__name__} for request {seq} was due")
        return reply

    def _collective(self, kind: type, seq: int | None = None) -> Any:
        """The reply on every rank; an error on rank 0 is raised on every rank."""
        got: Any = None
        if self.bridge is not None:
            try:
                got = self._expect(kind, seq)
            except Exception as e:
                got = e
        got = share(got if not isinstance(got, Exception) else ("error", type(got).__name__, str(got)))
        if isinstance(got, tuple) and got[:1] == ("error",):
            raise (NonFiniteTraining if got[1] == "NonFiniteTraining" else CriticJobError)(got[2])
        return got

    def begin(self, checkpoint: Path | None) -> int:
        """The value job loads the critic of `checkpoint`'s step (None: the HF weights); returns its version."""
        self._send(Begin(str(checkpoint) if checkpoint is not None else None))
        return int(self._collective(Ready).version)

    def submit(self, trajectories: Sequence[Trajectory], version: int, pretrain: bool = False) -> None:
        """Send a step's batch (rank 0; the others have the same list) without waiting for the value job to take
        it: it may still be training on the one before. Replies, in submission order: advantages (unless
        `pretrain`), then metrics."""
        self.seq += 1
        self._send(Work(self.seq, version, pretrain, _encode_batch(trajectories) if self.bridge else []), wait=False)
        if not pretrain:
            self._advantages_due.append(self.seq)
        self._done_due.append(self.seq)

    def advantages(self) -> dict[str, np.ndarray]:
        """The oldest submitted step's advantages by trajectory id (float32 [T - 1] each), on every rank."""
        if not self._advantages_due:
            raise CriticJobError("advantages asked for with no policy step submitted to the value job")
        by_id: dict[str, np.ndarray] | None = None
        reply = self._collective(Advantages, self._advantages_due.popleft())
        flat = np.frombuffer(reply.values, dtype="<f4")
        if len(reply.ids) != len(reply.lengths) or sum(reply.lengths) != flat.size:
            raise CriticJobError("the value job's advantages: ids, lengths and values disagree")
        by_id, offset = {}, 0
        for traj_id, n in zip(reply.ids, reply.lengths):
            by_id[traj_id] = flat[offset : offset + n].astype(np.float32)
            offset += n
        return by_id

    def metrics(self) -> dict[str, float]:
        """The oldest submitted step's critic metrics, once its K updates are done (its advantages read first)."""
        if not self._done_due:
            raise CriticJobError("critic metrics asked for with no step submitted to the value job")
        if self._advantages_due and self._advantages_due[0] == self._done_due[0]:
            raise CriticJobError(f"the metrics of request {self._done_due[0]} asked for before its advantages")
        done = self._collective(Done, self._done_due.popleft())
        self.first_values = dict(done.first_values)
        return dict(done.metrics)

    def save(self, name: str) -> str:
        """The value job checkpoints under <save_dir>/value/<name>; its path. Only with no step in flight: the
        checkpoint must hold the critic of the policy's step."""
        if self._done_due:
            raise CriticJobError(f"a checkpoint asked for with {len(self._done_due)} critic step(s) in flight (the "
                                 "value job would save a critic ahead of the policy)")  # fmt: skip
        self.seq += 1
        self._send(Save(self.seq, name))
        return str(self._collective(Saved, self.seq).path)

    def close(self) -> None:
        if self.bridge is not None:
            try:
                # the replies the value job still owes (a step cut short by an error here): read them, or its
                # sends would wait for this end forever and it would never take the Stop
                for _ in range(len(self._advantages_due) + len(self._done_due)):
                    self.bridge.recv()
                self._send(Stop())
            except Exception as e:  # the value job may be gone already
                log.warning("telling the value job to stop: %r", e)
            self.bridge.close()
            self.bridge = None

"""In-place weight updates of the embedded engine: its update process groups, SGLang's weight-update session, receiving
the tensors the trainer broadcasts, validating them against the model, staging them and committing a whole push at
once (owned by embedded/; called by embedded/server.py for the HTTP endpoints; scheduler.py copies a commit in between
two decode steps).

Protocol (SGLang's; the rules of the SGLang release in `ServerProtocol`, engines/protocol.py):
- `/init_weights_update_group` makes this engine rank `rank_offset` of a `world_size` group whose rank 0 is one
  trainer rank; several named groups may coexist (one per learner pipeline stage).
- `/update_weights_from_distributed` lists `names`, `dtypes`, `shapes`; the trainer then broadcasts each tensor from
  rank 0 in that order, or, with `load_format="flattened_bucket"`, one uint8 buffer holding them all
  (distributed/flat_bucket.py).
- One weight-control request at a time, whatever its group, in arrival order: SGLang's tokenizer manager holds its
  model-update lock (or, while paused, its pause condition) until the scheduler's one thread has joined the group,
  received the update, or opened / closed the session (`serial`). So two update groups' requests reach this
  engine one after the other, and a trainer whose stages reach two engines in different orders hangs here as it
  would on SGLang. (Generation, unlike on SGLang, goes on while an update is received: it is staged.)
- What SGLang refuses before receiving, this engine refuses before receiving too (the trainer's broadcast then has
  nobody to meet: it must time out): an update outside a session (0.5.21+), a flattened bucket with an unaligned
  offset, an unknown group or load format. What SGLang receives and then fails to load (a name the model does not
  have, a shape or dtype that differs), this engine receives (drains) and then refuses.
- Staging (sessions, i.e. SGLang >= 0.5.21): between `/begin_weight_update` and `/end_weight_update` every update is
  received into a staging area, the live model untouched; `end` commits all staged tensors and the session's
  weight_version at ONE token boundary. A session in which any update failed is discarded at `end`; so is an open
  session when one of the groups it received from is destroyed or a new group is initialized (a trainer that lost
  its connection starts over). The engine keeps serving the previous weights and version until a commit.
- A trainer that dies mid-push cannot continue the engine it paused: when a broadcast fails mid-way, or a session
  sees no update for `--weight-session-timeout` seconds, the push is discarded and the engine resumes generating
  on its intact previous weights. (A real SGLang server stays paused: its weights may be partially updated.)
- Without a session (emulating SGLang < 0.5.21) each update is applied on arrival, as SGLang does.
- At --tp-size > 1 (embedded/tp.py) rank 0's updater mirrors every weight-control request onto the other ranks inside
  its model-update lock (one order on every rank), each rank receives the full tensors into its own staging and keeps
  the elements it holds at the commit; a refusal on any rank refuses the request, and a push refused anywhere is
  dropped everywhere (`drop_pending`).
- `load_format="sharded_bucket"` (this engine's own; `/weight_shards` tells the trainer each rank's blocks): each rank
  receives only its blocks and the replicated tensors, one buffer broadcast over its **block group** -- the
  trainer and the ranks of every engine in the group that hold the same blocks (rank r of each engine at one TP
  size), named by `block_groups` at `/init_weights_update_group`. One broadcast per distinct set of blocks, not one
  send per engine rank: the trainer sends each byte once, as a full-tensor broadcast does.
- Deltas (this engine's and the push agent's own `delta` field, engines/protocol.DeltaHeader; sessions only): a
  flat bucket may arrive as only what changed against the **base** of that bucket -- the bytes the same request
  (its load format and names) carried at the last push that kept one. The base is copied, the changes written in
  (distributed/delta.py), and the result checked against the sender's digest before it is staged like any bucket;
  a delta against a version this rank holds no base of, or one that decodes to other bytes, is received (drained)
  and refused, which fails the session. What a `keep` update results in becomes the bucket's base when the session
  commits (all bases then carry its version, /server_info's `weight_delta_base`); a commit that kept none drops
  them (the engine's weights moved past them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_sao.distributed import delta as deltas
from megatron_sao.distributed import flat_bucket, tensor_payload
from megatron_sao.distributed.update_group import block_group_name, destroy_update_group, init_update_group
from megatron_sao.engines.protocol import SHARDED_BUCKET, DeltaHeader, ServerProtocol, version_to_int
from megatron_sao.models.mapping import Target, on_disk_names, resolve_in_memory

if TYPE_CHECKING:
    from megatron_sao.engines.embedded.model_runner import Fp8Weights
    from megatron_sao.engines.embedded.tp import LocalShards, Peers

log = logging.getLogger(__name__)

TENSOR_ROUTE = "update_weights_from_tensor"
"""What the traffic record and a session's groups call the updates of /update_weights_from_tensor."""
GROUP_TIMEOUT_S = 300.0
"""Joining a group and each broadcast give up after this long (the trainer must join / send within it)."""
FLATTENED_BUCKET = "flattened_bucket"


class WeightUpdateError(ValueError):
    """A weight-update request the engine refused; the message says what to fix on the trainer side."""


def _new_traffic() -> dict[str, Any]:
    """What an update group carried (the engine's /server_info shows it): tensors, bytes (as they travelled: a
    delta's, not the bucket it rebuilt), names, receives now."""
    return {"tensors": 0, "bytes": 0, "names": [], "receiving": 0}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return flat_bucket.dtype_from_name(name)
    except ValueError as e:
        raise WeightUpdateError(str(e)) from None


@dataclass
class ReceivedUpdate:
    """Tensors received from the trainer, validated, to be copied in at a token boundary (views into `buffers`)."""

    targets: list[Target]
    tensors: list[torch.Tensor]
    weight_version: str | None
    buffers: list[torch.Tensor] = field(default_factory=list)
    boxes: list[bool] = field(default_factory=list)  # per tensor: only this rank's block of it (sharded_bucket)

    def is_box(self, i: int) -> bool:
        return bool(self.boxes) and self.boxes[i]


@dataclass
class Session:
    """An open weight-update session: what it staged, which groups it received from, whether an update failed."""

    staged: dict[str, tuple[Target, torch.Tensor, bool]] = field(default_factory=dict)  # HF name -> (target,
    # tensor, whether it is only this rank's block)
    weight_version: str | None = None
    groups: set[str] = field(default_factory=set)
    failure: str | None = None
    last_activity: float = field(default_factory=time.monotonic)
    buffers: list[torch.Tensor] = field(default_factory=list)  # what the staged tensors live in
    receiving: int = 0  # updates announced to this session whose bytes are still arriving
    loaded: int = 0  # updates loaded into the live model at their call (an engine that loads in place)
    kept: dict[tuple[str, ...], tuple[torch.Tensor, Any]] = field(default_factory=dict)  # bucket key -> its bytes
    # and their fingerprint: the next bases

    def commit(self) -> ReceivedUpdate:
        staged = list(self.staged.values())
        return ReceivedUpdate([t for t, _, _ in staged], [x for _, x, _ in staged], self.weight_version, self.buffers,
                              [b for _, _, b in staged])  # fmt: skip


class WeightUpdater:
    """`on_orphaned(reason)` is called when a push can no longer be finished by the trainer that started it (its
    broadcast failed mid-way, or its session sat idle for `session_timeout_s`): the staged push is discarded, and
    the engine, whose weights are intact, may resume serving them (server.py does)."""

    device = torch.device("cpu")
    backends: tuple[str, ...] = ("gloo",)  # what update groups this receiver joins over (the CPU: gloo)

    def __init__(self, model: torch.nn.Module | dict[str, torch.Tensor], protocol: ServerProtocol,
                 session_timeout_s: float = GROUP_TIMEOUT_S,
                 on_orphaned: Callable[[str], None] | None = None, fp8: Fp8Weights | None = None,
                 peers: Peers | None = None, tp_rank: int = 0) -> None:  # fmt: skip
        from megatron_sao.engines.embedded.tp import LocalShards

        self.session_timeout_s = session_timeout_s
        self.on_orphaned = on_orphaned or (lambda reason: None)
        # share storage with the model (a push agent passes its table of meta tensors instead: it holds no model)
        self.tensors: dict[str, torch.Tensor] = dict(model) if isinstance(model, dict) else dict(model.state_dict())
        # tensor parallelism: the parameters split over the ranks stand here as meta tensors of their global shape
        # (what updates are checked against); their elements are written and read through `shards`
        self.shards: LocalShards = LocalShards(self.tensors)
        self._boxes: dict[str, flat_bucket.Box | None] = {}  # on-disk name -> this rank's block of it (box_of)
        self.tensors.update({k: self.shards.meta(k) for k in self.shards.params})
        self.peers, self.tp_rank = peers, tp_rank
        # a block-FP8 checkpoint: its FP8 weights and scales (HF names) are what this engine holds and receives
        self.fp8 = fp8
        if fp8 is not None:
            self.tensors.update(fp8.tensors)
        self.protocol = protocol
        self.groups: dict[str, Any] = {}  # group name -> the update process group (distributed/update_group.py)
        self.block_groups: dict[str, Any] = {}  # group name -> this rank's block group in it (sharded_bucket)
        self.serial = threading.Lock()  # SGLang's model-update lock: one weight-control request at a time
        self._lock = threading.Lock()  # guards groups, the session and the traffic record (taken inside serial)
        self.order: list[str] = []  # the group of every update received, in the order the receives began
        self.session: Session | None = None
        self.traffic: dict[str, dict[str, Any]] = {}  # group name -> what it carried (tensors, bytes, names)
        # receive buffers of committed or discarded pushes, by size, for the next push (fresh host memory costs its
        # page faults on first touch, several times the copy): at most one model's worth is kept
        self._spare: dict[int, list[torch.Tensor]] = {}
        self._spare_limit = sum(t.nbytes for t in self.tensors.values())
        # weight deltas: each bucket's bytes at the last commit that kept them (its key: load format and names)
        self.bases: dict[tuple[str, ...], torch.Tensor] = {}
        self.base_fps: dict[tuple[str, ...], deltas.Fingerprint] = {}
        self.base_version: int | None = None
        self.dirtied_by: Session | None = None  # the session that wrote deltas into the bases and has not committed
        self.parts: dict[str, int] = {}  # group name -> the block part this rank receives (0: full buckets)

    # ---- the weight-control requests, one at a time (SGLang's model-update lock) ---------------------------------
    def init_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str,
        block_groups: list[list[int]] | None = None,
    ) -> str:  # fmt: skip
        """Join update group `group_name` as rank `rank_offset` (blocks until every rank has joined), and the block
        group of `block_groups` that holds this rank, if given (see _init_group)."""
        with self.serial:
            args = dict(master_address=master_address, master_port=master_port, rank_offset=rank_offset,
                        world_size=world_size, group_name=group_name, backend=backend,
                        block_groups=block_groups)  # fmt: skip
            return self._mirrored("init_group", args, lambda: self._init_group(**args))

    def destroy_group(self, group_name: str) -> str:
        with self.serial:
            return self._mirrored("destroy_group", {"group_name": group_name}, lambda: self._destroy_group(group_name))

    def begin(self) -> str:
        with self.serial:
            return self._mirrored("begin", {}, self._begin)

    def end(self) -> tuple[ReceivedUpdate | None, str]:
        """Close the session: the update to commit (None: nothing to commit, or discarded) and a message."""
        with self.serial:
            return self._mirrored("end", {}, self._end)

    def _mirrored(self, command: str, kwargs: dict[str, Any], local: Callable[[], Any]) -> Any:
        """Run a weight-control request here and, at --tp-size > 1, on every other rank at the same time (the caller
        holds the model-update lock, so all ranks see one order). Refused on any rank: refused, and what the other
        ranks received for the push is dropped with it."""
        if self.peers is None:
            return local()
        from megatron_sao.engines.embedded.tp import refusals

        self.peers.send("weights", command, **kwargs)
        try:
            out = local()
        except Exception:
            self.peers.collect("weights")
            self.peers.call("weights", "drop_pending")
            raise
        refused = refusals(self.peers.collect("weights"))
        if refused is None:
            return out
        if command == "end" and out[0] is not None:
            self.recycle(out[0].buffers)
        self.peers.call("weights", "drop_pending")
        raise WeightUpdateError(refused)

    # ---- process groups -----------------------------------------------------------------------------------------
    def _init_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str,
        block_groups: list[list[int]] | None = None,
    ) -> str:  # fmt: skip
        """Join update group `group_name` as rank `rank_offset` (blocks until every rank has joined). `block_groups`
        (for load_format sharded_bucket): the group's engine ranks partitioned by the blocks they hold; this rank
        also joins the sub-group of its own part (`block_group_name`: rank 0 the trainer rank that broadcasts that
        part, the part's ranks 1.. in the order given), over which it receives its blocks by broadcast."""
        if backend not in self.backends:
            raise WeightUpdateError(f"backend={backend!r}: this receiver runs on {self.device}; use backend "
                                    f"{' or '.join(map(repr, self.backends))}")  # fmt: skip
        if not group_name:
            raise WeightUpdateError("Group name cannot be empty")
        if not 0 < rank_offset < world_size:
            raise WeightUpdateError(
                f"rank_offset={rank_offset} must be in [1, world_size={world_size}) (rank 0 is the trainer)"
            )
        part = _block_part(block_groups, rank_offset, world_size) if block_groups is not None else None
        with self._lock:
            stale = self.groups.pop(group_name, None)  # SGLang replaces a group of the same name (a new trainer)
            stale_blocks = self.block_groups.pop(group_name, None)
            self._discard_session(f"a new update group {group_name!r} is being initialized")
        if stale is not None:
            log.warning("update group %r is replaced by a new one of the same name", group_name)
            _drop_groups(group_name, stale, stale_blocks)
        try:
            group = init_update_group(
                backend, master_address, master_port, world_size, rank_offset, group_name, GROUP_TIMEOUT_S
            )
        except (RuntimeError, ValueError) as e:  # the trainer never came, or the store refused us
            raise WeightUpdateError(
                f"could not join update group {group_name!r} at {master_address}:{master_port}: {e}"
            ) from e
        blocks = None
        if part is not None:
            index, ranks = part
            try:
                blocks = init_update_group(backend, master_address, master_port, len(ranks) + 1,
                                           ranks.index(rank_offset) + 1, block_group_name(group_name, index),
                                           GROUP_TIMEOUT_S)  # fmt: skip
            except (RuntimeError, ValueError) as e:
                _drop_groups(group_name, group, None)
                raise WeightUpdateError(f"could not join the block group {index} of update group {group_name!r} at "
                                        f"{master_address}:{master_port}: {e}") from e  # fmt: skip
        with self._lock:
            self.groups[group_name] = group
            self.parts[group_name] = part[0] if part is not None else 0
            if blocks is not None:
                self.block_groups[group_name] = blocks
            self.traffic[group_name] = _new_traffic()
        joined = f" and its block group {part[0]} ({len(part[1])} engine ranks)" if part is not None else ""
        return f"joined update group {group_name!r} as rank {rank_offset} of {world_size}{joined}"

    def _destroy_group(self, group_name: str) -> str:
        with self._lock:
            if group_name not in self.groups:
                raise WeightUpdateError("The group to be destroyed does not exist.")
            group = self.groups.pop(group_name)
            blocks = self.block_groups.pop(group_name, None)
            if self.session is not None and group_name in self.session.groups:
                self._discard_session(f"update group {group_name!r} it received from was destroyed")
        if blocks is not None:
            destroy_update_group(blocks)
        destroy_update_group(group)
        return f"destroyed update group {group_name!r}"

    # ---- the session (SGLang >= 0.5.21) -------------------------------------------------------------------------
    def _begin(self) -> str:
        with self._lock:
            if self.session is not None:
                raise WeightUpdateError("a weight-update session is already open; call end_weight_update() first")
            self.session = Session()
        return "Success"

    def _end(self) -> tuple[ReceivedUpdate | None, str]:
        """Close the session: the update to commit (None: nothing to commit, or discarded) and a message."""
        with self._lock:
            session, self.session = self.session, None
        if session is None:
            raise WeightUpdateError("no weight-update session is open; call begin_weight_update() first")
        if session.failure is None and session.receiving:
            session.failure = (f"{session.receiving} update(s) announced to the session were still receiving when "
                               "it ended")  # fmt: skip
        if session.failure is not None:
            with self._lock:
                self._drop_dirty_bases()
            self.recycle(session.buffers)
            if session.loaded:  # SGLang's state after a failed push: the model holds what loaded before the failure
                raise WeightUpdateError(f"session failed after {session.loaded} update(s) loaded in place: the engine "
                                        f"is partially updated (send a complete push): {session.failure}")  # fmt: skip
            raise WeightUpdateError(f"session discarded, model unchanged: {session.failure}")
        if not session.staged and session.weight_version is None:
            return None, f"Success ({session.loaded} updates loaded in place)" if session.loaded else \
                "Success (nothing staged)"  # fmt: skip
        self._rebase(session)
        return session.commit(), f"Success: committed {len(session.staged)} tensors"

    def _rebase(self, session: Session) -> None:
        """A committing session's kept buckets become the bases, under its version; a commit that kept none drops
        the bases (the weights moved past them). The old bases' buffers go back to the spares."""
        with self._lock:
            old = list(self.bases.values())
            keep = session.kept if session.kept and session.weight_version is not None else {}
            self.bases = {k: buffer for k, (buffer, _) in keep.items()}
            self.base_fps = {k: fp for k, (_, fp) in keep.items()}
            self.base_version = version_to_int(session.weight_version) if keep else None
            self.dirtied_by = None
            self._keep([b for b in old if all(b is not k for k in self.bases.values())])

    def _drop_dirty_bases(self) -> None:
        """A session that wrote deltas into the bases ended without committing: they hold neither version, so they
        go (the engine reports no base; the trainer's next push is whole). Caller holds the lock."""
        if self.dirtied_by is None:
            return
        log.warning("weight deltas: a session that wrote into the bases did not commit; the bases are dropped (the "
                    "next push comes whole)")  # fmt: skip
        old = list(self.bases.values())
        self.bases, self.base_fps, self.base_version, self.dirtied_by = {}, {}, None, None
        self._keep(old)

    @property
    def delta_base(self) -> int | None:
        """The weight version this rank's bases hold (what a delta may be taken against), or None."""
        return self.base_version if self.bases and self.dirtied_by is None else None

    def fail_session(self, reason: str) -> None:
        """Mark the open session failed (its commit is refused at end); no-op without one."""
        with self._lock:
            if self.session is not None and self.session.failure is None:
                self.session.failure = reason

    def expire_idle_session(self) -> bool:
        """Discard a session no update touched for session_timeout_s (its trainer is gone); True when one was."""
        with self._lock:
            session = self.session
            idle = session is not None and time.monotonic() - session.last_activity >= self.session_timeout_s
            if session is None or session.receiving or not idle:
                return False  # a session receiving an update is not idle: its trainer is sending
            why = f"no update for {self.session_timeout_s:.0f}s: the trainer that began it is gone"
            self._discard_session(why)
        if self.peers is not None:
            with self.serial:
                self.peers.call("weights", "discard", why=why)
        self.on_orphaned("the weight-update session sat idle past its timeout")
        return True

    def discard(self, why: str) -> None:
        """Drop the open session, if any (another rank's updater told to, at --tp-size > 1)."""
        with self._lock:
            self._discard_session(why)

    def _discard_session(self, why: str) -> None:
        """Drop an open session and its staging (caller holds the lock)."""
        if self.session is not None:
            log.warning("weight update session discarded (%d tensors staged): %s", len(self.session.staged), why)
            buffers, self.session = self.session.buffers, None
            self._drop_dirty_bases()
            self._keep(buffers)

    # ---- receiving ----------------------------------------------------------------------------------------------
    def receive(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None,
        load_format: str | None = None,
        delta: dict[str, Any] | None = None,
    ) -> ReceivedUpdate:
        """Receive one update's broadcast(s) from the trainer. Refuses before receiving what SGLang refuses before
        receiving; refuses after receiving (drained) what does not fit the model. With sessions (SGLang >= 0.5.21)
        the update is staged in the session open when it was announced, and any refusal fails that session: a
        session commits only if every update announced to it arrived complete and fit. A session discarded while
        this update was receiving (its group destroyed, a new group, idle expiry) takes the update with it: nothing
        received after a discard ever reaches the live model. Without sessions the caller applies the update."""
        args = dict(names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, weight_version=weight_version,
                    load_format=load_format, delta=delta)  # fmt: skip
        return self._session_update("update_weights_from_distributed", "receive",
                                    args, lambda session: self._receive(session, **args))  # fmt: skip

    def _session_update(self, route: str, command: str, args: dict[str, Any],
                        run: Callable[[Session | None], ReceivedUpdate]) -> ReceivedUpdate:  # fmt: skip
        """One update request (`route`, mirrored to the other ranks as `command`) announced to the session open now,
        refused outside one (SGLang >= 0.5.21, its words); a refusal fails that session."""
        with self._lock:
            session = self.session
            if session is not None:  # announced now: an `end` that gets the serial lock first refuses the session
                session.receiving += 1
                session.last_activity = time.monotonic()
        if self.protocol.session and session is None:
            raise WeightUpdateError(f"{route} must run between begin_weight_update() and end_weight_update()")
        staging = session if self.protocol.staged else None  # in place: the caller applies it within the call
        try:
            with self.serial:
                update = self._mirrored(command, args, lambda: run(staging))
            if session is not None and staging is None:
                session.loaded += 1
            return update
        except WeightUpdateError as e:
            if session is not None:
                self._fail(session, str(e))
            raise
        finally:
            if session is not None:
                with self._lock:
                    session.receiving -= 1

    def _receive(
        self,
        session: Session | None,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None,
        load_format: str | None,
        delta: dict[str, Any] | None = None,
    ) -> ReceivedUpdate:
        if load_format not in (None, "auto", FLATTENED_BUCKET, SHARDED_BUCKET):
            raise WeightUpdateError(f"load_format={load_format!r}: use null (one tensor per broadcast), "
                                    f"{FLATTENED_BUCKET!r} or {SHARDED_BUCKET!r}")  # fmt: skip
        if load_format in (FLATTENED_BUCKET, SHARDED_BUCKET) and not self.protocol.flattened_bucket:
            raise WeightUpdateError(
                f"load_format={load_format!r} needs SGLang >= 0.5.6 (this engine follows {self.protocol.version})"
            )
        with self._lock:
            group = self.groups.get(group_name)
            blocks = self.block_groups.get(group_name)
        if group is None:
            raise WeightUpdateError(
                f"Group {group_name} not in {sorted(self.groups)}. Please call `init_weights_update_group` first."
            )
        if load_format == SHARDED_BUCKET:
            if blocks is None:
                raise WeightUpdateError(f"load_format={SHARDED_BUCKET!r} over {group_name!r}: the group was joined "
                                        "without block_groups, so this rank has no block group to receive its "
                                        "blocks over (pass block_groups to /init_weights_update_group)")  # fmt: skip
            group = blocks
        parsed = [parse_dtype(d) for d in dtypes]  # an unknown dtype cannot even be drained: fail before receiving
        if not len(names) == len(parsed) == len(shapes):
            raise WeightUpdateError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(parsed)}/{len(shapes)}")
        problems: list[str] = []
        targets: list[Target] = []
        for name, dtype, shape in zip(names, parsed, shapes):
            problem, target = self._check(name, dtype, tuple(shape))
            if problem:
                problems.append(problem)
            targets.append(target)
        # sharded_bucket: this rank's block of every tensor it holds split (as /weight_shards told the trainer)
        boxes = [load_format == SHARDED_BUCKET and self.box_of(n) is not None for n in names]
        received_shapes = [list(self.box_of(n)[1]) if b else s for n, s, b in zip(names, shapes, boxes)]  # type: ignore[index]
        room = [torch.Size(s).numel() * d.itemsize if b else self._room(n, d, s)
                for n, d, s, b in zip(names, parsed, received_shapes, boxes)]  # fmt: skip
        slots = None
        if load_format in (FLATTENED_BUCKET, SHARDED_BUCKET):
            try:
                slots = flat_bucket.layout(names, parsed, received_shapes)
            except ValueError as e:
                raise WeightUpdateError(f"Failed to receive weights: {e}") from None
        header, part = self._delta_header(delta, load_format, group_name, slots)
        with self._lock:
            self._traffic(group_name)["receiving"] += 1
            self.order.append(group_name)
        wire: int | None = None
        try:
            if header is None:
                received, buffers = self._broadcasts(group, parsed, shapes, slots, room)
            else:
                assert slots is not None and part is not None
                key = (str(load_format), *names)
                received, buffers, problem, wire, fp = self._receive_delta(group, slots, header, part, key, session)
                problems += [problem] if problem else []
        except RuntimeError as e:  # the trainer died or timed out mid-broadcast
            reason = f"receiving over {group_name!r} failed: {e}"
            if session is not None:
                self._fail(session, reason)
            self.on_orphaned(reason)
            raise WeightUpdateError(f"Failed to receive weights over {group_name!r}: {e}") from e
        finally:
            with self._lock:
                self._traffic(group_name)["receiving"] -= 1
        self._record(group_name, names, received, wire)
        if problems:
            self.recycle(buffers)
            shown = "; ".join(problems[:8]) + (f"; ... {len(problems) - 8} more" if len(problems) > 8 else "")
            raise WeightUpdateError(f"update rejected, model unchanged: {shown}")
        update = ReceivedUpdate(targets, received, weight_version, buffers, boxes)
        if session is not None:
            self._stage(session, update, names, group_name)
            if header is not None and header.keep:
                with self._lock:
                    session.kept[(str(load_format), *names)] = (buffers[0], fp)
        return update

    def _delta_header(self, raw: dict[str, Any] | None, load_format: str | None, group_name: str,
                      slots: list[flat_bucket.Slot] | None) -> tuple[DeltaHeader | None, Any]:  # fmt: skip
        """The `delta` field parsed and this rank's part of it; refused before receiving when it cannot apply."""
        if raw is None:
            return None, None
        if not self.protocol.deltas:
            raise WeightUpdateError(f"the delta field needs weight-update sessions (SGLang >= 0.5.21 rules); this "
                                    f"engine follows {self.protocol.version}")  # fmt: skip
        if slots is None:
            raise WeightUpdateError("a delta travels as one flat bucket: send load_format 'flattened_bucket' or "
                                    f"{SHARDED_BUCKET!r}, not {load_format!r}")  # fmt: skip
        try:
            header = DeltaHeader.from_json(raw)
            part = header.part(self.parts.get(group_name, 0) if load_format == SHARDED_BUCKET else 0)
            unit = deltas.bucket_unit(slots)
            if header.base is not None and part.unit != unit:
                raise ValueError(f"a delta in units of {part.unit} bytes; this bucket's unit is {unit} (its smallest "
                                 "itemsize)")  # fmt: skip
            units = flat_bucket.nbytes(slots) // unit
            deltas.payload_bytes(part.encoding, units, part.count, unit)  # type: ignore[arg-type]
        except (ValueError, deltas.DeltaError) as e:
            raise WeightUpdateError(f"Failed to receive weights: {e}") from None
        return header, part

    def _receive_delta(
        self, group: Any, slots: list[flat_bucket.Slot], header: DeltaHeader, part: Any, key: tuple[str, ...],
        session: Session | None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], str | None, int, deltas.Fingerprint | None]:  # fmt: skip
        """Receive one part's payload and rebuild the full bucket from this rank's base: (its tensors, [its buffer],
        why it cannot be loaded or None, the payload's bytes, the bucket's fingerprint when it is to be kept). The
        payload is always drained, so the sender's broadcast completes."""
        size, unit = flat_bucket.nbytes(slots), deltas.bucket_unit(slots)
        wire = self._land(group, deltas.payload_bytes(part.encoding, size // unit, part.count, unit))  # type: ignore[arg-type]
        fp: deltas.Fingerprint | None = None
        if part.encoding == "full":
            out, problem = wire, None
            fp = deltas.fingerprint(out, unit) if header.keep else None
        else:
            with self._lock:
                base, base_fp = self.bases.get(key), self.base_fps.get(key)
                held = self.base_version if self.dirtied_by in (None, session) else None
            out, problem = base, None  # the delta is written into the base itself: no copy of the bucket
            if base is None or base_fp is None or held != header.base:
                have = "no base of this bucket" if base is None else f"its base at version {held}"
                problem = (f"a delta against version {header.base} reached a rank holding {have}: nothing of it is "
                           "loaded; the trainer must send this engine a full push")  # fmt: skip
            else:
                with self._lock:
                    self.dirtied_by = session  # until it commits, the bases hold part of another version
                try:
                    fp = deltas.apply(base, part.encoding, part.count, unit, wire, base_fp)  # type: ignore[arg-type]
                    if fp is None or deltas.fingerprint_hex(fp) != part.digest:
                        problem = (f"a delta against version {header.base} decoded to other bytes than the "
                                   "trainer's (fingerprint differs): this rank's base is not the trainer's; send a "
                                   "full push")  # fmt: skip
                except deltas.DeltaError as e:
                    problem = f"a delta that does not fit its bucket: {e}"
            self.recycle([wire])
            if out is None:  # no base to write into: what was drained goes back
                return [], [], problem, wire.nbytes, None
        return [flat_bucket.view(out, s) for s in slots], [out], problem, wire.nbytes, fp

    def receive_tensors(self, entries: list[str], load_format: str | None,
                        weight_version: str | None) -> ReceivedUpdate:  # fmt: skip
        """SGLang's /update_weights_from_tensor on this rank: open entry `tp_rank` of `entries` and stage (or, without
        sessions, return for applying) what it names. Refused before anything changes: outside a session (SGLang's
        words), an unknown load format, no entry for this rank, a payload the safe unpickler blocks or that does not
        fit the model (a name it lacks; a shape other than the full tensor's, or with "direct" this rank's block).
        SGLang's scheduler dies on the last three instead of answering 400: a sender checks before it sends."""
        args = dict(entries=entries, load_format=load_format, weight_version=weight_version)
        return self._session_update(TENSOR_ROUTE, "receive_tensors", args,
                                    lambda session: self._receive_tensors(session, **args))  # fmt: skip

    def _receive_tensors(self, session: Session | None, entries: list[str], load_format: str | None,
                         weight_version: str | None) -> ReceivedUpdate:  # fmt: skip
        if load_format not in (None, "direct", FLATTENED_BUCKET):
            raise WeightUpdateError(f"Unknown load_format={load_format}")
        if self.tp_rank >= len(entries):
            raise WeightUpdateError(f"serialized_named_tensors has {len(entries)} entries; TP rank {self.tp_rank} "
                                    "opens its own (send one per TP rank)")  # fmt: skip
        try:
            pairs = tensor_payload.named_tensors(tensor_payload.open_entry(entries[self.tp_rank]), load_format)
        except tensor_payload.PayloadError as e:
            raise WeightUpdateError(str(e)) from None
        direct = load_format == "direct"
        problems, targets, boxes = [], [], []
        for name, tensor in pairs:
            box = self.box_of(name) if direct else None
            problem, target = self._check(name, tensor.dtype, tuple(tensor.shape) if box is None else None)
            if problem is None and box is not None and tuple(tensor.shape) != tuple(box[1]):
                problem = f"{name}: shape {list(tensor.shape)} != this rank's block {list(box[1])} (load_format direct)"
            if problem:
                problems.append(problem)
            targets.append(target)
            boxes.append(box is not None)
        if problems:
            shown = "; ".join(problems[:8]) + (f"; ... {len(problems) - 8} more" if len(problems) > 8 else "")
            raise WeightUpdateError(f"update rejected, model unchanged: {shown}")
        names = [n for n, _ in pairs]
        if session is None:  # applied before the call returns (no session, or loading in place): the one copy is
            update = ReceivedUpdate(targets, [t.detach() for _, t in pairs], weight_version, [], boxes)  # the load's
            self._record(TENSOR_ROUTE, names, update.tensors)
            return update
        # staged: the sender's memory is lent for the call only, so copied into receive buffers (those of past
        # pushes, recycled) and switched in at the session's end
        buffers = [self._buffer(t.nbytes) for _, t in pairs]
        tensors = [b.view(t.dtype).view(t.shape).copy_(t.detach()) for b, (_, t) in zip(buffers, pairs)]
        self._record(TENSOR_ROUTE, names, tensors)
        update = ReceivedUpdate(targets, tensors, weight_version, buffers, boxes)
        self._stage(session, update, names, TENSOR_ROUTE)
        return update

    def _room(self, name: str, dtype: torch.dtype, shape: list[int]) -> int:
        """Bytes to post for receiving `name` whole, announced as `dtype` of `shape`: that, or what the model's own
        tensor would take where that is more (a block of a sharded bucket gets its block's bytes, which this rank's
        table sets for sender and receiver alike). gloo ends the process (std::terminate in its I/O thread) when a
        message outgrows the buffer posted for it, so a tensor announced smaller than the model's (its shape or its
        dtype; refused once received) is drained into room for the one a sender most likely broadcasts, the model's
        own. A sender that announces less than it sends in any other way still ends the engine: SGLang's protocol has
        no size handshake."""
        announced = torch.Size(shape).numel() * dtype.itemsize
        try:
            view = resolve_in_memory(name, self.tensors).view(self.tensors)
        except KeyError:
            return announced
        if tuple(view.shape) == tuple(shape) and view.dtype == dtype:
            return announced
        return max(announced, view.numel() * max(dtype.itemsize, view.dtype.itemsize))

    def _broadcasts(
        self, group: Any, dtypes: list[torch.dtype], shapes: list[list[int]], slots: list[flat_bucket.Slot] | None,
        room: list[int],
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # fmt: skip
        """(received tensors, the buffers they live in), broadcast from the group's rank 0 into `room` bytes per
        tensor (see `_room`; a flat bucket gets their sum)."""
        if slots is not None:
            buffer = self._land(group, max(flat_bucket.nbytes(slots), sum(room)))
            return [flat_bucket.view(buffer, s) for s in slots], [buffer]
        out, buffers = [], []
        for dtype, shape, nbytes in zip(dtypes, shapes, room):
            size = torch.Size(shape).numel() * dtype.itemsize
            buf = self._buffer(max(size, nbytes))
            tensor = buf[:size].view(dtype).view(shape)
            dist.broadcast(tensor if nbytes <= size else buf, src=0, group=group)
            out.append(tensor)
            buffers.append(buf)
        return out, buffers

    def _land(self, group: Any, nbytes: int) -> torch.Tensor:
        """One flat buffer of `nbytes` broadcast from the group's rank 0, in a receive buffer."""
        buffer = self._buffer(nbytes)
        dist.broadcast(buffer, src=0, group=group)
        return buffer

    def _buffer(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            spare = self._spare.get(nbytes)
            if spare:
                return spare.pop()
        return torch.empty(nbytes, dtype=torch.uint8)

    def recycle(self, buffers: list[torch.Tensor]) -> None:
        """Keep the buffers of an applied or discarded update for the next push (up to one model's worth)."""
        with self._lock:
            self._keep(buffers)

    def _keep(self, buffers: list[torch.Tensor]) -> None:
        kept = sum(b.nbytes for bs in self._spare.values() for b in bs)  # caller holds the lock
        for b in buffers:
            if any(b is base for base in self.bases.values()):  # a delta's base stays as it is
                continue
            if kept + b.nbytes > self._spare_limit:
                break
            self._spare.setdefault(b.nbytes, []).append(b)
            kept += b.nbytes

    def _fail(self, session: Session, reason: str) -> None:
        """Mark `session` failed (its commit is refused at end), whether or not it is still the open one."""
        with self._lock:
            if session.failure is None:
                session.failure = reason

    def _stage(self, session: Session, update: ReceivedUpdate, names: list[str], group_name: str) -> None:
        """Stage `update` in `session`, the one it was announced to; refused (buffers recycled) when that session
        was discarded or replaced meanwhile."""
        with self._lock:
            if self.session is not session:
                self._keep(update.buffers)
                raise WeightUpdateError(
                    "the weight-update session this update was announced to was discarded while it was receiving; "
                    "nothing of it is applied (begin a new session and push again)"
                )
            session.groups.add(group_name)
            session.last_activity = time.monotonic()
            session.buffers.extend(update.buffers)
            for i, (name, target, tensor) in enumerate(zip(names, update.targets, update.tensors)):
                session.staged[name] = (target, tensor, update.is_box(i))
            if update.weight_version is not None:
                session.weight_version = update.weight_version

    def _traffic(self, group_name: str) -> dict[str, Any]:
        return self.traffic.setdefault(group_name, _new_traffic())  # caller holds the lock

    def _record(self, group_name: str, names: list[str], tensors: list[torch.Tensor], wire: int | None = None) -> None:
        with self._lock:
            rec = self._traffic(group_name)
            rec["tensors"] += len(names)
            rec["bytes"] += sum(t.nbytes for t in tensors) if wire is None else wire
            rec["names"].extend(names)

    def _check(self, name: str, dtype: torch.dtype, shape: tuple[int, ...] | None) -> tuple[str | None, Target]:
        """A problem with receiving `name` as `dtype` of `shape` (None: any shape, checked by the caller), or None."""
        try:
            target = resolve_in_memory(name, self.tensors)
        except KeyError:
            return f"{name}: no such weight in the model (send HF on-disk names)", Target(name)
        view = target.view(self.tensors)
        if shape is not None and tuple(view.shape) != shape:
            return f"{name}: shape {list(shape)} != model {list(view.shape)}", target
        if view.dtype != dtype:
            return f"{name}: dtype {dtype} != model {view.dtype} (cast on the trainer side)", target
        return None, target

    # ---- reading and applying (on the scheduler thread, at a token boundary) ------------------------------------
    def get(self, name: str, truncate_size: int) -> list:
        """The first `truncate_size` rows of weight `name` (HF name) as float lists (SGLang's /get_weights_by_name)."""
        try:
            target = resolve_in_memory(name, self.tensors)
        except KeyError:
            raise WeightUpdateError(f"{name}: no such weight in the model (HF on-disk names)") from None
        view = target.view(self.tensors)
        if target.key not in self.shards:
            return view[:truncate_size].float().tolist()
        rows = view[:truncate_size]  # a meta view: the rows' span, then every rank's elements of it
        lo, _ = self.shards.span(target.key, target.view)
        span = (lo, lo + rows.numel())
        out = torch.empty(rows.numel(), dtype=rows.dtype)
        pieces = [self.held(target.key, *span)]
        if self.peers is not None:
            from megatron_sao.engines.embedded.tp import refusals

            replies = self.peers.call("step", "held", key=target.key, lo=span[0], hi=span[1])
            if (refused := refusals(replies)) is not None:
                raise WeightUpdateError(refused)
            pieces += [r.value for r in replies]
        for idx, values in pieces:
            out[idx] = values
        return out.view(rows.shape).float().tolist()

    def box_of(self, name: str) -> flat_bucket.Box | None:
        """This rank's block (offset, shape) of on-disk tensor `name` when it holds it split and as one block; None
        when it holds it whole (replicated, or a split it cannot take as one block)."""
        if name not in self._boxes:
            box = None
            try:
                target = resolve_in_memory(name, self.tensors)
            except KeyError:
                target = None
            if target is not None and target.key in self.shards:
                box = self.shards.box(target.key, target.view)
            self._boxes[name] = box
        return self._boxes[name]

    def shard_boxes(self) -> dict[str, list[list[int]] | None]:
        """{on-disk name: [offset, shape] of this rank's block, or None (it takes the tensor whole)} for every tensor
        this rank holds split (a shard-aware trainer slices what it sends this rank by it)."""
        out: dict[str, list[list[int]] | None] = {}
        for name in on_disk_names(self.tensors):
            target = resolve_in_memory(name, self.tensors)
            if target.key in self.shards:
                box = self.box_of(name)
                out[name] = None if box is None else [list(box[0]), list(box[1])]
        return out

    def held(self, key: str, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's elements of [lo, hi) of split parameter `key`: (their flat index - lo, their values)."""
        return self.shards.held(key, lo, hi)

    def checksums(self, skip: list[str] | None = None) -> dict[str, str]:
        """SGLang's per-tensor checksums (flat_bucket.tensor_checksum) of every weight under its HF on-disk name,
        skipping names that contain any of `skip` (SGLang's skip_tensor_list), so a trainer can compute the same
        from the tensors it sent."""
        out = {}
        for name in on_disk_names(self.tensors):
            if any(pattern in name for pattern in skip or ()):
                continue
            target = resolve_in_memory(name, self.tensors)
            if target.key in self.shards:  # what this rank holds of it, in its own order (SGLang hashes its shard)
                held = self.shards.held(target.key, *self.shards.span(target.key, target.view))[1]
                out[name] = flat_bucket.tensor_checksum(held)
            else:
                out[name] = flat_bucket.tensor_checksum(target.view(self.tensors))
        return out

    def apply(self, update: ReceivedUpdate) -> None:
        """Copy a validated update into the model (called by the scheduler between forward passes); at --tp-size > 1
        every other rank copies its own at the same time (each holds its update since the receive)."""
        if self.peers is None:
            self._apply_here(update)
            return
        from megatron_sao.engines.embedded.tp import fatal, refusals

        self.peers.send("step", "apply")  # the other ranks commit theirs at this same token boundary, meanwhile
        try:
            self._apply_here(update)
        except Exception as e:  # the other ranks applied theirs: the ranks' weights now differ
            self.peers.collect("step")
            fatal(f"a committed push failed to apply on TP rank {self.tp_rank}, the ranks' weights now differ: {e!r}")
        if (refused := refusals(self.peers.collect("step"))) is not None:
            fatal(f"a committed push failed to apply on another rank, the ranks' weights now differ: {refused}")

    def _apply_here(self, update: ReceivedUpdate) -> None:
        split: dict[str, list[tuple[tuple[int, int], torch.Tensor]]] = {}
        boxes: dict[str, list[tuple[tuple[int, int], torch.Tensor]]] = {}
        with torch.no_grad():
            for i, (target, tensor) in enumerate(zip(update.targets, update.tensors)):
                if target.key in self.shards:
                    part = (self.shards.span(target.key, target.view), tensor)
                    (boxes if update.is_box(i) else split).setdefault(target.key, []).append(part)
                else:
                    target.view(self.tensors).copy_(tensor)
        for key, parts in split.items():
            self.shards.write(key, parts)
        for key, parts in boxes.items():  # already this rank's blocks
            self.shards.write_boxes(key, parts)
        if self.fp8 is not None:  # the forward runs on the FP8 weights' dequantization
            self.fp8.refresh({t.key for t in update.targets})


def _block_part(block_groups: Any, rank: int, world_size: int) -> tuple[int, list[int]]:
    """(index, ranks) of the part of `block_groups` that holds update-group rank `rank`; checked: a partition of
    some of the ranks 1..world_size-1 into lists of distinct ints."""
    if not isinstance(block_groups, list) or not all(
        isinstance(g, list) and g and all(isinstance(r, int) and not isinstance(r, bool) for r in g)
        for g in block_groups
    ):
        raise WeightUpdateError(f"block_groups={block_groups!r}: give a list of non-empty lists of engine ranks")
    flat = [r for g in block_groups for r in g]
    if len(set(flat)) != len(flat) or not all(0 < r < world_size for r in flat):
        raise WeightUpdateError(f"block_groups={block_groups!r}: each engine rank in [1, world_size={world_size}) "
                                "at most once")  # fmt: skip
    for i, g in enumerate(block_groups):
        if rank in g:
            return i, g
    raise WeightUpdateError(f"block_groups={block_groups!r} does not hold this engine's rank {rank}")


def _drop_groups(group_name: str, group: Any, blocks: Any) -> None:
    """Tear down a replaced or half-joined update group and its block group; a group whose trainer died may refuse
    a clean teardown, and is dropped anyway."""
    for g in (blocks, group):
        if g is None:
            continue
        try:
            destroy_update_group(g)
        except Exception as e:
            log.warning("dropping update group %r: %r", group_name, e)

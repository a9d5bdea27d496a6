"""One pipeline stage's source and its update group with the engines: forming the group, and sending packed buckets
(owned by weight_sync/; used by sync.py on the stage's source rank only).

The group is this source (rank 0) plus every rank of every member engine (engine i: ranks offset_i .. offset_i +
tp_i - 1, as SGLang numbers them), hosted at this source's address (`source_address`). Each stage has its own group
(`<group_name>_pp<stage>_a<attempt>`), so all stages send at once and no tensor leaves its stage except to the
engines. A bucket travels as ONE broadcast of its flat buffer when every member speaks `load_format=
"flattened_bucket"` (SGLang >= 0.5.6), else one broadcast per tensor (older SGLang), in the order the request
lists them. A shard-aware push (`load_format="sharded_bucket"`, weight_sync.transfer) sends instead each engine rank
one buffer of only its blocks (`flat_bucket.sharded`, by the engine's /weight_shards table): the engine ranks that
hold the same blocks (rank r of every engine at one TP size) form a block group with the source, and the buffer
goes as one broadcast over it; an engine at TP=t receives about 1/t of a full push per rank, and the source sends
each byte once per block group, about one model's bytes in all, however many engines there are.

One order on every engine: an SGLang engine runs one weight update at a time (its tokenizer manager holds the
model-update lock, or the pause condition, until the scheduler's single thread has received and loaded it), in the
order the requests arrive. Stage sources sending at once would reach two engines in different orders, and with NCCL
the stages' broadcasts would then wait on each other across engines: a hang. So the buckets of all stages go in ONE
order, the same on every engine (`PushOrder`): bucket k of stage s is announced only once the bucket before it in
that order landed on every engine (k of stage s-1, or k-1 of the last stage); each engine therefore has at most one
update in flight. Stages still gather and pack at once; what they no longer do is receive at once, which an SGLang
engine never did.

Deltas (weight_sync.delta, engines that take them): every bucket is kept, per channel (its index and the blocks of
its block group), as it was last sent -- the source's **bases**, `Bases` -- and a push whose engines all hold the
version the bases are at sends each channel as only what changed (distributed/delta.py; the smallest of sparse,
bitmap and full, per channel). What this push sent becomes the bases only when the push landed everywhere
(`Bases.settle`); a push that failed leaves the old ones, and rank 0 then asks for a full push.

Failure: an engine that refuses a request before receiving (SGLang: no session, a bad layout) leaves the broadcast
with nobody to meet, and one that dies mid-bucket leaves it hanging; both are bounded by weight_sync.bucket_timeout_s,
after which the group is marked broken and aborted (NCCL: the communicator is aborted, so torch's watchdog does not
kill the learner; gloo: the blocked work ends at the group's timeout) and the next push forms a new one.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from megatron_sao.distributed import delta as deltas
from megatron_sao.distributed import flat_bucket
from megatron_sao.distributed.update_group import (
    abort_update_group,
    block_group_name,
    destroy_update_group,
    host_store,
    init_update_group,
)
from megatron_sao.engines.client import SGLangClient
from megatron_sao.engines.protocol import SHARDED_BUCKET, DeltaHeader, DeltaPart, ServerProtocol
from megatron_sao.weight_sync.plan import Bucket
from megatron_sao.weight_sync.relay import STOP

log = logging.getLogger(__name__)

FLATTENED = "flattened_bucket"


class WeightSyncError(RuntimeError):
    """A push or connect that did not reach every engine; the message names the engine and what it said."""


@dataclass(frozen=True)
class DeltaPlan:
    """A push's deltas, decided by rank 0: `base` the version every engine and the bases hold (None: send every
    channel whole, and keep it as the next base)."""

    base: int | None


class Bases:
    """One stage source's bases: per channel (bucket index, blocks key) the bytes it last sent and their fingerprint,
    at `version`; and what this push sends, pending until the push is settled. Kept in host memory, across group
    re-forms (a stage in the engines' dtype does not fit beside a learner GPU's training state at scale); each base
    is copied to the send device for its bucket's comparison, one bucket at a time."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.held: dict[tuple[int, Any], tuple[torch.Tensor, deltas.Fingerprint]] = {}
        self.pending: dict[tuple[int, Any], tuple[deltas.Encoded, torch.Tensor | None]] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t, _ in self.held.values())

    def encode(self, key: tuple[int, Any], buffer: torch.Tensor, unit: int, base: int | None) -> deltas.Encoded:
        """`buffer` as it travels (a delta against the base when `base` is this store's version), noted as pending."""
        old = self.held.get(key) if base is not None and base == self.version else None
        held, held_fp = old if old is not None else (None, None)
        if held is not None and held.device != buffer.device:
            held = held.to(buffer.device)
        enc = deltas.encode(buffer, held, unit, held_fp)
        # a channel sent whole is copied to the host now (its buffer is reused for the next bucket); a delta is kept
        # as sent and written into the base when the push is settled
        host = torch.device("cpu")
        if enc.encoding == "full":
            self.pending[key] = (enc, buffer.to(host, copy=True))
        else:
            self.pending[key] = (dataclasses.replace(enc, payload=enc.payload.to(host)), None)
        return enc

    def settle(self, version: int | None) -> None:
        """The push landed everywhere (`version`): what it sent becomes the bases; None: it failed, drop it."""
        pending, self.pending = self.pending, {}
        if version is None:
            return
        for key, (enc, whole) in pending.items():
            if whole is not None:
                self.held[key] = (whole, enc.fingerprint)
            else:
                base = self.held[key][0]
                deltas.apply(base, enc.encoding, enc.count, enc.unit, enc.payload)
                self.held[key] = (base, enc.fingerprint)
        self.held = {k: v for k, v in self.held.items() if k in pending}  # channels of an older plan go
        self.version = version


Boxes = Mapping[str, tuple[flat_bucket.Box | None, ...]]
"""An engine's /weight_shards table: HF name -> per TP rank, the block (offset, shape) it holds, or None (whole)."""


@dataclass(frozen=True)
class Member:
    """An engine in the update groups: its URL, its protocol, the ranks it occupies in every stage's group, and
    for a shard-aware push the block of each split tensor every one of its ranks holds."""

    url: str
    protocol: ServerProtocol
    tp: int
    offset: int
    shards: Boxes | None = field(default=None, compare=False, hash=False)

    def boxes(self, rank: int, names: set[str]) -> dict[str, flat_bucket.Box]:
        """The blocks TP rank `rank` takes of the tensors `names` (every other one travels whole)."""
        table = self.shards or {}
        return {n: b[rank] for n, b in table.items() if n in names and b[rank] is not None}

    def blocks_key(self, rank: int) -> tuple[tuple[str, Any], ...]:
        """What TP rank `rank` holds, as a key: ranks with equal keys receive the same buffer of every bucket."""
        table = self.shards or {}
        return tuple(sorted((n, tuple(map(tuple, b[rank]))) for n, b in table.items() if b[rank] is not None))

    def compared(self, rank: int, name: str) -> bool:
        """Whether rank `rank` hashes `name` as it was sent (a replicated tensor or one block): so it is verified."""
        boxes = (self.shards or {}).get(name)
        if boxes is None:
            return True
        box = boxes[rank]
        return box is not None and all(int(n) > 0 for n in box[1])


@dataclass(frozen=True)
class GroupSpec:
    """What every stage source needs to form its group and send (decided by rank 0, shared with the sources)."""

    members: tuple[Member, ...]
    attempt: int
    num_stages: int
    group_name: str
    master_port: int
    master_addr: str  # "auto": each source's own address towards the engines
    backend: str
    load_format: str | None
    connect_timeout_s: float
    bucket_timeout_s: float
    group_timeout_s: float = 1800.0  # the group's collective timeout (NCCL watchdog), > bucket_timeout_s

    @property
    def world(self) -> int:
        return 1 + sum(m.tp for m in self.members)

    def members_key(self, rank: int) -> Any:
        """The blocks update-group rank `rank` holds (Member.blocks_key): what names its block part across pushes."""
        for m in self.members:
            if m.offset <= rank < m.offset + m.tp:
                return m.blocks_key(rank - m.offset)
        raise ValueError(f"no member holds update-group rank {rank}")

    def name(self, stage: int) -> str:
        return f"{self.group_name}_pp{stage}_a{self.attempt}"

    @functools.cached_property
    def block_groups(self) -> list[list[int]] | None:
        """A shard-aware push's block groups: the engine ranks (update-group ranks) partitioned by the blocks they
        hold, in member order -- rank r of every engine at one TP size shares one part. Each part and the stage
        source form a sub-group; a bucket goes as one broadcast per part. None for full-tensor pushes. Computed once
        per spec (every bucket reads it; the key of a rank is its whole table)."""
        if self.load_format != SHARDED_BUCKET:
            return None
        parts: dict[Any, list[int]] = {}
        for m in self.members:
            for r in range(m.tp):
                parts.setdefault(m.blocks_key(r), []).append(m.offset + r)
        return list(parts.values())

    def port(self, stage: int) -> int:
        return self.master_port + stage + self.num_stages * (self.attempt % 64)


WHOLE_PART = ("whole",)
"""The bases' name for a shard-aware push's bucket that every engine rank takes whole (sent as one flattened
bucket): its base is the bucket itself, whatever the block groups."""


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return host == "localhost"


def source_address(configured: str, engine_urls: list[str]) -> str:
    """The address this source hosts its update group at: `configured`, or for "auto" the local address the
    engines reach it by (loopback when every engine is on loopback). A loopback address with a remote engine is
    refused: that engine would dial its own loopback and the push would time out."""
    hosts = [urlparse(u).hostname or "" for u in engine_urls]
    remote = [h for h in hosts if not is_loopback(h)]
    if configured != "auto":
        if remote and is_loopback(configured):
            raise ValueError(
                f"weight_sync.master_addr={configured!r} is a loopback address but engine(s) {remote} are remote: "
                "they could never reach it; set it to this node's address or 'auto'"
            )
        return configured
    if not remote:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no packet is sent: routing picks the interface
        s.connect((socket.gethostbyname(remote[0]), 9))
        return str(s.getsockname()[0])


def in_threads(
    calls: dict[str, Callable[[], Any]], timeout_s: float, give_up: Callable[[str, Any], bool] | None = None
) -> dict[str, Any]:
    """Run each call on its own thread; {key: result, or the exception it raised, or a TimeoutError}. With
    `give_up`, stop waiting as soon as a finished call's (key, result) makes it true: the calls still running are
    left to end on their own (daemon threads) and reported as abandoned."""
    out: dict[str, Any] = {}
    cond = threading.Condition()

    def run(key: str, fn: Callable[[], Any]) -> None:
        try:
            result = fn()
        except BaseException as e:  # reported to the caller, never lost
            result = e
        with cond:
            out[key] = result
            cond.notify_all()

    for kv in calls.items():
        threading.Thread(target=run, args=kv, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    stopped = False
    with cond:
        while len(out) < len(calls):
            stopped = give_up is not None and any(give_up(k, v) for k, v in out.items())
            remaining = deadline - time.monotonic()
            if stopped or remaining <= 0:
                break
            cond.wait(remaining)
        got = dict(out)
    for key in calls:
        got.setdefault(key, TimeoutError("abandoned: another call failed first" if stopped
                                         else f"no answer within {timeout_s:.0f}s"))  # fmt: skip
    return got


def failures(results: dict[str, Any]) -> dict[str, Any]:
    """The calls that raised, timed out or answered success=false."""
    return {
        k: v
        for k, v in results.items()
        if isinstance(v, BaseException) or (isinstance(v, dict) and v.get("success") is False)
    }


def describe(errors: dict[str, Any]) -> str:
    parts = []
    for key, err in errors.items():
        msg = err.get("message") if isinstance(err, dict) else repr(err)
        parts.append(f"{key}: {msg}")
    return "; ".join(parts)


class PushOrder:
    """The one order in which every stage's buckets reach the engines during one push: round by round, bucket k of
    stage 0, 1, ... (a stage with fewer buckets drops out). A stage source waits for its predecessor in that order to
    have landed before announcing a bucket, and publishes each of its own buckets' outcome (landed, or failed) in
    the learner's store, so a failed stage stops the ones after it at once instead of at their timeouts.

    One object per push on each stage source (`push_id` counts pushes; every source counts the same). With one
    stage nothing is waited for or published: a stage's own buckets are already sent one after the other."""

    def __init__(self, counts: list[int], stage: int, push_id: int, timeout_s: float, store: Any = None) -> None:
        self.stage, self.timeout_s = stage, timeout_s
        self.sequence = [(st, k) for k in range(max(counts, default=0)) for st, n in enumerate(counts) if k < n]
        self._position = {key: i for i, key in enumerate(self.sequence)}
        self.store = None
        if len(counts) > 1:
            from torch.distributed import PrefixStore
            from torch.distributed.distributed_c10d import _get_default_store  # the learner's rendezvous store

            self.store = PrefixStore(f"weight_sync/order/{push_id}", store or _get_default_store())
        self._published: set[int] = set()
        self._lock = threading.Lock()
        self.waited_s = 0.0  # time this source spent waiting for its turn

    @staticmethod
    def key(stage: int, index: int) -> str:
        return f"{stage}/{index}"

    def wait_turn(self, index: int) -> None:
        """Return once the bucket before (this stage, `index`) in the order landed; WeightSyncError when it failed or
        did not land within weight_sync.bucket_timeout_s."""
        if self.store is None:
            return
        position = self._position[(self.stage, index)]
        if position == 0:
            return
        before = self.key(*self.sequence[position - 1])
        t0 = time.monotonic()
        # polled, not store.wait(): a blocking wait would hold the store connection this process's landing
        # publisher needs, and the stage before ours may be waiting for exactly that publication
        while not self.store.check([before]):
            if time.monotonic() - t0 > self.timeout_s:
                self.waited_s += time.monotonic() - t0
                raise WeightSyncError(f"stage {self.stage} bucket {index}: bucket {before} (stage/index) before it in "
                                      f"the push order did not land within {self.timeout_s:.0f}s")  # fmt: skip
            time.sleep(0.0005)
        self.waited_s += time.monotonic() - t0
        outcome = self.store.get(before).decode()
        if outcome != "landed":
            raise WeightSyncError(f"stage {self.stage} bucket {index}: not sent, bucket {before} (stage/index) "
                                  f"before it in the push order failed: {outcome}")  # fmt: skip

    def publish(self, index: int, outcome: str) -> None:
        """Record bucket `index` of this stage as "landed" or failed (the first outcome published stays)."""
        if self.store is None:
            return
        with self._lock:
            if index in self._published:
                return
            self._published.add(index)
        self.store.set(self.key(self.stage, index), outcome)

    def finish(self, failure: str | None) -> None:
        """End of this source's part of the push: every bucket of its stage not yet published is published, as
        landed when the stage succeeded (`failure` None: every bucket was waited for), else as failed, so no later
        stage waits for it."""
        for st, k in self.sequence:
            if st == self.stage:
                self.publish(k, "landed" if failure is None else f"failed: {failure}")

    def cleanup(self) -> None:
        """Delete this stage's keys (called at the next push, when every source has read them)."""
        if self.store is None:
            return
        for st, k in self.sequence:
            if st == self.stage and k in self._published:
                self.store.delete_key(self.key(st, k))


class StageSender:
    """The source of one pipeline stage: its update group and the buckets it sends."""

    def __init__(self, stage: int, spec: GroupSpec, group: Any, address: str, blocks: dict[int, Any] | None = None,
                 links: dict[int, tuple[Any, list[int]]] | None = None) -> None:  # fmt: skip
        self.stage, self.spec, self.group, self.address = stage, spec, group, address
        self.blocks = blocks or {}  # a shard-aware push: the block groups this source roots, by part
        self.links = links or {}  # relay rank -> (its pair group with this source, the parts it roots)
        self._relaying: dict[int, _InThread] = {}  # each relay's last bucket in flight
        self._relay_device = torch.device("cpu")  # where the buffers handed to relays live (the send device)
        self.clients = {m.url: SGLangClient(m.url, timeout_s=spec.bucket_timeout_s) for m in spec.members}
        self.touched: set[str] = set()  # engines that got an update request this push
        self.broken = False
        self.stats = {
            "buckets": 0,
            "tensors": 0,
            "bytes": 0,
            "relayed": 0,
            "whole": 0,
            "full_bytes": 0,
            "delta_buckets": 0,
            "units": 0,
            "changed": 0,
        }
        self.order: PushOrder | None = None  # this push's order across stages (set by sync.py per push)
        # a shard-aware push: bytes sent to each engine rank, and (when verified) the checksums of what each got
        self.meter: Any = None  # the push's gather.MemoryMeter: the engine ranks' buffers count (set by sync.py)
        self.rank_checksums: dict[str, list[dict[str, str]]] | None = None  # url -> per rank {HF name: checksum}
        self.rank_bytes: dict[str, list[int]] = {m.url: [0] * m.tp for m in spec.members}
        # engine ranks' buffers of landed buckets, by size, for the next ones (a fresh buffer pays its page faults on
        # first touch, several times the copy into it); at most two buckets' worth is kept
        self._spare: dict[int, list[torch.Tensor]] = {}
        self._spare_lock = threading.Lock()
        self._spare_limit = 0
        self.bases: Bases | None = None  # deltas: this source's bases (set by sync.py per push), else None
        self.delta: DeltaPlan | None = None  # this push's deltas (set by sync.py per push), else None

    @property
    def group_name(self) -> str:
        return self.spec.name(self.stage)

    @staticmethod
    def host(stage: int, spec: GroupSpec) -> Hosted:
        """Bind this stage's group store (before any engine is asked to join: a port in use fails here, not in every
        engine's join), at this source's address towards the engines."""
        address = source_address(spec.master_addr, [m.url for m in spec.members])
        try:
            store, port = host_store(address, spec.port(stage), spec.world, spec.connect_timeout_s)
        except RuntimeError as e:
            raise WeightSyncError(f"cannot host update group {spec.name(stage)} at {address}: {e}") from e
        return Hosted(address, port, store)

    @classmethod
    def connect(cls, stage: int, spec: GroupSpec, hosted: Hosted | None = None, own: list[int] | None = None,
                links: dict[int, tuple[Any, list[int]]] | None = None) -> StageSender:  # fmt: skip
        """Form this stage's update group: every member engine joins (HTTP, in parallel) while this rank hosts it,
        and joins the block groups `own` (default: all) as their rank 0; `links`' relays join the others."""
        hosted = hosted or cls.host(stage, spec)
        address, port, store = hosted.address, hosted.port, hosted.store
        name = spec.name(stage)
        clients = {m.url: SGLangClient(m.url, timeout_s=spec.connect_timeout_s + 10) for m in spec.members}
        parts = spec.block_groups
        calls: dict[str, Callable[[], Any]] = {
            m.url: (lambda m=m: clients[m.url].init_weights_update_group(
                address, port, m.offset, spec.world, name, spec.backend, block_groups=parts))
            for m in spec.members
        }  # fmt: skip
        box: dict[str, Any] = {"blocks": {}}
        mine = list(range(len(parts or []))) if own is None else own

        def join() -> None:
            box["group"] = init_update_group(spec.backend, address, port, spec.world, 0, name, spec.connect_timeout_s,
                                             store=store, collective_timeout_s=spec.group_timeout_s)  # fmt: skip
            for i in mine:  # each part's ranks join theirs once they joined the group
                box["blocks"][i] = init_update_group(
                    spec.backend, address, port, len(parts[i]) + 1, 0, block_group_name(name, i),
                    spec.connect_timeout_s, store=store, collective_timeout_s=spec.group_timeout_s)  # fmt: skip

        refused = lambda key, result: key != "trainer" and bool(failures({key: result}))  # noqa: E731
        results = in_threads({**calls, "trainer": join}, spec.connect_timeout_s + 20, give_up=refused)  # fail fast
        failed = failures(results)
        if failed:
            for g in [*box["blocks"].values(), box.get("group")]:
                if g is not None:
                    abort_update_group(g)
            raise WeightSyncError(f"could not form update group {name} at {address}:{port}: {describe(failed)}")
        blocks = f", {len(parts)} block groups ({len(links or {})} relayed)" if parts else ""
        log.info("weight sync: stage %d update group %s at %s:%d with %d engines (world %d, %s%s)", stage, name,
                 address, port, len(spec.members), spec.world, spec.backend, blocks)  # fmt: skip
        return cls(stage, spec, box["group"], address, box["blocks"], links)

    def start(self, bucket: Bucket, buffer: torch.Tensor) -> _PendingSend:
        """Announce `bucket` to every member, once its turn in the push order came, and broadcast its buffer
        (async); wait() on the handle. Its landing is published to the push order as soon as it happens."""
        if self.order is not None:
            self.order.wait_turn(bucket.index)
        names = [s.name for s in bucket.slots]
        dtypes = [flat_bucket.dtype_name(s.dtype) for s in bucket.slots]
        shapes = [list(s.shape) for s in bucket.slots]
        fmt = self.spec.load_format
        timeout = self.spec.bucket_timeout_s
        # the engine ranks' buffers are cut before any engine is asked to receive: a table that does not fit the
        # tensors fails here, with nobody left waiting for bytes
        sends = self._rank_buffers(bucket, buffer) if fmt == SHARDED_BUCKET else []
        held: list[torch.Tensor] = []
        keys = None
        if fmt == SHARDED_BUCKET and len({id(b) for _, b in sends}) == 1:
            # every engine rank takes this bucket's tensors whole (a push agent's dense tensors, replicated norms):
            # once over the stage's whole group as a flattened bucket, not once per block group
            fmt, held, keys = FLATTENED, [sends[0][1]], [WHOLE_PART]
        elif fmt == SHARDED_BUCKET:
            of_rank = dict(sends)
            held = [of_rank[ranks[0]] for ranks in self.spec.block_groups or []]
        wire, header = self._encode(bucket, held or [buffer], keys)
        calls = {
            url: (lambda c=c: c.update_weights_from_distributed(
                names, dtypes, shapes, group_name=self.group_name, flush_cache=False, load_format=fmt,
                delta=header, timeout_s=timeout))
            for url, c in self.clients.items()
        }  # fmt: skip
        self.touched.update(self.clients)
        box: dict[str, Any] = {}
        threads = [threading.Thread(target=_call, args=(box, k, fn), daemon=True) for k, fn in calls.items()]
        for t in threads:
            t.start()
        if fmt == SHARDED_BUCKET:
            # one broadcast per block group of the buffer its ranks share (or of its delta): from here for the groups
            # this source roots, handed to its relay for the others (relay.py)
            works = [dist.broadcast(wire[i], src=0, group=g, async_op=True) for i, g in self.blocks.items()]
            works += [self._relay(bucket.index, relay, pair, [wire[i] for i in parts])
                      for relay, (pair, parts) in self.links.items()]  # fmt: skip
            sent = sum(t.nbytes for t in wire)
            self._spare_limit = max(self._spare_limit, 2 * sum(t.nbytes for t in held))
            self.stats["relayed"] += sum(wire[i].nbytes for _, parts in self.links.values() for i in parts)
            of_part = {r: wire[i].nbytes for i, ranks in enumerate(self.spec.block_groups or []) for r in ranks}
            for m in self.spec.members:
                self.rank_bytes[m.url] = [n + of_part[m.offset + r] for r, n in enumerate(self.rank_bytes[m.url])]
        else:
            tensors = wire if fmt == FLATTENED else [flat_bucket.view(buffer, s) for s in bucket.slots]
            works = [dist.broadcast(t, src=0, group=self.group, async_op=True) for t in tensors]
            sent = sum(t.nbytes for t in tensors)
            if self.spec.load_format == SHARDED_BUCKET:  # a bucket every rank takes whole, sent once (above)
                self.stats["whole"] += sent
            for url, per_rank in self.rank_bytes.items():
                self.rank_bytes[url] = [n + sent for n in per_rank]
        self.stats["buckets"] += 1
        self.stats["tensors"] += len(names)
        self.stats["bytes"] += sent
        self.stats["full_bytes"] += sum(t.nbytes for t in held) if held else buffer.nbytes
        pending = _PendingSend(self, bucket, threads, box, works, time.monotonic() + timeout, held, wire)
        if self.order is not None and self.order.store is not None:
            threading.Thread(target=pending.publish_landing, args=(self.order,), daemon=True).start()
        return pending

    def _encode(self, bucket: Bucket, parts: list[torch.Tensor],
                keys: list[Any] | None = None) -> tuple[list[torch.Tensor], DeltaHeader | None]:  # fmt: skip
        """What travels for each block part (`parts`: the full bucket, or one buffer per block group) and the
        request's delta field: the parts themselves without deltas; with them, each part as a delta against its base
        when the push has one (the smallest encoding), noted in the bases as pending. `keys`: the parts' names in
        the bases (default: () for a full bucket, each block group's blocks for a sharded one)."""
        if self.delta is None or self.bases is None:
            return parts, None
        unit = deltas.bucket_unit(bucket.slots)
        if keys is None:
            keys = [()] if len(parts) == 1 and self.spec.block_groups is None else [
                self.spec.members_key(ranks[0]) for ranks in self.spec.block_groups or []]  # fmt: skip
        encoded = [self.bases.encode((bucket.index, k), p, unit, self.delta.base) for k, p in zip(keys, parts)]
        compared = [(e, p) for e, p in zip(encoded, parts) if e.encoding != "full" or e.count]  # had a base
        self.stats["units"] += sum(p.nbytes // unit for _, p in compared)
        self.stats["changed"] += sum(e.count for e, _ in compared)
        if all(e.encoding == "full" for e in encoded):
            return parts, DeltaHeader(keep=True)
        self.stats["delta_buckets"] += 1
        said = [deltas.fingerprint_hex(e.fingerprint) if e.encoding != "full" else "" for e in encoded]
        parts_said = tuple(DeltaPart(e.encoding, e.count, e.unit, f) for e, f in zip(encoded, said))
        header = DeltaHeader(keep=True, base=self.delta.base, parts=parts_said)
        return [e.payload for e in encoded], header

    def _relay(self, index: int, relay: int, pair: Any, buffers: list[torch.Tensor]) -> _InThread:
        """Hand bucket `index`'s buffers to `relay` (header, then the buffers) and wait for its answer, on a thread
        (after its previous bucket's, over the same pair group)."""
        before = self._relaying.get(relay)
        if before is not None:
            before.join()
        self._relay_device = buffers[0].device

        def run() -> None:
            header = torch.tensor([index, *(b.nbytes for b in buffers)], dtype=torch.int64, device=buffers[0].device)
            dist.send(header, dst=relay, group=pair)
            for b in buffers:
                dist.send(b, dst=relay, group=pair)
            answer = torch.zeros(1, dtype=torch.int64, device=buffers[0].device)
            dist.recv(answer, src=relay, group=pair)
            if int(answer.item()) != 0:
                raise RuntimeError(f"relay rank {relay}: its block groups' broadcast failed or did not land")

        self._relaying[relay] = work = _InThread(run)
        return work

    def stop_relays(self) -> None:
        """End the push on every relay, once its last bucket was answered (relay.py: a header with index -1)."""
        for relay, (pair, parts) in self.links.items():
            before = self._relaying.pop(relay, None)
            if before is not None:
                before.join()
            stop = torch.tensor([STOP] + [0] * len(parts), dtype=torch.int64, device=self._relay_device)
            dist.send(stop, dst=relay, group=pair)

    def _rank_buffers(self, bucket: Bucket, buffer: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """(group rank, its buffer) for every engine rank: its blocks of the bucket (`flat_bucket.sharded`), one
        buffer per distinct set of blocks (so one per block group, whose ranks hold the same blocks). Each buffer is
        counted by the push's memory meter until it landed."""
        names = {s.name for s in bucket.slots}
        made: dict[Any, tuple[torch.Tensor, dict[str, str]]] = {}  # blocks -> (buffer, checksum of each tensor)
        sends = []
        for m in self.spec.members:
            for r in range(m.tp):
                boxes = m.boxes(r, names)
                key = tuple(sorted((n, tuple(map(tuple, b))) for n, b in boxes.items()))
                if key not in made:
                    try:
                        rank_buffer, slots = flat_bucket.sharded(bucket.slots, buffer, boxes, self._take)
                    except ValueError as e:
                        raise WeightSyncError(f"engine {m.url} rank {r}: its /weight_shards blocks do not fit the "
                                              f"tensors sent ({e})") from None  # fmt: skip
                    if self.meter is not None:
                        self.meter.take(rank_buffer)
                    sums = {}
                    if self.rank_checksums is not None:
                        sums = {s.name: flat_bucket.tensor_checksum(flat_bucket.view(rank_buffer, s)) for s in slots}
                    made[key] = rank_buffer, sums
                rank_buffer, sums = made[key]
                sends.append((m.offset + r, rank_buffer))
                if self.rank_checksums is not None:
                    held = self.rank_checksums.setdefault(m.url, [{} for _ in range(m.tp)])[r]
                    held.update({n: chk for n, chk in sums.items() if m.compared(r, n)})
        return sends

    def _take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A buffer of `nbytes` on `device` for an engine rank: a landed bucket's of that size, else a new one."""
        with self._spare_lock:
            spare = self._spare.get(nbytes)
            for i, t in enumerate(spare or []):
                if t.device == device:
                    return spare.pop(i)  # type: ignore[union-attr]
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def recycle(self, buffers: list[torch.Tensor]) -> None:
        """Keep landed buckets' engine-rank buffers for the next ones (within the limit; the rest are freed)."""
        with self._spare_lock:
            kept = sum(t.nbytes for ts in self._spare.values() for t in ts)
            for t in buffers:
                if kept + t.nbytes <= self._spare_limit:
                    self._spare.setdefault(t.nbytes, []).append(t)
                    kept += t.nbytes

    def send_marker(self, version: int, flush_cache: Mapping[str, bool]) -> dict[str, Any]:
        """The end-of-push marker (an update with no tensors that carries weight_version) to every member, with its
        flush_cache; it tags the push, and the embedded engine commits only the session it closes. {url: answer or
        exception}."""
        calls = {
            url: (lambda c=c, url=url: c.update_weights_from_distributed(
                [], [], [], group_name=self.group_name, weight_version=version,
                flush_cache=flush_cache.get(url, False)))
            for url, c in self.clients.items()
        }  # fmt: skip
        return in_threads(calls, self.spec.bucket_timeout_s)

    def close(self) -> None:
        """Drop this side of the group (the engines are asked to drop theirs by the coordinator). A broken group is
        aborted: pending work fails instead of waiting out the group's timeout."""
        group, self.group = self.group, None
        blocks, self.blocks = list(self.blocks.values()), {}
        if group is None:
            return
        if self.broken:
            log.warning("weight sync: aborting update group %s (a peer is dead or never received)", self.group_name)
        for g in [*blocks, group]:
            if self.broken:
                abort_update_group(g)
                continue
            try:
                destroy_update_group(g)
            except Exception as e:  # a broken group may refuse to be destroyed; it is dropped either way
                log.warning("weight sync: destroying update group %s: %r", self.group_name, e)


class _InThread:
    """A function run on a thread behind a work's interface (is_completed, wait: raises what it raised)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True, name="weight-sync-relay-send")
        self._thread.start()

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as e:
            self._error = e

    def is_completed(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> None:
        self._thread.join()

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(str(self._error)) from self._error


@dataclass(frozen=True)
class Hosted:
    """A stage's group store, bound by its source: where the engines and the relays join."""

    address: str
    port: int
    store: Any


def _call(box: dict[str, Any], key: str, fn: Callable[[], Any]) -> None:
    try:
        box[key] = fn()
    except BaseException as e:  # reported by _PendingSend.wait
        box[key] = e


@dataclass
class _PendingSend:
    sender: StageSender
    bucket: Bucket
    threads: list[threading.Thread]
    answers: dict[str, Any]
    works: list[Any]
    deadline: float
    buffers: list[torch.Tensor] = field(default_factory=list)  # what the works send from, until they landed
    wire: list[torch.Tensor] = field(default_factory=list)  # deltas: what travels instead, until it landed
    grace_s: float = field(default=5.0)

    def release(self) -> None:
        """The works no longer read their buffers: give them back to the push's memory meter."""
        buffers, self.buffers, self.wire = self.buffers, [], []
        if buffers and self.sender.meter is not None:
            self.sender.meter.give(*buffers)
        if buffers and not self.sender.broken:
            self.sender.recycle(buffers)

    def publish_landing(self, order: PushOrder) -> None:
        """(Its own thread.) Publish "landed" to the push order once every engine answered for the bucket, so the
        next stage's bucket is announced without waiting for this source to come back to this bucket; a failure is
        published by whoever sees it first (this thread, or the source's finish). Not at the broadcast's completion:
        a source's broadcast completes once its bytes left (a small bucket before any engine joined it), and with
        more than two receivers gloo's and NCCL's broadcasts forward through the receivers, so an engine that took
        the next stage's bucket first would wait on a peer still forwarding this one, which waits on it."""
        try:
            self.wait()
        except WeightSyncError as e:
            order.publish(self.bucket.index, f"failed: {e}")
            return
        order.publish(self.bucket.index, "landed")

    def landed(self) -> None:
        """Return once the broadcast completed: every engine holds the bucket's bytes and is past its receive, so the
        next bucket may be announced (it queues behind this one, in order) and this buffer reused. WeightSyncError as
        soon as the broadcast failed, or an engine refused and the broadcast did not land within a grace period."""
        self._until(answers=False)

    def wait(self) -> None:
        """Return when every engine also answered success for the bucket; WeightSyncError naming them otherwise."""
        self._until(answers=True)

    def _until(self, answers: bool) -> None:
        where = f"stage {self.sender.stage} bucket {self.bucket.index} ({len(self.bucket.slots)} tensors)"
        refused_at: float | None = None
        while True:
            try:
                landed = all(w.is_completed() for w in self.works)
                for w in self.works:
                    if w.is_completed():
                        w.wait()  # raises what a finished broadcast failed with
            except RuntimeError as e:  # a peer died or the group broke: no answer will fix that
                self.sender.broken = True
                said = {u: self.answers[u] for u in self.sender.clients if u in self.answers}
                raise WeightSyncError(f"{where}: the broadcast failed ({e}); engines said: "
                                      f"{describe(failures(said)) or 'nothing yet'}") from e  # fmt: skip
            answered = all(not t.is_alive() for t in self.threads)
            failed = failures({u: self.answers[u] for u in self.sender.clients if u in self.answers})
            now = time.monotonic()
            if failed and refused_at is None:
                refused_at = now
            if landed:
                self.release()
            if landed and not failed and (answered or not answers):
                return
            grace_over = refused_at is not None and (now - refused_at > self.grace_s or (answered and landed))
            if grace_over or now > self.deadline:
                self.sender.broken |= not landed
                missing = {u: TimeoutError("no answer in time") for u in self.sender.clients if u not in self.answers}
                if failed or (missing and answers):
                    raise WeightSyncError(f"{where}: {describe({**failed, **(missing if answers else {})})}")
                raise WeightSyncError(f"{where}: the broadcast did not complete within weight_sync.bucket_timeout_s="
                                      f"{self.sender.spec.bucket_timeout_s:.0f}s")  # fmt: skip
            time.sleep(0.001)

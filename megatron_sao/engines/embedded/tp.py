"""Tensor parallelism of the embedded engine over processes (owned by embedded/; cli.py starts the ranks, server.py,
scheduler.py and weights.py mirror their work onto them through `Peers`).

SGLang runs one engine over `--tp-size` ranks, split evenly over `--nnodes` nodes (`--node-rank`, `--dist-init-addr`
where the ranks meet); rank 0 alone serves HTTP, its scheduler hands every batch to the other ranks, and every rank
joins the weight-update groups as `rank_offset + tp_rank`, so a trainer pushing to a TP engine meets all of its
ranks. The embedded engine does the same on CPU:
- **ranks**: tp_size processes, tp_size / nnodes on each node; a node's first process starts the others of its node;
  rank 0 hosts the TCP store at --dist-init-addr and every rank joins one gloo group over it. transformers' own
  tensor-parallel plan of the model family (`tp_plan="auto"`, DTensor parameters) shards the model over that group,
  so the forward runs its collectives; the KV cache of a rank holds its heads only.
- **mirroring**: rank 0 binds two ZeroMQ ROUTER sockets (their addresses in the store). `step` carries, in the
  scheduler thread's order, every forward and what runs at a token boundary (a commit, reads of the weights);
  `weights` carries the weight-control requests in the order rank 0's model-update lock admits them. Each other
  rank runs each channel's commands in order on one thread of its own, so every rank sees one order, and answers the
  commands that need an answer; rank 0 merges the answers (one rank's refusal refuses the request).
- **weights**: a push brings full HF tensors (SGLang's update_weights_from_distributed); each rank keeps the elements
  it holds. Which those are comes from torch's own `distribute_tensor` of the tensor's global index under the
  parameter's placements (`LocalShards`), so a push lands on every rank exactly as the checkpoint loaded there.
- **liveness**: each rank beats in the store; rank 0 ends (exit 1) when a rank stops beating or a local one exits, and
  a rank that loses rank 0's store ends too: the engine restarts as a whole, as an SGLang engine whose TP worker died.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_sao.distributed.flat_bucket import Box

log = logging.getLogger(__name__)

CHANNELS = ("step", "weights")
BEAT_S = 2.0
"""Every rank writes its heartbeat into rank 0's store this often."""
DEAD_AFTER_S = 60.0
"""Rank 0 takes a rank whose heartbeat has not changed for this long for dead and ends the engine."""
JOIN_TIMEOUT_S = 600.0
"""Ranks must all have joined within this long of rank 0's start (transformers' import alone takes seconds)."""
COLLECTIVE_TIMEOUT_S = 600.0
"""A forward's collective (or a mirrored command) waiting longer than this on a peer is taken as a dead peer."""


@dataclass(frozen=True)
class TPLayout:
    """One engine's ranks: `tp_size` over `nnodes` nodes, this process on node `node_rank`, meeting at host:port."""

    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    host: str = "127.0.0.1"
    port: int = 0

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.nnodes < 1:
            raise ValueError(f"--tp-size={self.tp_size} and --nnodes={self.nnodes} must be >= 1")
        if self.tp_size % self.nnodes:
            raise ValueError(f"--nnodes={self.nnodes} does not divide --tp-size={self.tp_size}: an engine spans its "
                             "nodes evenly")  # fmt: skip
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank={self.node_rank} must be in [0, --nnodes={self.nnodes})")
        if self.nnodes > 1 and not self.port:
            raise ValueError(f"--nnodes={self.nnodes}: the engine's ranks need --dist-init-addr HOST:PORT (its "
                             "node-rank 0's address) to meet")  # fmt: skip

    @property
    def per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The TP ranks this node runs; the first is the process started by the user or launcher."""
        return range(self.node_rank * self.per_node, (self.node_rank + 1) * self.per_node)


# ---- joining ------------------------------------------------------------------------------------------------------
def join(layout: TPLayout, tp_rank: int) -> Any:
    """Join the engine's gloo group as `tp_rank` (rank 0 hosts the store); the store, for the channels and beats."""
    store = dist.TCPStore(layout.host, layout.port, layout.tp_size, is_master=tp_rank == 0,
                          timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S), wait_for_workers=False)  # fmt: skip
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("engine-tp", store),
        rank=tp_rank,
        world_size=layout.tp_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    return store


# ---- which elements of a sharded weight this rank holds ------------------------------------------------------------
class LocalShards:
    """The DTensor parameters of a TP model that are split over the ranks, and, for any part of one (an on-disk
    tensor's `Target`: the whole parameter, one expert, or the gate or up half of one), which of its elements this
    rank holds. The global index of a parameter is distributed exactly as the parameter (torch's distribute_tensor
    with src_data_rank=None: every rank cuts its own piece, no communication), so for every placement transformers
    uses (Shard, _StridedShard for packed gate/up) the local index tells where each held element sits globally."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        from torch.distributed.tensor import DTensor, Replicate

        self.params = {
            k: v for k, v in state.items() if isinstance(v, DTensor) and not all(isinstance(p, Replicate)
                                                                                for p in v.placements)
        }  # fmt: skip
        # per part (key, lo, hi): where its held elements sit in this rank's piece, and in the part; computed at
        # the first push and kept (the placement never changes), so a commit is a gather and a scatter -- or, where
        # the positions form a strided block (every placement transformers uses, for whole parameters, experts and
        # gate/up halves), two strided views and one copy (`_layouts`)
        self._positions: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._layouts: dict[tuple[str, int, int], tuple[Strided | None, Strided | None]] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.params

    def meta(self, key: str) -> torch.Tensor:
        """A meta tensor of the parameter's global shape and dtype (for shape checks and flat offsets)."""
        p = self.params[key]
        return torch.empty(p.shape, dtype=p.dtype, device="meta")

    def local(self, key: str) -> torch.Tensor:
        """This rank's piece of the parameter (shares storage with the model's)."""
        return self.params[key].to_local()

    def index(self, key: str) -> torch.Tensor:
        """The global flat index of every element of this rank's piece, in the piece's order (1-D, int64)."""
        from torch.distributed.tensor import distribute_tensor

        p = self.params[key]
        glob = torch.arange(p.numel(), dtype=torch.long).view(p.shape)
        return distribute_tensor(glob, p.device_mesh, p.placements, src_data_rank=None).to_local().reshape(-1)

    def span(self, key: str, view: Callable[[dict[str, torch.Tensor]], torch.Tensor]) -> tuple[int, int]:
        """[lo, hi) of a contiguous part of the parameter (what `view` picks from it) in its global flat index."""
        part = view({key: self.meta(key)})
        if not part.is_contiguous():
            raise ValueError(f"{key}: the part to update is not contiguous in the parameter")
        lo = part.storage_offset()
        return lo, lo + part.numel()

    def positions(self, key: str, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions in this rank's flat piece, positions in the part) of the elements of part [lo, hi) this rank
        holds, in the piece's order; cached per part (int64: what indexing takes without a conversion per commit)."""
        if (key, lo, hi) not in self._positions:
            idx = self.index(key)
            at = torch.nonzero((idx >= lo) & (idx < hi)).view(-1)
            self._positions[(key, lo, hi)] = at, idx[at] - lo
        return self._positions[(key, lo, hi)]

    def layouts(self, key: str, lo: int, hi: int) -> tuple[Strided | None, Strided | None]:
        """`positions` as strided views where they are one (None where not): (in the piece, in the part)."""
        if (key, lo, hi) not in self._layouts:
            at, rel = self.positions(key, lo, hi)
            self._layouts[(key, lo, hi)] = strided_layout(at), strided_layout(rel)
        return self._layouts[(key, lo, hi)]

    def write(self, key: str, parts: list[tuple[tuple[int, int], torch.Tensor]]) -> None:
        """Copy each full part (its global [lo, hi) and its values) into the elements of it this rank holds."""
        local = self.local(key).view(-1)
        with torch.no_grad():
            for (lo, hi), values in parts:
                at, rel = self.positions(key, lo, hi)
                into, take = self.layouts(key, lo, hi)
                flat = values.reshape(-1)
                held = take.of(flat) if take is not None else flat[rel]
                if into is not None:
                    dst = into.of(local)
                    dst.copy_(held.reshape(dst.shape))
                else:
                    local[at] = held.reshape(-1).to(local.dtype)

    def box(self, key: str, view: Callable[[dict[str, torch.Tensor]], torch.Tensor]) -> Box | None:
        """The elements of a contiguous part of the parameter (an on-disk tensor) this rank holds, as a box in the
        part's own coordinates: (offset, shape), when they are exactly one box and lie in this rank's piece in the
        box's row-major order (what a trainer slicing the part sends), else None (this rank takes the part whole)."""
        part = view({key: self.meta(key)})
        lo, hi = self.span(key, view)
        idx = self.index(key)
        rel = idx[(idx >= lo) & (idx < hi)] - lo
        if rel.numel() == 0:
            return (0,) * part.dim(), (0,) * part.dim()
        if rel.numel() > 1 and not bool((rel[1:] > rel[:-1]).all()):
            return None
        coords, rest = [], rel
        for size in reversed(part.shape):
            coords.append(rest % size)
            rest = rest // size
        coords.reverse()
        first = tuple(int(c.min()) for c in coords)
        shape = tuple(int(c.max()) + 1 - f for c, f in zip(coords, first))
        return (first, shape) if math.prod(shape) == rel.numel() else None

    def write_boxes(self, key: str, parts: list[tuple[tuple[int, int], torch.Tensor]]) -> None:
        """Copy each part's block this rank holds (the part's global [lo, hi), its block's values row-major, as
        box() describes it) into place."""
        local = self.local(key).view(-1)
        with torch.no_grad():
            for (lo, hi), values in parts:
                at, _ = self.positions(key, lo, hi)
                into, _ = self.layouts(key, lo, hi)
                if into is not None:
                    dst = into.of(local)
                    dst.copy_(values.reshape(dst.shape))
                else:
                    local[at] = values.reshape(-1).to(local.dtype)

    def held(self, key: str, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(global flat indices - lo, values) of the elements of [lo, hi) this rank holds, in its own order."""
        idx = self.index(key)
        sel = (idx >= lo) & (idx < hi)
        return idx[sel] - lo, self.local(key).reshape(-1)[sel]


@dataclass(frozen=True)
class Strided:
    """Positions in a flat tensor that form a row-major block: `rows` runs of `cols` consecutive elements, `stride`
    apart, from `offset` (rows 1: one contiguous run)."""

    offset: int
    rows: int
    cols: int
    stride: int

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """The view of 1-D `flat` holding these positions, [rows, cols], in their order."""
        return flat.as_strided((self.rows, self.cols), (self.stride, 1), flat.storage_offset() + self.offset)


def strided_layout(idx: torch.Tensor) -> Strided | None:
    """`idx` (1-D, increasing positions) as a Strided block, or None when it is not one."""
    n = idx.numel()
    if n == 0:
        return None
    first = int(idx[0])
    steps = idx[1:] - idx[:-1]
    breaks = torch.nonzero(steps != 1).view(-1)
    cols = int(breaks[0]) + 1 if breaks.numel() else n
    if n % cols:
        return None
    rows = n // cols
    stride = int(idx[cols]) - first if rows > 1 else cols
    if stride < cols:
        return None
    block = Strided(first, rows, cols, stride)
    expect = first + torch.arange(rows).view(-1, 1) * stride + torch.arange(cols).view(1, -1)
    return block if torch.equal(expect.view(-1), idx) else None


# ---- the channels' wire format: msgpack, tensors as dtype + shape + raw bytes (nothing is unpickled) ----------
_TENSOR = "__tensor__"


def _pack(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        from megatron_sao.distributed import flat_bucket

        t = obj.detach().contiguous()
        return {_TENSOR: flat_bucket.dtype_name(t.dtype), "shape": list(t.shape),
                "data": t.reshape(-1).view(torch.uint8).numpy().tobytes()}  # fmt: skip
    if isinstance(obj, (list, tuple)):
        return [_pack(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _pack(v) for k, v in obj.items()}
    return obj


def _unpack(obj: Any) -> Any:
    if isinstance(obj, dict) and _TENSOR in obj:
        from megatron_sao.distributed import flat_bucket

        data = obj["data"]
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        return raw.view(flat_bucket.dtype_from_name(obj[_TENSOR])).view(obj["shape"])
    if isinstance(obj, list):
        return [_unpack(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _unpack(v) for k, v in obj.items()}
    return obj


def encode(obj: Any) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(_pack(obj))


def decode(data: bytes) -> Any:
    """What encode() wrote; a malformed frame raises msgspec's DecodeError."""
    import msgspec

    return _unpack(msgspec.msgpack.decode(data))


# ---- rank 0's side of the channels --------------------------------------------------------------------------------
@dataclass
class Reply:
    rank: int
    ok: bool
    value: Any = None  # the command's result, or the error message


class Peers:
    """Rank 0's view of the engine's other ranks: send a command on a channel to all of them, collect their answers.
    Each channel is used by one thread at a time (the scheduler thread; the holder of the model-update lock)."""

    def __init__(self, store: Any, layout: TPLayout) -> None:
        import zmq

        self.layout = layout
        self.ranks = list(range(1, layout.tp_size))
        self._ctx = zmq.Context.instance()
        self._sockets: dict[str, Any] = {}
        bind_host = "127.0.0.1" if layout.nnodes == 1 else "0.0.0.0"
        for channel in CHANNELS:
            s = self._ctx.socket(zmq.ROUTER)
            s.setsockopt(zmq.LINGER, 0)
            port = s.bind_to_random_port(f"tcp://{bind_host}")
            self._sockets[channel] = s
            store.set(f"channel/{channel}", f"tcp://{layout.host}:{port}")
        self._wait_connected()

    def _wait_connected(self) -> None:
        """Every rank says hello on every channel before rank 0 sends anything (ROUTER drops what it cannot route)."""
        import zmq

        for channel, s in self._sockets.items():
            seen: set[int] = set()
            deadline = time.monotonic() + JOIN_TIMEOUT_S
            while seen != set(self.ranks):
                if s.poll(1000, zmq.POLLIN):
                    ident, _ = s.recv_multipart()
                    seen.add(int(ident))
                elif time.monotonic() > deadline:
                    raise RuntimeError(f"engine TP ranks {sorted(set(self.ranks) - seen)} never connected to rank 0's "
                                       f"{channel} channel within {JOIN_TIMEOUT_S:.0f}s")  # fmt: skip

    def send(self, channel: str, command: str, **kwargs: Any) -> None:
        payload = encode([command, kwargs])
        s = self._sockets[channel]
        for r in self.ranks:
            s.send_multipart([str(r).encode(), payload])

    def collect(self, channel: str) -> list[Reply]:
        """The answer of every rank to the last command sent on `channel` that asks for one."""
        s, out = self._sockets[channel], {}
        while len(out) < len(self.ranks):
            ident, payload = s.recv_multipart()
            rank, ok, value = decode(payload)
            out[int(ident)] = Reply(int(rank), bool(ok), value)
        return [out[r] for r in self.ranks]

    def call(self, channel: str, command: str, **kwargs: Any) -> list[Reply]:
        self.send(channel, command, **kwargs)
        return self.collect(channel)


def refusals(replies: list[Reply]) -> str | None:
    """One message naming every rank that refused a mirrored command, or None."""
    bad = [f"engine TP rank {r.rank}: {r.value}" for r in replies if not r.ok]
    return "; ".join(bad) or None


# ---- the other ranks ----------------------------------------------------------------------------------------------
class Follower:
    """A rank other than 0: connects to rank 0's channels and runs their commands in order, each channel on its own
    thread; `handlers[channel][command](**kwargs)` does the work, and a handler's result (or its error) goes back
    unless the command is fire-and-forget (`quiet`)."""

    def __init__(self, store: Any, tp_rank: int, handlers: dict[str, dict[str, Callable[..., Any]]],
                 quiet: frozenset[str] = frozenset({"forward"})) -> None:  # fmt: skip
        self.store, self.rank, self.handlers, self.quiet = store, tp_rank, handlers, quiet
        self._addresses = {c: store.get(f"channel/{c}").decode() for c in CHANNELS}

    def run(self) -> None:
        """Serve both channels until rank 0 goes away (then end the process)."""
        threads = [threading.Thread(target=self._serve, args=(c,), name=f"engine-tp-{c}", daemon=True)
                   for c in CHANNELS]  # fmt: skip
        for t in threads:
            t.start()
        beat_forever(self.store, self.rank)

    def _serve(self, channel: str) -> None:
        import zmq

        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, str(self.rank).encode())
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self._addresses[channel])
        s.send(b"hello")
        table = self.handlers[channel]
        while True:
            command, kwargs = decode(s.recv())
            try:
                reply = Reply(self.rank, True, table[command](**kwargs))
            except Exception as e:  # the answer says what failed; rank 0 decides
                if command in self.quiet:
                    fatal(f"engine TP rank {self.rank}: {command} failed: {e!r}")
                reply = Reply(self.rank, False, f"{type(e).__name__}: {e}")
            if command not in self.quiet:
                s.send(encode([reply.rank, reply.ok, reply.value]))


def fatal(why: str) -> None:
    """End this rank now: an engine missing a rank cannot serve (SGLang's engine dies with its TP worker)."""
    log.critical("%s; ending the engine", why)
    logging.shutdown()
    os._exit(1)


def beat_forever(store: Any, tp_rank: int) -> None:
    """Write this rank's heartbeat into rank 0's store until the store is gone (rank 0 ended): then end."""
    n = 0
    while True:
        try:
            store.set(f"beat/{tp_rank}", str(n))
        except (RuntimeError, OSError) as e:  # the store lives in rank 0: it is gone (DistStoreError)
            fatal(f"engine TP rank {tp_rank} lost rank 0 ({e!r})")
        n += 1
        time.sleep(BEAT_S)


def watch_ranks(store: Any, layout: TPLayout, children: list[Any], tp_rank: int) -> None:
    """End this rank when a rank it started (`children`) exits or, on rank 0, when a rank's heartbeat stops changing
    for DEAD_AFTER_S."""
    last: dict[int, tuple[bytes, float]] = {}
    while True:
        for c in children:
            if c.poll() is not None:
                fatal(f"engine TP rank process {c.pid} exited with {c.returncode}")
        if tp_rank == 0:
            now = time.monotonic()
            for r in range(1, layout.tp_size):
                try:
                    beat = store.get(f"beat/{r}") if store.check([f"beat/{r}"]) else b""
                except RuntimeError:  # our own store (DistStoreError): a rank that never beat reads as not yet
                    beat = b""
                seen, since = last.get(r, (b"", now))
                if beat != seen or r not in last:
                    last[r] = (beat, now)
                elif beat and now - since > DEAD_AFTER_S:  # a rank still loading has not beaten yet
                    fatal(f"engine TP rank {r} stopped beating {now - since:.0f}s ago")
        time.sleep(BEAT_S)

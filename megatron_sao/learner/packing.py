"""Packing a rank's trajectories into micro-batches by a token budget (no padding waste between sequences).

Each micro-batch is one packed row: the trajectories' tokens back to back, with attention confined to each
trajectory. On the local spec that is a block-diagonal causal mask [1, 1, S, S]; with Transformer Engine it
is `PackedSeqParams` (THD, cu_seqlens) and no mask. RoPE positions continue across the row; attention scores
only depend on relative positions inside a trajectory, so this equals running the sequences separately.
Called by learner/step.py; the per-position arrays use the shifted layout of learner/batch.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_sao.learner.batch import StepBatch

PAD_TOKEN = 0


@dataclass(frozen=True)
class Segment:
    row: int  # index of the trajectory in the StepBatch (-1: padding)
    start: int  # first packed position
    num_tokens: int  # tokens of the trajectory (its T); it owns positions [start, start + T)


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # int64 [1, S]
    position_ids: torch.Tensor  # int64 [1, S], restarting at 0 for each trajectory
    attention_mask: torch.Tensor | None  # bool [1, 1, S, S], True = masked out (local spec); None with THD
    packed_seq_params: Any  # megatron PackedSeqParams (TE) or None
    segments: list[Segment] = field(default_factory=list)
    routes: torch.Tensor | None = None  # int32 [S, len(route_layers), top_k]: the engine's experts per position
    routed: torch.Tensor | None = None  # bool [S]: positions an engine routed (not a trajectory's last, not padding)
    route_layers: tuple[int, ...] = ()  # the (HF) layers `routes` holds: this pipeline stage's MoE layers

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])

    def rows(self) -> list[Segment]:
        return [s for s in self.segments if s.row >= 0]

    def targets(self) -> torch.Tensor:
        """int64 [S]: the token each position predicts (0 where nothing is predicted)."""
        out = torch.zeros(self.seq_len, dtype=torch.int64)
        flat = self.tokens[0]
        for s in self.rows():
            out[s.start : s.start + s.num_tokens - 1] = flat[s.start + 1 : s.start + s.num_tokens]
        return out

    def pack(self, per_row: torch.Tensor) -> torch.Tensor:
        """[B, L] shifted per-trajectory values -> [S] per packed position (0 where nothing is predicted)."""
        out = per_row.new_zeros(self.seq_len)
        for s in self.rows():
            out[s.start : s.start + s.num_tokens - 1] = per_row[s.row, : s.num_tokens - 1]
        return out

    def unpack_into(self, packed: torch.Tensor, per_row: torch.Tensor) -> None:
        """Inverse of `pack`: write [S] packed position values into the rows of `per_row` [B, L]."""
        for s in self.rows():
            per_row[s.row, : s.num_tokens - 1] = packed[s.start : s.start + s.num_tokens - 1]


def _block_causal_mask(segments: list[Segment], seq_len: int) -> torch.Tensor:
    allowed = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    for s in segments:
        end = s.start + s.num_tokens
        allowed[s.start : end, s.start : end] = True
    allowed &= torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    return (~allowed).view(1, 1, seq_len, seq_len)


def _packed_seq_params(segments: list[Segment]) -> Any:
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = torch.tensor([s.num_tokens for s in segments], dtype=torch.int32)
    cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    if torch.cuda.is_available():
        cu = cu.cuda()
    max_len = int(lengths.max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len, max_seqlen_kv=max_len
    )


def _packed_routes(
    batch: StepBatch, segments: list[Segment], layers: tuple[int, ...], k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routes of a packed row, `layers` only: each trajectory's T - 1 engine rows, then for its last position
    and for padding experts 0..top_k-1 (distinct, so no token is dispatched to one expert twice; their outputs
    reach no loss: nothing attends to a trajectory's last position, nor to padding)."""
    given = batch.routes or [None] * batch.size
    missing = [batch.trajectory_ids[s.row] for s in segments if s.row >= 0 and given[s.row] is None]
    if missing:
        raise ValueError(f"trajectories {missing[:3]} carry no routes: routing replay needs every trajectory's "
                         "(rollout.return_routed_experts on every worker)")  # fmt: skip
    seq_len = segments[-1].start + segments[-1].num_tokens
    out = torch.arange(k, dtype=torch.int32).expand(seq_len, len(layers), k).clone()
    routed = torch.zeros(seq_len, dtype=torch.bool)
    for s in segments:
        if s.row >= 0:
            r = given[s.row]
            assert r is not None
            if r.shape[2] != k:
                raise ValueError(f"trajectory {batch.trajectory_ids[s.row]}: routes of top_k {r.shape[2]}, the model "
                                 f"routes to {k}")  # fmt: skip
            out[s.start : s.start + s.num_tokens - 1] = torch.from_numpy(r[:, list(layers)].astype("int32"))
            routed[s.start : s.start + s.num_tokens - 1] = True
    return out, routed


def build_microbatch(
    batch: StepBatch,
    rows: list[int],
    pad_multiple: int,
    use_thd: bool,
    route_layers: tuple[int, ...] = (),
    top_k: int = 0,
) -> MicroBatch:
    """Pack `rows` of `batch` into one row padded to a multiple of `pad_multiple` (TP size for SP); with
    `route_layers`, the engine's routes of those layers come along (batch.routes)."""
    segments, pieces, positions, start = [], [], [], 0
    for r in rows:
        toks = batch.tokens[r]
        segments.append(Segment(r, start, int(toks.numel())))
        pieces.append(toks)
        positions.append(torch.arange(toks.numel()))
        start += int(toks.numel())
    pad = (-start) % pad_multiple if start else pad_multiple
    if pad:
        segments.append(Segment(-1, start, pad))
        pieces.append(torch.full((pad,), PAD_TOKEN, dtype=torch.int64))
        positions.append(torch.arange(pad))
    seq_len = start + pad
    tokens = torch.cat(pieces).view(1, seq_len)
    routes = routed = None
    if route_layers:
        routes, routed = _packed_routes(batch, segments, route_layers, top_k)
    return MicroBatch(
        tokens=tokens,
        position_ids=torch.cat(positions).view(1, seq_len),
        attention_mask=None if use_thd else _block_causal_mask(segments, seq_len),
        packed_seq_params=_packed_seq_params(segments) if use_thd else None,
        segments=segments,
        routes=routes,
        routed=routed,
        route_layers=tuple(route_layers) if routes is not None else (),
    )


def plan_microbatches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Greedy, order-preserving: rows go into the current micro-batch while it stays within `max_tokens`
    (a row longer than the budget gets a micro-batch of its own)."""
    plan: list[list[int]] = []
    current: list[int] = []
    used = 0
    for r, n in enumerate(lengths):
        if current and used + n > max_tokens:
            plan.append(current)
            current, used = [], 0
        current.append(r)
        used += n
    if current:
        plan.append(current)
    return plan


def pack_microbatches(
    batch: StepBatch,
    max_tokens: int,
    pad_multiple: int,
    use_thd: bool,
    min_count: int = 0,
    route_layers: tuple[int, ...] = (),
    top_k: int = 0,
) -> list[MicroBatch]:
    """All of `batch` as packed micro-batches, padded with empty ones up to `min_count` (every rank of an
    expert-parallel group must run the same number of forward passes)."""
    plan = plan_microbatches([int(t.numel()) for t in batch.tokens], max_tokens)
    plan += [[] for _ in range(max(0, min_count - len(plan)))]
    return [build_microbatch(batch, rows, pad_multiple, use_thd, route_layers, top_k) for rows in plan]


def check_eager_attention_memory(
    max_tokens: int, num_layers: int, heads: int, parallel: Any, available: int | None = None, ranks: int | None = None
) -> str | None:
    """The local spec (no Transformer Engine: a CPU, or an fp32 model) attends over a packed micro-batch with an
    eager [heads, S, S] score matrix per layer, kept for backward: memory grows with the square of
    learner.max_tokens_per_microbatch (SmolLM2's 30 layers x 9 heads at 4096 tokens: 18 GB, and the kernel's OOM
    killer ends the run without a word: 22.9 GB resident on a 24 GB machine). A warning naming the field and a size
    that takes at most half of this rank's share of the free memory, when a full micro-batch would take more; None
    otherwise. (Only a warning: micro-batches are packed from the step's trajectories, and short ones never fill
    the budget.)"""
    import os

    import psutil

    layers = -(-num_layers // parallel.pipeline)
    per_token_pair = layers * max(heads // parallel.tensor, 1) * 4  # fp32 scores (softmax in fp32)
    need = per_token_pair * max_tokens**2
    ranks = ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    free = (available if available is not None else psutil.virtual_memory().available) // max(ranks, 1)
    if need <= free // 2:
        return None
    fits = int((free // 2 / per_token_pair) ** 0.5) // 256 * 256
    return (f"learner.max_tokens_per_microbatch={max_tokens}: eager attention (no Transformer Engine) keeps a "
            f"{max_tokens} x {max_tokens} score matrix per head and layer for backward, about {need / 2**30:.1f} GiB "
            f"here ({layers} layers x {per_token_pair // layers // 4} heads), against {free / 2**30:.1f} GiB free "
            f"for this rank: a full micro-batch may be killed for memory without a word; set "
            f"learner.max_tokens_per_microbatch to {max(fits, 256)} or less")  # fmt: skip

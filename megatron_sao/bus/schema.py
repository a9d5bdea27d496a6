"""Wire schema of the trajectory bus: the one definition of what a finished trajectory is.

Producers (rollout workers) build `Trajectory` objects; the bus codec sends the `TrajectoryHeader` as msgpack
plus each per-token array as its own zero-copy frame; the learner receives `Trajectory` objects back.
Every per-token array has the same length T = len(tokens) and covers the whole sequence (prompt, generated
turns and observations). The optional routes (MoE routing replay) cover the T - 1 positions that predict a token.
Bump SCHEMA_VERSION on any incompatible change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import numpy as np

SCHEMA_VERSION = 1

MAX_ID_CHARS = 512
"""Longest accepted trajectory / prompt / worker / engine id."""

FinishReason = Literal["stop", "length", "abort", "turn_limit", "token_limit", "error"]
"""Why the episode ended: stop (model or environment finished), length (the last turn hit max_new_tokens),
abort (engine aborted the request), turn_limit / token_limit (agent-loop caps), error (environment error)."""

MetadataValue = str | int | float | bool


class Turn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One generate -> (observe) step of a multi-turn episode, as token index ranges into the sequence."""

    action_start: int  # index of the turn's first generated token
    action_end: int  # one past its last generated token
    observation_end: int  # one past the observation appended after the turn (== action_end when none)
    reward: float | None = None  # per-turn reward, when the environment gives one
    generate_s: float = 0.0  # wall time the engine spent on the turn
    tool_s: float = 0.0  # wall time of the tool / environment step that followed


class Timings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Wall-clock marks of the episode (time.time() seconds) for latency and staleness accounting."""

    started_at: float  # rollout worker took the prompt
    finished_at: float  # last token / observation appended
    sent_at: float = 0.0  # handed to the bus (set by the sender)


class Routes(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the routes frame holds: for position p < T - 1 (the token at p, in the engine forward whose logits
    predicted token p + 1), the `top_k` experts of each of the model's `num_layers` decoder layers, as SGLang's
    `meta_info.routed_experts` gives them (layers without a router hold zeros there). Stored as uint8 for up to 256
    experts, uint16 above: 1/4 or 1/2 of SGLang's int32."""

    num_layers: int  # config.json num_hidden_layers (every decoder layer, dense ones included)
    top_k: int  # num_experts_per_tok
    num_experts: int  # routed experts per MoE layer: every id is below it

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8) if self.num_experts <= 256 else np.dtype(np.uint16)

    def shape(self, num_tokens: int) -> tuple[int, int, int]:
        return (max(num_tokens - 1, 0), self.num_layers, self.top_k)

    def nbytes(self, num_tokens: int) -> int:
        rows, layers, k = self.shape(num_tokens)
        return rows * layers * k * self.dtype.itemsize

    @classmethod
    def of_model(cls, hf: dict, num_experts: int) -> Routes:
        """The routes of a model from its config.json (dict) and routed expert count."""
        return cls(int(hf["num_hidden_layers"]), int(hf["num_experts_per_tok"]), int(num_experts))

    def filler(self, rows: int) -> np.ndarray:
        """Rows for positions no engine forward routed (a trailing observation): experts 0..top_k-1, distinct."""
        return np.broadcast_to(np.arange(self.top_k, dtype=self.dtype), (rows, self.num_layers, self.top_k)).copy()

    def check(self) -> None:
        if self.num_layers < 1 or not 1 <= self.top_k <= self.num_experts <= MAX_EXPERTS:
            raise ValueError(f"routes {self}: need num_layers >= 1 and 1 <= top_k <= num_experts <= {MAX_EXPERTS}")


PAIRWISE_TOP_K = 16
"""Up to this top_k the receiver checks distinct experts by comparing columns pairwise, above it by sorting."""

MAX_EXPERTS = 65536
"""The most routed experts a layer may have for routes to travel (uint16 ids)."""


class TrajectoryHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything but the per-token arrays; travels as one msgpack frame in front of them."""

    schema_version: int  # SCHEMA_VERSION of the producer; the receiver rejects any other
    trajectory_id: str  # globally unique; the receiver de-duplicates on it (exactly-once)
    prompt_id: str  # id of the prompt; the GRPO arm groups the G samples of a prompt by it
    sample_index: int  # 0..G-1 within the prompt's group (always 0 for single-rollout SAO)
    num_tokens: int  # T: length of every per-token array frame
    prompt_len: int  # tokens [0, prompt_len) are the initial prompt
    reward: float  # terminal reward, to be placed on the last action token
    turns: tuple[Turn, ...]  # the episode's turns, in order
    finish_reason: FinishReason  # why the episode ended
    engine_id: str  # engine (URL or name) that generated the last turn
    worker_id: str  # rollout worker that ran the episode
    timings: Timings  # wall-clock marks
    metadata: dict[str, MetadataValue] = {}  # small task facts, e.g. {"env": "style", "style": "cute"}
    routes: Routes | None = None  # the engine's MoE routing travels in one more frame (learner.routing_replay)


ARRAY_DTYPES: dict[str, np.dtype] = {
    "tokens": np.dtype(np.int32),
    "rollout_logprobs": np.dtype(np.float32),
    "action_mask": np.dtype(np.bool_),
    "weight_versions": np.dtype(np.int32),
}
"""The per-token arrays of a Trajectory, in frame order, with their wire dtypes."""


@dataclass
class Trajectory:
    """A finished episode. Arrays are numpy, length T, aligned token by token."""

    header: TrajectoryHeader
    tokens: np.ndarray  # int32 [T]: prompt, generated and observation token ids
    rollout_logprobs: np.ndarray  # float32 [T]: log-prob of each generated token under its weights; 0 elsewhere
    action_mask: np.ndarray  # bool [T]: True exactly on tokens the policy generated
    weight_versions: np.ndarray  # int32 [T]: weight version that generated each token; -1 on non-action tokens
    routes: np.ndarray | None = None  # uint8/uint16 [T - 1, layers, top_k] when header.routes says so (Routes)
    extras: dict[str, object] = field(default_factory=dict)  # receiver-side annotations (never sent)

    @property
    def trajectory_id(self) -> str:
        return self.header.trajectory_id

    @property
    def num_action_tokens(self) -> int:
        return int(self.action_mask.sum())

    def oldest_version(self) -> int | None:
        """Smallest weight version among generated tokens (None when nothing was generated)."""
        if not self.action_mask.any():
            return None
        return int(np.min(self.weight_versions, where=self.action_mask, initial=np.iinfo(np.int32).max))

    def validate(self) -> None:
        """Raise ValueError naming the field when the arrays and header disagree or hold impossible values.

        See validated_oldest_version() for what is checked.
        """
        self.validated_oldest_version()

    def validated_oldest_version(self, arrays_checked: bool = False) -> int | None:
        """validate(), returning oldest_version() from the same pass over the arrays (the receiver's hot path).

        Checked: everything check_shapes() checks; action_mask True exactly on the turns' action ranges (hence
        never in the prompt); token ids >= 0; finite log-probs and rewards; weight versions >= 0 on action tokens;
        routes: every expert id below num_experts and no id twice among one position's top_k in one layer.
        Cost O(T) with a few numpy passes (the receiver runs it on every message). `arrays_checked`: the caller
        built the arrays with the right dtypes and lengths (codec.decode), so only the header part of
        check_shapes() runs.
        """
        self._check_header()
        if not arrays_checked:
            self._check_arrays()
        return self._validate_values()

    def check_shapes(self) -> None:
        """The cheap part of validate() (no pass over the arrays): schema version; trajectory_id non-empty, ids at
        most MAX_ID_CHARS; dtype, rank and length of each array; prompt_len and the turn ranges ordered inside
        [0, T); finite rewards, each with action tokens to score. Raises ValueError."""
        self._check_header()
        self._check_arrays()

    def _check_arrays(self) -> None:
        n = self.header.num_tokens
        for name, dtype in ARRAY_DTYPES.items():
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray) or arr.dtype != dtype or arr.ndim != 1:
                got = f"{type(arr).__name__} {getattr(arr, 'dtype', '')} ndim={getattr(arr, 'ndim', '')}"
                raise ValueError(f"{name}: expected a 1-D {dtype} array, got {got}")
            if arr.shape[0] != n:
                raise ValueError(f"{name}: length {arr.shape[0]} != header.num_tokens {n}")
        self._check_routes_shape()

    def _check_routes_shape(self) -> None:
        spec, arr = self.header.routes, self.routes
        if spec is None:
            if arr is not None:
                raise ValueError("routes: an array but header.routes is None (set it to the routes' Routes)")
            return
        spec.check()
        want = spec.shape(self.header.num_tokens)
        if not isinstance(arr, np.ndarray) or arr.dtype != spec.dtype or arr.shape != want:
            got = f"{type(arr).__name__} {getattr(arr, 'dtype', '')} {getattr(arr, 'shape', '')}"
            raise ValueError(f"routes: expected a {spec.dtype} array of shape {want} (T - 1, layers, top_k), got {got}")

    def _check_header(self) -> None:
        h = self.header
        if h.schema_version != SCHEMA_VERSION:
            raise ValueError(f"schema_version {h.schema_version} != {SCHEMA_VERSION}")
        if not h.trajectory_id:
            raise ValueError("trajectory_id is empty; it is the identity the bus de-duplicates on")
        for name in ("trajectory_id", "prompt_id", "worker_id", "engine_id"):
            value = getattr(h, name)
            if len(value) > MAX_ID_CHARS:
                raise ValueError(f"{name} {value[:40]!r}... is longer than {MAX_ID_CHARS} characters")
        if h.num_tokens < 1 or h.sample_index < 0:
            raise ValueError(f"num_tokens {h.num_tokens} must be >= 1 and sample_index {h.sample_index} >= 0")
        if not 0 <= h.prompt_len <= h.num_tokens:
            raise ValueError(f"prompt_len {h.prompt_len} outside [0, num_tokens={h.num_tokens}]")
        if not math.isfinite(h.reward):
            raise ValueError(f"reward {h.reward} is not finite")
        prev_end = h.prompt_len
        for i, t in enumerate(h.turns):
            if not prev_end <= t.action_start <= t.action_end <= t.observation_end <= h.num_tokens:
                raise ValueError(f"turns[{i}] ranges {t} are not ordered inside [{prev_end}, {h.num_tokens}]")
            if t.reward is not None and not math.isfinite(t.reward):
                raise ValueError(f"turns[{i}].reward {t.reward} is not finite")
            if t.reward and t.action_start == t.action_end:
                raise ValueError(f"turns[{i}] has reward {t.reward} but no action tokens to put it on")
            prev_end = t.observation_end
        if h.reward and all(t.action_start == t.action_end for t in h.turns):
            raise ValueError(f"reward {h.reward} but no action tokens to put it on (rewards score generated tokens)")

    def _validate_values(self) -> int | None:
        """Runs after the header checks (turn ranges ordered and disjoint); returns the oldest version.

        Five numpy calls whatever the number of turns, each a direct ufunc call (ndarray methods add a Python
        wrapper): this runs on the receiver's socket thread for every message.
        """
        mask, versions = self.action_mask, self.weight_versions
        bounds: list[int] = []  # a0, b0, a1, b1, ...: the non-empty action ranges, in order
        num_action = 0
        for t in self.header.turns:
            a, b = t.action_start, t.action_end
            if b > a:
                bounds += (a, b)
                num_action += b - a
        oldest: int | None = None
        if bounds:
            # reduceat over [a0, b0, a1, b1, ...] reduces [a0, b0), [b0, a1), [a1, b1), ...: the even entries are
            # the action ranges (an entry whose next index is not larger is one element: only ever a gap). The
            # last index must be < T: a range that ends at T runs to the end anyway.
            if bounds[-1] == mask.shape[0]:
                bounds.pop()
            if not _all_true(_all_true_at(mask, bounds)[::2]):
                raise ValueError("action_mask is False on some token inside a turn's action range")
            lows = _minimum_at(versions, bounds)[::2]
            oldest = int(_minimum(lows))
            if oldest < 0:
                i = [j for j, t in enumerate(self.header.turns) if t.action_end > t.action_start][int(lows.argmin())]
                raise ValueError(f"weight_versions: negative version on an action token of turns[{i}]")
        if np.count_nonzero(mask) != num_action:
            raise ValueError("action_mask is True outside the turns' action ranges (prompt or observation tokens)")
        if int(_minimum(self.tokens)) < 0:
            raise ValueError("tokens: negative token id")
        if self.routes is not None and self.routes.size:
            _check_route_values(self.routes, self.header.routes.num_experts)  # type: ignore[union-attr]
        lp = self.rollout_logprobs
        # One BLAS pass: NaN and +-inf propagate into the dot product (so would |logprob| > 1.8e19, as absurd)
        if not math.isfinite(float(lp.dot(lp))):
            raise ValueError("rollout_logprobs: NaN, infinite or absurdly large (|x| > 1e19) value")
        return oldest


def _check_route_values(routes: np.ndarray, num_experts: int) -> None:
    """Expert ids in range and distinct within each (position, layer): a replayed duplicate would hand the token to
    one expert twice, and the dispatcher's split sizes would no longer add up. Dense layers' all-zero rows pass (the
    learner has no router there to replay)."""
    if int(routes.max()) >= num_experts:
        pos = int(np.argwhere(routes >= num_experts)[0][0])
        raise ValueError(f"routes: expert id {int(routes.max())} >= num_experts {num_experts} (position {pos})")
    k = routes.shape[-1]
    if k < 2:
        return
    if k <= PAIRWISE_TOP_K:  # k(k-1)/2 column comparisons: ~5x faster than sorting rows of 8 (32k tokens x 48 layers)
        flat = routes.reshape(-1, k)
        cols = [np.ascontiguousarray(flat[:, i]) for i in range(k)]
        twice = np.zeros(flat.shape[0], dtype=bool)
        for i in range(k):
            for j in range(i + 1, k):
                twice |= cols[i] == cols[j]
        bad = (twice & flat.any(axis=1)).reshape(routes.shape[:-1])  # an all-zero row: a layer without a router
    else:
        ordered = np.sort(routes, axis=-1)
        bad = (ordered[..., 1:] == ordered[..., :-1]).any(axis=-1) & ordered[..., -1].astype(bool)
    if bad.any():
        pos, layer = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"routes: position {pos} layer {layer} names one expert twice {routes[pos, layer].tolist()}")


_minimum, _minimum_at = np.minimum.reduce, np.minimum.reduceat
_all_true, _all_true_at = np.logical_and.reduce, np.logical_and.reduceat

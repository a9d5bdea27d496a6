"""SGLang's native HTTP API as the project uses it: endpoint paths, the /generate request body, the parsed
/generate response and the weight-update protocol of each SGLang version (owned by engines/; client.py sends and
parses with it, embedded/server.py answers in the same shape; tests/engines/test_sglang_contract.py pins every field
against SGLang's source).

Field definitions read from SGLang 0.5.23 (PyPI wheel): `GenerateReqInput` and `UpdateWeightsFromDistributedReqInput`
& friends in python/sglang/srt/managers/io_struct.py, the routes in srt/entrypoints/http_server.py, meta_info built
in srt/managers/tokenizer_manager.py (`_handle_batch_output`, `detokenize_logprob_tokens`) and
srt/utils/weight_versions.py (`add_weight_versions_to_meta_info`).

Per-token facts of a finished /generate response:
- `meta_info.output_token_logprobs`: one `[logprob, token_id, text_or_null]` per generated token (text only with
  `return_text_in_logprobs` and a tokenizer).
- `meta_info.finish_reason`: a dict, `{"type": "stop", "matched": id_or_str}`, `{"type": "length", "length": n}` or
  `{"type": "abort", "message": ...}`.
- `meta_info.weight_version`: the server's version string ("default" unless `--weight-version` or an update set it);
  newer servers (0.5.23) add `meta_info.weight_versions`, spans `{"version", "start", "end"}` over the output tokens,
  so a request that crossed a weight update says which version produced each token. Older servers report only the
  version at completion; the parser then stamps every token with it (an upper bound).
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import numpy as np

# ---- endpoints --------------------------------------------------------------------------------------------------
GENERATE = "/generate"
HEALTH = "/health"
HEALTH_GENERATE = "/health_generate"
MODEL_INFO = "/model_info"  # newer spelling (0.5.3+): includes weight_version
GET_MODEL_INFO = "/get_model_info"  # older spelling, deprecated in newer servers
GET_WEIGHT_VERSION = "/get_weight_version"  # older servers only: {"weight_version": str}
ABORT_REQUEST = "/abort_request"
PAUSE_GENERATION = "/pause_generation"
CONTINUE_GENERATION = "/continue_generation"
FLUSH_CACHE = "/flush_cache"
INIT_WEIGHTS_UPDATE_GROUP = "/init_weights_update_group"
DESTROY_WEIGHTS_UPDATE_GROUP = "/destroy_weights_update_group"
UPDATE_WEIGHTS_FROM_DISTRIBUTED = "/update_weights_from_distributed"
UPDATE_WEIGHTS_FROM_TENSOR = "/update_weights_from_tensor"  # one payload per TP rank (distributed/tensor_payload.py)
SERVER_INFO = "/server_info"
GET_WEIGHTS_BY_NAME = "/get_weights_by_name"  # {"name", "truncate_size"=100} -> the first rows, as float lists
GET_SERVER_INFO = "/get_server_info"  # older spelling of /server_info (before 0.5.6)
BEGIN_WEIGHT_UPDATE = "/begin_weight_update"  # 0.5.21+: opens the session updates must run in
END_WEIGHT_UPDATE = "/end_weight_update"  # 0.5.21+: closes it (finalizes the loaded weights)
UPDATE_WEIGHT_VERSION = "/update_weight_version"  # {"new_version", "abort_all_requests"=True}
WEIGHTS_CHECKER = "/weights_checker"  # 0.5.6+: {"action": "checksum", "skip_tensor_list"} -> per-rank checksums
WEIGHT_SHARDS = "/weight_shards"  # the embedded engine's own: which block of each split tensor each TP rank holds
SHARDED_BUCKET = "sharded_bucket"
"""The embedded engine's own load_format of /update_weights_from_distributed (no SGLang release has one): each engine
rank receives from the group's rank 0, broadcast over its block group (the ranks holding the same blocks, named by
`block_groups` at /init_weights_update_group), one flattened bucket of only what it holds: its block of every tensor
/weight_shards lists, every other tensor whole. SGLang's ranks each receive the full broadcast."""

DELTA = "delta"
"""The embedded engine's and the push agent's own field of /update_weights_from_distributed (no SGLang release has
one; `DeltaHeader` is its schema): the bucket travels as a delta against what the same channel carried at the last
push both ends kept (distributed/delta.py), and/or what arrives is kept as the base of the next one."""


@dataclass(frozen=True)
class DeltaPart:
    """How one block part's bytes travel (a full-tensor bucket has one part; a sharded one one per block group):
    `encoding` of `count` changed units of `unit` bytes; `digest`: of the full bytes once decoded (distributed/
    delta.digest), checked by the receiver; empty for "full"."""

    encoding: str
    count: int = 0
    unit: int = 1
    digest: str = ""


@dataclass(frozen=True)
class DeltaHeader:
    """The `delta` field. `keep`: keep what this update results in as the base of this bucket's next delta (made
    the engine's base when its session commits). `base`: the weight version the bytes on the wire are a delta against
    (None: the full bucket); `parts[i]`: block part i's encoding (distributed/delta.py)."""

    keep: bool = True
    base: int | None = None
    parts: tuple[DeltaPart, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"keep": self.keep, "base": self.base,
                "parts": [[p.encoding, p.count, p.unit, p.digest] for p in self.parts]}  # fmt: skip

    @classmethod
    def from_json(cls, raw: Any) -> DeltaHeader:
        """Parse the field; ValueError naming what is wrong (before anything is received)."""
        if not isinstance(raw, dict) or set(raw) - {"keep", "base", "parts"}:
            raise ValueError(f"delta must be an object with keep, base and parts, got {raw!r}")
        base = raw.get("base")
        if base is not None and (not isinstance(base, int) or isinstance(base, bool) or base < 0):
            raise ValueError(f"delta.base must be a weight version (an integer >= 0) or null, got {base!r}")
        parts = []
        for p in raw.get("parts") or []:
            if not (isinstance(p, list) and len(p) == 4 and p[0] in ("sparse", "bitmap", "full")
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in p[1:3]) and p[1] >= 0
                    and p[2] in (1, 2, 4, 8) and isinstance(p[3], str)):  # fmt: skip
                raise ValueError(f"delta.parts entry {p!r}: expected [encoding, count, unit, digest] with encoding "
                                 "sparse|bitmap|full, count >= 0, unit 1|2|4|8")  # fmt: skip
            if p[0] != "full" and not p[3]:
                raise ValueError(f"delta.parts entry {p!r}: a {p[0]} part needs the digest of its decoded bytes")
            parts.append(DeltaPart(p[0], p[1], p[2], p[3]))
        if base is not None and not parts:
            raise ValueError("delta.base is set but delta.parts is empty: say how each block part travels")
        return cls(bool(raw.get("keep", True)), base, tuple(parts))

    def part(self, index: int) -> DeltaPart:
        """Block part `index`'s encoding (the full bucket when no base is given)."""
        if self.base is None:
            return DeltaPart("full")
        if not 0 <= index < len(self.parts):
            raise ValueError(f"delta.parts has {len(self.parts)} entries; this rank receives block part {index}")
        return self.parts[index]


DELTA_BASE_INFO = "weight_delta_base"
"""/server_info's key (engines that take deltas): the weight version of the bases this engine keeps, or null (none:
a first push, a restart, or a push that kept none); the learner sends a delta only against it."""
WEIGHT_COMMITS_INFO = "weight_commits"
"""The embedded engine's /server_info field: how many weight updates it has applied since it started. The learner
records it after each push that landed; a count that moved without a push of its is weights changed under it
(weight_sync/engines.py). SGLang shows none."""

SAMPLING_PARAM_FIELDS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop_token_ids",
    "ignore_eos",
    "sampling_seed",
)
"""The keys of `sampling_params` this project sends (all defined by SGLang's SamplingParams)."""

DEFAULT_WEIGHT_VERSION = "default"
"""SGLang's `--weight-version` default: the weights the server was launched with, i.e. version 0 here."""


def build_generate_request(
    input_ids: list[int],
    sampling_params: dict[str, Any],
    *,
    rid: str | None = None,
    return_logprob: bool = True,
    routed_experts_start_len: int | None = None,
) -> dict[str, Any]:
    """The JSON body of a token-in/token-out /generate call (one sequence, not streamed). `routed_experts_start_len`
    set: also ask for the routed experts of positions [it, seqlen - 1) (SGLang's return_routed_experts)."""
    unknown = set(sampling_params) - set(SAMPLING_PARAM_FIELDS)
    if unknown:
        raise ValueError(f"unsupported sampling params {sorted(unknown)}; allowed: {SAMPLING_PARAM_FIELDS}")
    if not input_ids or not all(isinstance(t, int) for t in input_ids):
        raise ValueError("input_ids must be a non-empty list of ints (token-in/token-out)")
    body: dict[str, Any] = {
        "input_ids": list(input_ids),
        "sampling_params": {k: v for k, v in sampling_params.items() if v is not None},
        "return_logprob": return_logprob,
        "stream": False,
    }
    if rid is not None:
        body["rid"] = rid
    if routed_experts_start_len is not None:
        if not 0 <= routed_experts_start_len <= len(input_ids):
            raise ValueError(f"routed_experts_start_len={routed_experts_start_len} outside [0, {len(input_ids)}]")
        body["return_routed_experts"] = True
        if routed_experts_start_len:  # the field exists from 0.5.8 on; 0 is its default
            body["routed_experts_start_len"] = routed_experts_start_len
    return body


def version_to_int(version: str | int | None) -> int:
    """SGLang weight_version string -> the project's integer version ("default" is 0)."""
    if isinstance(version, int):
        return version
    if version is None or version == DEFAULT_WEIGHT_VERSION:
        return 0
    try:
        return int(version)
    except ValueError:
        raise ValueError(
            f"weight_version {version!r} is not an integer; push integer versions (weight_version=str(step)) "
            f"and launch engines with --weight-version 0"
        ) from None


@dataclass(frozen=True)
class GenerateResult:
    """A finished /generate call, per generated token aligned: output_ids[i], logprobs[i], versions[i]."""

    rid: str
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_type: str  # stop | length | abort
    finish_reason: dict[str, Any]
    weight_version: int  # server version when the request finished
    prompt_tokens: int
    text: str | None = None
    routed_experts: np.ndarray | None = None  # int32, flat: [seqlen - 1 - start_len, layers, top_k] when asked for

    @property
    def aborted(self) -> bool:
        return self.finish_type == "abort"


def _per_token_versions(meta: dict[str, Any], n: int) -> list[int]:
    spans = meta.get("weight_versions")
    if not spans:
        return [version_to_int(meta.get("weight_version"))] * n
    versions: list[int | None] = [None] * n
    for span in spans:
        v = version_to_int(span["version"])
        for i in range(int(span["start"]), min(int(span["end"]), n)):
            versions[i] = v
    if any(v is None for v in versions):
        raise ValueError(f"meta_info.weight_versions {spans} do not cover the {n} output tokens")
    return versions  # type: ignore[return-value]


def parse_generate_response(
    body: dict[str, Any], *, expect_logprobs: bool = True, expect_routes: bool = False
) -> GenerateResult:
    """Parse a non-streamed single /generate response; ValueError names what is missing or inconsistent.
    `expect_routes`: the request asked for return_routed_experts (an aborted request may carry none)."""
    if "error" in body:
        raise ValueError(f"engine error: {body['error']}")
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise ValueError(f"/generate response has no meta_info: keys {sorted(body)}")
    entries = meta.get("output_token_logprobs")
    if expect_logprobs and entries is None:
        raise ValueError("meta_info.output_token_logprobs missing; send return_logprob=true")
    ids = body.get("output_ids")
    if ids is None:
        if entries is None:
            raise ValueError("/generate response has neither output_ids nor output_token_logprobs")
        ids = [int(e[1]) for e in entries]
    ids = [int(t) for t in ids]
    logprobs: list[float] = []
    if entries is not None:
        if len(entries) != len(ids):
            raise ValueError(f"{len(entries)} output_token_logprobs for {len(ids)} output_ids")
        for i, (lp, tok, *_) in enumerate(entries):
            if int(tok) != ids[i]:
                raise ValueError(f"output_token_logprobs[{i}] is for token {tok}, output_ids[{i}] is {ids[i]}")
            if not math.isfinite(float(lp)):
                raise ValueError(f"output_token_logprobs[{i}] is {lp}: a sampled token has a finite log-probability")
            logprobs.append(float(lp))
    reason = meta.get("finish_reason")
    if isinstance(reason, str):  # very old servers
        reason = {"type": reason}
    if not isinstance(reason, dict) or reason.get("type") not in ("stop", "length", "abort"):
        raise ValueError(f"unexpected finish_reason {reason!r} (is the request still running?)")
    return GenerateResult(
        rid=str(meta.get("id", "")),
        output_ids=ids,
        logprobs=logprobs,
        versions=_per_token_versions(meta, len(ids)),
        finish_type=reason["type"],
        finish_reason=reason,
        weight_version=version_to_int(meta.get("weight_version")),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        text=body.get("text"),
        routed_experts=_routed_experts(meta, expect_routes and reason["type"] != "abort"),
    )


def _routed_experts(meta: dict[str, Any], expected: bool) -> np.ndarray | None:
    """meta_info.routed_experts: base64 of little-endian int32 (SGLang's detokenizer encodes the tensor's bytes)."""
    raw = meta.get("routed_experts")
    if raw is None:
        if expected:
            raise ValueError("meta_info.routed_experts missing though return_routed_experts was sent: start the "
                             "server with --enable-return-routed-experts (SGLang >= 0.5.7)")  # fmt: skip
        return None
    data = base64.b64decode(raw, validate=True)
    if len(data) % 4:
        raise ValueError(f"meta_info.routed_experts holds {len(data)} bytes, not a whole number of int32")
    return np.frombuffer(data, dtype="<i4")


# ---- the weight-update protocol, by server version ----------------------------------------------------------------
# Read from the PyPI wheels of every 0.5.x release from 0.5.2 to 0.5.23 (docs/weight_sync.md "SGLang versions"):
#   0.5.6   /update_weights_from_distributed takes load_format="flattened_bucket" (one uint8 buffer, one broadcast);
#           /pause_generation takes mode abort|retract|in_place (before: it always aborts every request);
#           /server_info (before: /get_server_info) and /weights_checker appear.
#   0.5.7   /generate's return_routed_experts -> meta_info.routed_experts (with --enable-return-routed-experts).
#   0.5.8   routed_experts_start_len (absent in 0.5.7).
#   0.5.19  /generate's meta_info.weight_versions: per-token version spans.
#   0.5.21  updates must run inside a session: /begin_weight_update ... /end_weight_update ("must run between").
#   0.5.22  a cache flush refused because requests run fails the update call ("Weights were updated, but the cache
#           was not flushed"); before, the scheduler asserts "Cache flush failed after updating weights" and dies.
FLATTENED_BUCKET_SINCE = (0, 5, 6)
PAUSE_MODES_SINCE = (0, 5, 6)
WEIGHTS_CHECKER_SINCE = (0, 5, 6)
SERVER_INFO_SINCE = (0, 5, 6)
VERSION_SPANS_SINCE = (0, 5, 19)
SESSION_SINCE = (0, 5, 21)
FLUSH_REFUSAL_FAILS_SINCE = (0, 5, 22)
ROUTED_EXPERTS_SINCE = (0, 5, 7)  # /generate return_routed_experts, server flag --enable-return-routed-experts
ROUTED_EXPERTS_START_SINCE = (0, 5, 8)  # routed_experts_start_len: routes of a later turn's new positions only
EMBEDDED_ENGINE = "megatron_sao.embedded"
LOADS_IN_PLACE_INFO = "loads_in_place"
"""/server_info of an embedded engine: true when it was started with --load-in-place (ServerProtocol.in_place)."""
"""/server_info's "engine" of the embedded CPU engine (it also reports the SGLang version whose rules it follows)."""
PUSH_AGENT = "megatron_sao.agent"
"""/server_info's "engine" of a push agent (engines/agent/): it answers for the engine behind it (the version whose
rules it follows is that engine's), receives a shard-aware push beside it without pausing it and hands each engine
rank its slice over /update_weights_from_tensor at the session's end."""


def agent_url(engine_url: str, port_offset: int) -> str:
    """Where the push agent of the engine at `engine_url` listens: its host, its port + `port_offset`
    (weight_sync.agent_port_offset)."""
    u = urlparse(engine_url if "://" in engine_url else f"http://{engine_url}")
    if not u.hostname or not u.port:
        raise ValueError(f"engine url {engine_url!r}: expected http://HOST:PORT")
    return f"http://{u.hostname}:{u.port + port_offset}"


def checksum_device(info: dict[str, Any]) -> str:
    """Which of SGLang's two tensor hashes an engine's /weights_checker applies to its weights (srt/managers/
    mm_utils.tensor_hash): "cuda" -- its Triton gpu_tensor_hash (distributed/flat_bucket.gpu_tensor_checksum) -- for
    weights on a CUDA device, "cpu" -- sha256 (flat_bucket.tensor_checksum) -- for weights on the CPU. From
    /server_info's `device` (SGLang's --device; unset means its auto-detection, a GPU on any machine that serves
    it); the embedded engine holds its weights on the CPU unless it says otherwise."""
    device = info.get("device") if isinstance(info, dict) else None
    if isinstance(device, dict):  # a release that nests its server-argument namespaces
        device = device.get("device")
    if isinstance(device, str) and device:
        return "cuda" if device.split(":")[0] == "cuda" else "cpu"
    return "cpu" if isinstance(info, dict) and info.get("engine") == EMBEDDED_ENGINE else "cuda"


def parse_version(version: str) -> tuple[int, int, int]:
    """'0.5.23' / '0.5.6.post2' / '0.5.24rc1' / '0.5.24.dev3+gabc' -> (0, 5, 23) ...; ValueError otherwise."""
    parts = []
    for piece in str(version).split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
    if len(parts) < 2:
        raise ValueError(f"SGLang version {version!r} is not of the form MAJOR.MINOR.PATCH")
    return (parts[0], parts[1], parts[2] if len(parts) > 2 else 0)


@dataclass(frozen=True)
class ServerProtocol:
    """What an engine's weight-update protocol allows, decided from its /server_info `version` (and `engine`).

    `staged` is the embedded engine's own guarantee (with a session): it receives every update of a session into
    a staging area and switches weights and weight_version together at one decode-step boundary when the session
    ends, so a push cut anywhere leaves it serving the previous weights. A real SGLang server loads each update
    into the live model; a push that failed part-way leaves it "partially updated" (its words), so it must not
    serve until a complete push lands."""

    version: str
    embedded: bool = False
    agent: bool = False  # a push agent in front of the engine (engines/agent/)
    in_place: bool = False  # an embedded engine started with --load-in-place: SGLang's loading, no staging

    @property
    def release(self) -> tuple[int, int, int]:
        return parse_version(self.version)

    @property
    def flattened_bucket(self) -> bool:
        return self.release >= FLATTENED_BUCKET_SINCE

    @property
    def pause_modes(self) -> tuple[str, ...]:
        return ("abort", "retract", "in_place") if self.release >= PAUSE_MODES_SINCE else ("abort",)

    @property
    def weights_checker(self) -> bool:
        return self.release >= WEIGHTS_CHECKER_SINCE

    @property
    def server_info_route(self) -> bool:
        """/server_info exists (before: only /get_server_info)."""
        return self.release >= SERVER_INFO_SINCE

    @property
    def version_spans(self) -> bool:
        return self.release >= VERSION_SPANS_SINCE

    @property
    def session(self) -> bool:
        return self.release >= SESSION_SINCE

    @property
    def flush_refusal_fails(self) -> bool:
        """True: a refused post-update flush fails the call; False: the server's scheduler dies on it."""
        return self.release >= FLUSH_REFUSAL_FAILS_SINCE

    @property
    def sharded_bucket(self) -> bool:
        """Takes load_format="sharded_bucket" (each rank its own slices): the embedded engine, where flattened
        buckets exist; a real SGLang server never (docs/weight_sync.md "Shard-aware pushes")."""
        return (self.embedded or self.agent) and self.flattened_bucket

    @property
    def deltas(self) -> bool:
        """Takes the `delta` field (weight deltas against a kept base, distributed/delta.py): the embedded engine
        and the push agent, with sessions (a base is made at a session's commit); a real SGLang server never -- it
        takes deltas through an agent, which hands each rank its full slice."""
        return self.staged

    @property
    def routed_experts(self) -> bool:
        return self.release >= ROUTED_EXPERTS_SINCE

    @property
    def routed_experts_start(self) -> bool:
        return self.release >= ROUTED_EXPERTS_START_SINCE

    @property
    def staged(self) -> bool:
        """The engine keeps serving its previous weights and version until the session's end: the embedded engine
        stages a push; a push agent holds it beside the engine and hands it over at the end (pausing an engine that
        loads in place only for the handover). An embedded engine started with --load-in-place does not: it loads
        each update into the live model at its call, as SGLang does."""
        return (self.embedded or self.agent) and self.session and not self.in_place

    @classmethod
    def from_server_info(cls, info: dict[str, Any], url: str = "") -> ServerProtocol:
        version = info.get("version") if isinstance(info, dict) else None
        if not version:
            raise ValueError(f"engine {url}: /server_info carries no 'version'; cannot tell its weight-update protocol")
        engine = info.get("engine")
        embedded = engine == EMBEDDED_ENGINE
        proto = cls(str(version), embedded=embedded, agent=engine == PUSH_AGENT,
                    in_place=embedded and bool(info.get(LOADS_IN_PLACE_INFO, False)))  # fmt: skip
        proto.release  # noqa: B018 - raises ValueError on a version that does not parse
        return proto

"""SGLang's native HTTP API as the project uses it: endpoint paths, the /generate request body and the parsed
/generate response (owned by rollout/; client.py sends and parses with it, engine/server.py answers in the same
shape; tests/rollout/test_sglang_contract.py pins every field against SGLang's source).

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

from dataclasses import dataclass
from typing import Any

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
SERVER_INFO = "/server_info"
GET_WEIGHTS_BY_NAME = "/get_weights_by_name"  # {"name", "truncate_size"=100} -> the first rows, as float lists

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
) -> dict[str, Any]:
    """The JSON body of a token-in/token-out /generate call (one sequence, not streamed)."""
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


def parse_generate_response(body: dict[str, Any], *, expect_logprobs: bool = True) -> GenerateResult:
    """Parse a non-streamed single /generate response; ValueError names what is missing or inconsistent."""
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
    )

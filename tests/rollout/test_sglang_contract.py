"""The SGLang wire contract: the fields the client sends and parses, pinned to SGLang's own definitions.

Source read: SGLang 0.5.23, the PyPI wheel sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl (its _version.py says
0.5.23); older spellings from sgl-project/sglang at commit 0025436eab0556737d615b36a4dd3e1e26e82f3d
(python/sglang/srt/entrypoints/http_server.py: /get_model_info and /get_weight_version -> {"weight_version"}).
Files (paths inside the package): srt/managers/io_struct.py, srt/entrypoints/http_server.py,
api/v1/api_types.py (the JSON contract /generate bodies are checked against), srt/managers/tokenizer_manager.py,
srt/managers/schedule_batch.py, srt/utils/weight_versions.py, srt/layers/sampler.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from megatron_sao.rollout import protocol as P
from megatron_sao.rollout.client import EngineError, SGLangClient

# io_struct.py `class GenerateReqInput` (dataclass) -- the request fields this project may send.
GENERATE_REQ_INPUT_FIELDS = frozenset(
    {"rid", "text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
     "return_text_in_logprobs", "stream"}
)  # fmt: skip
# api/v1/api_types.py `class SamplingParams` ("unknown keys rejected"): the full key set of 0.5.23.
SGLANG_SAMPLING_PARAMS = frozenset(
    {"max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
     "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
     "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
     "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice"}
)  # fmt: skip
# Top-level keys of a finished non-streamed response: tokenizer_manager.py `_handle_batch_output`
# (BatchStrOutput: text, output_ids, meta_info; BatchTokenIDOutput with --skip-tokenizer-init: output_ids, meta_info).
RESPONSE_KEYS_WITH_TOKENIZER = frozenset({"text", "output_ids", "meta_info"})
RESPONSE_KEYS_SKIP_TOKENIZER = frozenset({"output_ids", "meta_info"})
# meta_info keys: `_handle_batch_output` (id, finish_reason, prompt_tokens, weight_version, completion_tokens,
# cached_tokens), `add_logprob_to_meta_info` (input_token_logprobs, output_token_logprobs,
# output_token_logprobs_length), weight_versions.py `add_weight_versions_to_meta_info` (weight_versions).
META_INFO_KEYS = frozenset(
    {"id", "finish_reason", "prompt_tokens", "weight_version", "completion_tokens", "cached_tokens",
     "input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length", "weight_versions"}
)  # fmt: skip
# schedule_batch.py: FINISH_MATCHED_TOKEN / FINISH_MATCHED_STR .to_json -> {"type": "stop", "matched"},
# FINISH_LENGTH -> {"type": "length", "length"},
# FINISH_ABORT -> {"type": "abort", "message", "status_code", "err_type"}.
FINISH_REASON_KEYS = {"stop": {"type", "matched"}, "length": {"type", "length"},
                      "abort": {"type", "message", "status_code", "err_type"}}  # fmt: skip
# tokenizer_manager.py `detokenize_logprob_tokens`: (logprob, token_id, None) unless return_text_in_logprobs.
LOGPROB_ENTRY_LEN = 3
# weight_versions.py `WeightVersionSpan` -> {"version": str, "start": int, "end": int} over output tokens.
WEIGHT_VERSION_SPAN_KEYS = frozenset({"version", "start", "end"})
# io_struct.py request structs of the control endpoints.
INIT_WEIGHTS_UPDATE_GROUP_FIELDS = frozenset(
    {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}
)  # InitWeightsUpdateGroupReqInput
UPDATE_WEIGHTS_FROM_DISTRIBUTED_FIELDS = frozenset(
    {
        "names",
        "dtypes",
        "shapes",
        "group_name",
        "flush_cache",
        "abort_all_requests",
        "weight_version",
        "load_format",
        "torch_empty_cache",
    }
)  # UpdateWeightsFromDistributedReqInput (+ rid, http_worker_ipc from BaseReq)
DESTROY_WEIGHTS_UPDATE_GROUP_FIELDS = frozenset({"group_name"})  # DestroyWeightsUpdateGroupReqInput
ABORT_REQ_FIELDS = frozenset({"rid", "abort_all", "finished_reason", "abort_message", "weight_versions"})  # AbortReq
PAUSE_MODES = frozenset({"abort", "retract", "in_place"})  # PauseGenerationReqInput.mode (default "abort")
# http_server.py routes (0.5.23), plus the older /get_weight_version (commit 0025436e).
ROUTES = {
    "/generate": {"POST", "PUT"},
    "/health": {"GET"},
    "/health_generate": {"GET"},
    "/model_info": {"GET"},
    "/get_model_info": {"GET"},
    "/get_weight_version": {"GET"},
    "/flush_cache": {"GET", "POST"},
    "/abort_request": {"POST"},
    "/pause_generation": {"POST"},
    "/continue_generation": {"POST"},
    "/init_weights_update_group": {"POST"},
    "/destroy_weights_update_group": {"POST"},
    "/update_weights_from_distributed": {"POST"},
    "/get_weights_by_name": {"GET", "POST"},
}
# Canned responses in SGLang's shapes (0.5.23 with spans; an older server without them).
SGLANG_0_5_23_RESPONSE = {
    "text": " hi",
    "output_ids": [11, 12, 2],
    "meta_info": {
        "id": "r1", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 4, "weight_version": "8",
        "num_retractions": 0, "reasoning_tokens": 0, "completion_tokens": 3, "cached_tokens": 0,
        "input_token_logprobs": [], "output_token_logprobs": [[-0.5, 11, None], [-1.5, 12, None], [-0.1, 2, None]],
        "output_token_logprobs_length": 3,
        "weight_versions": [{"version": "7", "start": 0, "end": 2}, {"version": "8", "start": 2, "end": 3}],
    },
}  # fmt: skip
OLDER_SKIP_TOKENIZER_RESPONSE = {
    "output_ids": [5, 6],
    "meta_info": {
        "id": "r2", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3, "weight_version": "default",
        "completion_tokens": 2, "cached_tokens": 0, "output_token_logprobs": [[-2.0, 5, None], [-3.0, 6, None]],
    },
}  # fmt: skip


def test_request_builder_sends_only_sglang_fields() -> None:
    sp = {"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "stop_token_ids": [2], "sampling_seed": 3}
    body = P.build_generate_request([1, 2, 3], sp, rid="x")
    assert set(body) <= GENERATE_REQ_INPUT_FIELDS
    assert set(body["sampling_params"]) <= SGLANG_SAMPLING_PARAMS
    assert set(P.SAMPLING_PARAM_FIELDS) <= SGLANG_SAMPLING_PARAMS
    assert body["input_ids"] == [1, 2, 3] and body["return_logprob"] is True and body["stream"] is False
    with pytest.raises(ValueError, match="unsupported sampling params"):
        P.build_generate_request([1], {"stop": ["x"]})


def test_parser_reads_sglang_0_5_23_per_token_versions_and_logprobs() -> None:
    r = P.parse_generate_response(json.loads(json.dumps(SGLANG_0_5_23_RESPONSE)))
    assert r.output_ids == [11, 12, 2] and r.logprobs == [-0.5, -1.5, -0.1]
    assert r.versions == [7, 7, 8] and r.weight_version == 8
    assert r.finish_type == "stop" and r.prompt_tokens == 4 and r.rid == "r1"


def test_parser_reads_older_responses_without_spans() -> None:
    r = P.parse_generate_response(OLDER_SKIP_TOKENIZER_RESPONSE)
    assert r.versions == [0, 0] and r.finish_type == "length" and r.text is None
    no_ids = {"meta_info": dict(OLDER_SKIP_TOKENIZER_RESPONSE["meta_info"])}  # ids recovered from the logprob entries
    assert P.parse_generate_response(no_ids).output_ids == [5, 6]


def test_parser_rejects_misaligned_logprobs() -> None:
    bad = json.loads(json.dumps(SGLANG_0_5_23_RESPONSE))
    bad["meta_info"]["output_token_logprobs"][1][1] = 99
    with pytest.raises(ValueError, match="output_token_logprobs\\[1\\]"):
        P.parse_generate_response(bad)
    bad["meta_info"]["output_token_logprobs"].pop()
    with pytest.raises(ValueError, match="2 output_token_logprobs for 3"):
        P.parse_generate_response(bad)


def _check_response_shape(out: dict[str, Any], keys: frozenset[str]) -> None:
    assert set(out) == keys
    meta = out["meta_info"]
    assert set(meta) - {"e2e_latency"} <= META_INFO_KEYS
    assert set(meta["finish_reason"]) <= FINISH_REASON_KEYS[meta["finish_reason"]["type"]]
    assert all(len(e) == LOGPROB_ENTRY_LEN and e[2] is None for e in meta["output_token_logprobs"])
    assert all(set(s) == WEIGHT_VERSION_SPAN_KEYS for s in meta["weight_versions"])
    assert isinstance(meta["weight_version"], str)


def test_embedded_engine_answers_in_sglang_shape(engine_url: str) -> None:
    client = SGLangClient(engine_url)
    body = P.build_generate_request([1, 5, 6], {"max_new_tokens": 4, "temperature": 0.0})
    out = client.request("POST", P.GENERATE, body)
    _check_response_shape(out, RESPONSE_KEYS_WITH_TOKENIZER)
    assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    parsed = P.parse_generate_response(out)
    assert parsed.output_ids == out["output_ids"] and len(parsed.logprobs) == len(parsed.output_ids)


def test_embedded_engine_serves_the_pinned_routes(engine_url: str) -> None:
    served = {p for p in vars(P).values() if isinstance(p, str) and p.startswith("/")}
    assert set(ROUTES) <= served
    client = SGLangClient(engine_url)
    for path, methods in ROUTES.items():
        if "GET" in methods and path not in ("/flush_cache", "/get_weights_by_name"):
            client.request("GET", path)  # 2xx, else EngineError
    rows = client.get_weights_by_name("model.embed_tokens.weight", truncate_size=2)
    assert len(rows) == 2 and all(isinstance(x, float) for x in rows[0])
    with pytest.raises(EngineError) as err:
        client.get_weights_by_name("model.no_such.weight")
    assert err.value.status == 400 and "no such weight" in str(err.value)
    info = client.request("GET", P.MODEL_INFO)
    assert {"model_path", "weight_version", "is_generation"} <= set(info)
    assert client.request("GET", P.GET_WEIGHT_VERSION) == {"weight_version": info["weight_version"]}


def test_control_request_bodies_use_sglang_field_names() -> None:
    sent: list[tuple[str, Any]] = []

    class Recorder(SGLangClient):
        def request(self, method: str, path: str, body: Any = None, *, timeout_s: float | None = None) -> Any:
            sent.append((path, body))
            return {"success": True, "message": ""}

    c = Recorder("http://127.0.0.1:1")
    c.init_weights_update_group("127.0.0.1", 29500, 1, 2, "g", "gloo")
    c.update_weights_from_distributed(["w"], ["float32"], [[2]], group_name="g", weight_version=3)
    c.destroy_weights_update_group("g")
    c.abort("rid-1")
    c.pause_generation("in_place")
    bodies = dict(sent)
    assert set(bodies[P.INIT_WEIGHTS_UPDATE_GROUP]) == INIT_WEIGHTS_UPDATE_GROUP_FIELDS
    assert set(bodies[P.UPDATE_WEIGHTS_FROM_DISTRIBUTED]) <= UPDATE_WEIGHTS_FROM_DISTRIBUTED_FIELDS
    assert bodies[P.UPDATE_WEIGHTS_FROM_DISTRIBUTED]["weight_version"] == "3"  # SGLang's weight_version is a str
    assert set(bodies[P.DESTROY_WEIGHTS_UPDATE_GROUP]) == DESTROY_WEIGHTS_UPDATE_GROUP_FIELDS
    assert set(bodies[P.ABORT_REQUEST]) <= ABORT_REQ_FIELDS
    assert bodies[P.PAUSE_GENERATION]["mode"] in PAUSE_MODES

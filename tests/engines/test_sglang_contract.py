"""The SGLang wire contract: the fields the client sends and parses, pinned to SGLang's own definitions.

Source read: SGLang 0.5.23, the PyPI wheel sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl (its _version.py says
0.5.23). The weight-update side is checked against the wheel itself (tests/engines/sglang_source.py: the request
structs' fields, the routes and methods, the engine's messages, and SGLang's FlattenedTensorBucket and checksum code
run on our bytes); the generate side below pins what tokenizer_manager builds at run time. Older spellings from
sgl-project/sglang at commit 0025436eab0556737d615b36a4dd3e1e26e82f3d
(python/sglang/srt/entrypoints/http_server.py: /get_model_info and /get_weight_version -> {"weight_version"}).
Files (paths inside the package): srt/managers/io_struct.py, srt/entrypoints/http_server.py,
api/v1/api_types.py (the JSON contract /generate bodies are checked against), srt/managers/tokenizer_manager.py,
srt/managers/schedule_batch.py, srt/utils/weight_versions.py, srt/layers/sampler.py.
"""

from __future__ import annotations

import ast
import json
from typing import Any

import pytest
import torch

from megatron_sao.distributed import flat_bucket
from megatron_sao.engines import protocol as P
from megatron_sao.engines.client import EngineError, SGLangClient
from tests.engines import sglang_source

# io_struct.py `class GenerateReqInput` (dataclass) -- the request fields this project may send.
GENERATE_REQ_INPUT_FIELDS = frozenset(
    {"rid", "text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
     "return_text_in_logprobs", "stream", "return_routed_experts", "routed_experts_start_len"}
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
     "input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length", "weight_versions",
     "routed_experts"}
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
    "/update_weights_from_tensor": {"POST"},
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


# ---- the weight-update protocol, against the wheel itself --------------------------------------------------------
IO = "srt/managers/io_struct.py"
# what each control call of SGLangClient sends, and the io_struct class that parses it (http_server.py's handlers)
CONTROL_STRUCTS = {
    P.INIT_WEIGHTS_UPDATE_GROUP: "InitWeightsUpdateGroupReqInput",
    P.UPDATE_WEIGHTS_FROM_DISTRIBUTED: "UpdateWeightsFromDistributedReqInput",
    P.UPDATE_WEIGHTS_FROM_TENSOR: "UpdateWeightsFromTensorReqInput",
    P.DESTROY_WEIGHTS_UPDATE_GROUP: "DestroyWeightsUpdateGroupReqInput",
    P.BEGIN_WEIGHT_UPDATE: "BeginWeightUpdateReqInput",
    P.END_WEIGHT_UPDATE: "EndWeightUpdateReqInput",
    P.UPDATE_WEIGHT_VERSION: "UpdateWeightVersionReqInput",
    P.WEIGHTS_CHECKER: "CheckWeightsReqInput",
    P.PAUSE_GENERATION: "PauseGenerationReqInput",
    P.GET_WEIGHTS_BY_NAME: "GetWeightsByNameReqInput",
    P.ABORT_REQUEST: "AbortReq",
}


def _sent_control_bodies() -> dict[str, Any]:
    sent: dict[str, Any] = {}

    class Recorder(SGLangClient):
        def request(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
            sent[path] = (method, body)
            return {"success": True, "message": "", "version": "0.5.23"}

    c = Recorder("http://127.0.0.1:1")
    c.init_weights_update_group("127.0.0.1", 29500, 1, 2, "g", "gloo")
    c.update_weights_from_distributed(["w"], ["float32"], [[2]], group_name="g", weight_version=3,
                                      flush_cache=False, load_format="flattened_bucket")  # fmt: skip
    c.update_weights_from_tensor(["AAAA"], load_format="direct", weight_version=4, flush_cache=False)
    c.destroy_weights_update_group("g")
    c.begin_weight_update()
    c.end_weight_update()
    c.update_weight_version(4)
    c.weights_checksum(["lm_head.weight"])
    c.pause_generation("in_place")
    c.get_weights_by_name("model.norm.weight", 3)
    c.abort("rid-1")
    c.continue_generation()
    return sent


@pytest.mark.multiproc
def test_control_bodies_are_fields_of_sglang_request_structs() -> None:
    sent = _sent_control_bodies()
    for path, cls in CONTROL_STRUCTS.items():
        method, body = sent[path]
        fields = set(sglang_source.class_fields(IO, cls))
        assert set(body) <= fields, f"{path} sends {sorted(set(body) - fields)} that {cls} does not define"
        assert method in sglang_source.routes()[path], f"{method} {path} is not routed by SGLang"
    fields = sglang_source.class_fields(IO, "UpdateWeightsFromDistributedReqInput")
    assert sent[P.UPDATE_WEIGHTS_FROM_DISTRIBUTED][1]["weight_version"] == "3"  # a str field in SGLang
    # deltas are this project's own field: SGLang has none, so they go only to engines whose protocol takes them
    assert P.DELTA not in fields and P.DELTA not in sent[P.UPDATE_WEIGHTS_FROM_DISTRIBUTED][1]
    assert not P.ServerProtocol("0.5.23").deltas and P.ServerProtocol("0.5.23", agent=True).deltas
    mode = sglang_source.class_fields(IO, "PauseGenerationReqInput")["mode"].annotation
    assert isinstance(mode, ast.Subscript) and ast.unparse(mode.value) == "Literal"
    assert set(P.ServerProtocol(sglang_source.PINNED).pause_modes) == set(ast.literal_eval(mode.slice))
    default = fields["flush_cache"].value
    assert default is not None and ast.literal_eval(default) is True  # SGLang flushes unless told not: we always say


def test_the_pinned_wheel_is_the_release_the_engine_emulates() -> None:
    from megatron_sao.engines.embedded.server import EMULATED_SGLANG

    assert sglang_source.version_string() == sglang_source.PINNED == EMULATED_SGLANG
    proto = P.ServerProtocol(sglang_source.PINNED)
    assert proto.session and proto.flattened_bucket and proto.flush_refusal_fails and proto.weights_checker
    routes = sglang_source.routes()
    for path in (P.SERVER_INFO, P.GET_SERVER_INFO, P.BEGIN_WEIGHT_UPDATE, P.END_WEIGHT_UPDATE, P.WEIGHTS_CHECKER,
                 P.UPDATE_WEIGHT_VERSION, *(r for r in ROUTES if r != P.GET_WEIGHT_VERSION)):  # fmt: skip
        assert path in routes, f"SGLang {sglang_source.PINNED} has no route {path}"
    assert '"version": __version__' in sglang_source.source("srt/entrypoints/http_server.py")


def test_engine_answers_with_sglang_s_own_messages() -> None:
    """The refusals the embedded engine emulates are worded as SGLang words them (trainers match on them)."""
    text = sglang_source.source("srt/managers/scheduler_components/weight_updater.py")
    flat = " ".join(text.split())
    for message in (
        'must run between " "begin_weight_update() and end_weight_update()',
        'a weight-update session is already open; " "call end_weight_update() first',
        "no weight-update session is open; call begin_weight_update() first",
        'Weights were updated, but the cache was not flushed because " "requests are still running',
    ):
        assert message in flat, message
    model_runner = sglang_source.source("srt/model_executor/model_runner_components/weight_updater.py")
    assert "Please discard the whole weights." in model_runner and 'load_format == "flattened_bucket"' in model_runner


def _mixed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "a.bias": torch.randn(3, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(5, 7, generator=g),
        "c.scale": torch.tensor(2.5, dtype=torch.float64),
        "d.weight": torch.randn(2, 3, generator=g).to(torch.float16),
        "e.idx": torch.arange(5, dtype=torch.int8),
        "f.weight": torch.randn(4, generator=g),
    }


def test_our_flattened_bucket_is_read_by_sglang_s_own_bucket_code() -> None:
    bucket_cls = sglang_source.tensor_bucket_module().FlattenedTensorBucket
    tensors = _mixed_tensors()
    names = flat_bucket.aligned_order(list(tensors), lambda n: tensors[n].dtype)
    dtypes, shapes = [flat_bucket.dtype_name(tensors[n].dtype) for n in names], [list(tensors[n].shape) for n in names]
    slots = flat_bucket.layout(names, [tensors[n].dtype for n in names], shapes)
    buffer = torch.empty(flat_bucket.nbytes(slots), dtype=torch.uint8)
    for slot in slots:
        flat_bucket.view(buffer, slot).copy_(tensors[slot.name])
    theirs = bucket_cls.empty(names, dtypes, shapes, "cpu")
    assert [(m.start_idx, m.end_idx) for m in theirs.get_metadata()] == [(s.start, s.end) for s in slots]
    theirs.get_flattened_tensor().copy_(buffer)  # what their broadcast receive writes
    for name, tensor in theirs.reconstruct_tensors():
        assert tensor.dtype == tensors[name].dtype and torch.equal(tensor, tensors[name]), name
    # SGLang builds a send bucket from named tensors the same way: identical bytes
    assert torch.equal(bucket_cls(named_tensors=[(n, tensors[n]) for n in names]).get_flattened_tensor(), buffer)
    bad = ["a.bias", "b.weight"]  # bf16[3] (6 bytes) then fp32: unaligned for both of us
    with pytest.raises(ValueError, match="Unaligned received tensor b.weight"):
        bucket_cls.empty(bad, ["bfloat16", "float32"], [[3], [5, 7]], "cpu")
    with pytest.raises(ValueError, match="Unaligned received tensor b.weight"):
        flat_bucket.layout(bad, [torch.bfloat16, torch.float32], [[3], [5, 7]])


def _sglang_function(path: str, name: str, namespace: dict[str, Any]) -> Any:
    """One function of SGLang's source, executed alone in `namespace`."""
    for node in ast.walk(ast.parse(sglang_source.source(path))):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            exec(compile(ast.Module([node], []), path, "exec"), namespace)
            return namespace[name]
    raise KeyError(name)


def test_our_checksums_are_sglang_s_on_cpu() -> None:
    import hashlib

    ns: dict[str, Any] = {"hashlib": hashlib, "torch": torch, "Dict": dict, "flatten_nested_list": None,
                          "gpu_tensor_hash": None}  # fmt: skip
    tensor_hash = _sglang_function("srt/managers/mm_utils.py", "tensor_hash", ns)
    overall = _sglang_function("srt/utils/weight_checker.py", "overall_checksum", ns)
    tensors = _mixed_tensors()
    ours = {n: flat_bucket.tensor_checksum(t) for n, t in tensors.items()}
    assert ours == {n: f"{tensor_hash(t):016x}" for n, t in tensors.items()}
    assert flat_bucket.overall_checksum(ours) == overall(ours)


def test_versions_decide_the_protocol() -> None:
    assert P.parse_version("0.5.6.post2") == (0, 5, 6) and P.parse_version("0.5.24rc1") == (0, 5, 24)
    old, mid, new = P.ServerProtocol("0.5.5"), P.ServerProtocol("0.5.20"), P.ServerProtocol("0.5.22")
    assert not old.flattened_bucket and old.pause_modes == ("abort",) and not old.server_info_route
    assert mid.flattened_bucket and mid.version_spans and not mid.session and not mid.flush_refusal_fails
    assert new.session and new.flush_refusal_fails and not new.staged
    assert P.ServerProtocol.from_server_info({"version": "0.5.23", "engine": P.EMBEDDED_ENGINE}).staged
    with pytest.raises(ValueError, match="carries no 'version'"):
        P.ServerProtocol.from_server_info({}, "http://x:1")


def test_routed_experts_follow_sglang_s_fields_flag_and_format() -> None:
    """GenerateReqInput's return_routed_experts / routed_experts_start_len (defaults False / 0), the server flag,
    meta_info["routed_experts"] as base64 of the int32 capture buffer's bytes, rows [start_len, seqlen - 1)."""
    fields = sglang_source.class_fields(IO, "GenerateReqInput")
    assert ast.literal_eval(fields["return_routed_experts"].value) is False
    assert ast.literal_eval(fields["routed_experts_start_len"].value) == 0
    assert "enable_return_routed_experts" in sglang_source.source("srt/arg_groups/fields/exec_.py")
    tm = sglang_source.source("srt/managers/tokenizer_manager.py")
    assert 'meta_info["routed_experts"] = val' in tm and "pybase64.b64encode(val.numpy().tobytes())" in tm
    assert "dtype=torch.int32" in sglang_source.source("srt/state_capturer/base.py")
    assert "[start_len : seqlen - 1]" in sglang_source.source("srt/state_capturer/base.py")
    proto = P.ServerProtocol(sglang_source.PINNED)
    assert proto.routed_experts and proto.routed_experts_start
    assert not P.ServerProtocol("0.5.6").routed_experts and not P.ServerProtocol("0.5.7").routed_experts_start
    body = P.build_generate_request([1, 2, 3], {"max_new_tokens": 2}, routed_experts_start_len=2)
    assert set(body) <= set(fields) and body["return_routed_experts"] is True and body["routed_experts_start_len"] == 2
    assert "routed_experts_start_len" not in P.build_generate_request([1], {}, routed_experts_start_len=0)


# ---- every field of the request structs, classified (engines/embedded/fields.py) ------------------------------
def _wheel_default(node: ast.AnnAssign) -> Any:
    """A field's default as a Python value: its literal, `field(default=...)`'s, None for a required field, and
    `...` where the default is no literal (a factory)."""
    value = node.value
    if value is None:
        return None
    if isinstance(value, ast.Call) and ast.unparse(value.func) == "field":
        kw = {k.arg: k.value for k in value.keywords}
        value = kw.get("default")
        if value is None:
            return ...
    try:
        return ast.literal_eval(value)
    except ValueError:
        return ...


def _classified(fields: dict[str, ast.AnnAssign], ours: dict[str, Any], where: str) -> None:
    from megatron_sao.engines.embedded.fields import Default

    assert set(fields) == set(ours), (
        f"{where}: classify {sorted(set(fields) - set(ours))} in engines/embedded/fields.py; "
        f"{sorted(set(ours) - set(fields))} are no longer SGLang's fields"
    )
    for name, handling in ours.items():
        if isinstance(handling, Default):
            default = _wheel_default(fields[name])
            assert default is ... or handling.accepts(default), (where, name, default, handling.value)


def test_every_field_of_generate_and_sampling_params_is_classified() -> None:
    from megatron_sao.engines.embedded import fields as F
    from megatron_sao.engines.embedded.generate import SUPPORTED

    _classified(sglang_source.class_fields(IO, "GenerateReqInput"), F.GENERATE_REQ_INPUT, "GenerateReqInput")
    _classified(sglang_source.class_fields("api/v1/api_types.py", "SamplingParams"), F.SAMPLING_PARAMS,
                "SamplingParams")  # fmt: skip
    assert {k for k, v in F.SAMPLING_PARAMS.items() if v == F.SERVED} == set(SUPPORTED)
    for name in GENERATE_REQ_INPUT_FIELDS:  # what the client sends, the engine serves
        assert F.GENERATE_REQ_INPUT[name] == F.SERVED, name


def test_every_field_of_the_control_structs_is_classified() -> None:
    from megatron_sao.engines.embedded import fields as F
    from megatron_sao.engines.embedded.server import CONTROL_STRUCTS as SERVED_STRUCTS

    assert set(F.CONTROL) == set(SERVED_STRUCTS.values())
    for path, cls in CONTROL_STRUCTS.items():  # the client's calls go to the struct the engine checks
        assert SERVED_STRUCTS[path] == cls, path
    for cls, ours in F.CONTROL.items():
        _classified(sglang_source.class_fields(IO, cls), ours, cls)


def _every_default(fields: dict[str, ast.AnnAssign], ours: dict[str, Any]) -> dict[str, Any]:
    from megatron_sao.engines.embedded.fields import Default

    out = {}
    for name, handling in ours.items():
        default = _wheel_default(fields[name])
        if isinstance(handling, Default) and default is not ...:
            out[name] = default
    return out


def test_the_engine_takes_every_generate_field_at_its_default_and_names_one_it_cannot_honour(engine_url: str) -> None:
    """What a gateway in front of the engines does (sglang-router forwards SGLang's fields at their defaults, and a
    `model` key that is no field: SGLang ignores it, so does the engine); a field set to what the engine cannot do is
    a 400 naming it and the value."""
    from megatron_sao.engines.embedded import fields as F

    client = SGLangClient(engine_url)
    body = P.build_generate_request([1, 5, 6], {"max_new_tokens": 3, "temperature": 0.0})
    defaults = _every_default(sglang_source.class_fields(IO, "GenerateReqInput"), F.GENERATE_REQ_INPUT)
    sampling = _every_default(sglang_source.class_fields("api/v1/api_types.py", "SamplingParams"), F.SAMPLING_PARAMS)
    full = {**defaults, **body, "model": "default", "log_metrics": False, "custom_labels": {"team": "rl"},
            "sampling_params": {**sampling, **body["sampling_params"], "skip_special_tokens": False}}  # fmt: skip
    out = client.request("POST", P.GENERATE, full)
    assert P.parse_generate_response(out).output_ids == client.request("POST", P.GENERATE, body)["output_ids"]
    for key, value in (("return_hidden_states", True), ("lora_path", "adapter"), ("background", True)):
        with pytest.raises(EngineError) as err:
            client.request("POST", P.GENERATE, {**body, key: value})
        assert err.value.status == 400 and f"/generate.{key}={value!r}" in str(err.value), str(err.value)
    with pytest.raises(EngineError) as err:
        client.request("POST", P.GENERATE, {**body, "sampling_params": {**body["sampling_params"], "n": 2}})
    assert err.value.status == 400 and "sampling_params.n=2" in str(err.value)
    with pytest.raises(EngineError) as err:
        client.request("POST", P.GENERATE, {**body, "sampling_params": "fast"})
    assert err.value.status == 400 and "must be a JSON object" in str(err.value)
    client.request("POST", P.ABORT_REQUEST, {"rid": "nobody", "http_worker_ipc": "ipc://x", "abort_message": None})
    with pytest.raises(EngineError) as err:  # the control structs too
        client.request("POST", P.ABORT_REQUEST, {"rid": "nobody", "abort_message": "stop"})
    assert err.value.status == 400 and "/abort_request.abort_message='stop'" in str(err.value)

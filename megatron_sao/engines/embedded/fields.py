"""Every field of SGLang's request structs and what the embedded engine does with it (owned by embedded/; read by
embedded/generate.py and embedded/server.py). The pinned release's source is the spec: tests/engines/
test_sglang_contract.py enumerates each struct's fields from the wheel and fails on a field not classified here, or
on a default that differs from the wheel's.

Three ways to handle a field:
- SERVED: the engine honours it (its own checks name bad values);
- IGNORED: it changes nothing the engine computes or returns (logging, metrics, tracing, routing and cache hints
  that a one-replica engine has no use for), accepted at any value, as a single SGLang server would;
- Default(value): accepted at SGLang's default (or null), refused at any other value with a 400 naming the field and
  the value (multimodal inputs, LoRA, hidden states, grammars...): never silently dropped.
A key that is no field of the struct is ignored, as SGLang's server ignores it (FastAPI builds the dataclass from
the fields it knows; api/v1's GenerateRequest contract says "unknown keys ignored"). Sampling parameters are the
exception, as in SGLang ("unknown keys rejected").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SERVED = "served"
IGNORED = "ignored"


@dataclass(frozen=True)
class Default:
    """Accepted only at `value` (SGLang's default), null, or an empty list / dict / string where the default is null."""

    value: Any

    def accepts(self, given: Any) -> bool:
        if given is None or given == self.value:
            return True
        return self.value is None and given in ([], {}, "")


Handling = str | Default

_BASE = {"rid": SERVED, "http_worker_ipc": IGNORED}  # io_struct.BaseReq

GENERATE_REQ_INPUT: dict[str, Handling] = {
    # served (embedded/generate.py checks their values)
    "rid": SERVED, "text": SERVED, "input_ids": SERVED, "sampling_params": SERVED, "return_logprob": SERVED,
    "logprob_start_len": SERVED, "top_logprobs_num": SERVED, "return_text_in_logprobs": SERVED, "stream": SERVED,
    "return_routed_experts": SERVED, "routed_experts_start_len": SERVED,
    # nothing the engine computes or returns depends on them
    "http_worker_ipc": IGNORED, "log_metrics": IGNORED, "no_logs": IGNORED, "custom_labels": IGNORED,
    "external_trace_header": IGNORED, "received_time": IGNORED, "routing_key": IGNORED, "conversation_id": IGNORED,
    "extra_key": IGNORED, "cache_salt": IGNORED, "kv_hints": IGNORED, "session_id": IGNORED,
    # one data-parallel rank: rank 0 or none
    "routed_dp_rank": Default(0), "data_parallel_rank": Default(0), "disagg_prefill_dp_rank": Default(None),
    # features the engine does not have: refused unless at their defaults
    "input_embeds": Default(None), "image_data": Default(None), "video_data": Default(None),
    "audio_data": Default(None), "mm_hashes": Default(None), "mm_content_hashes": Default(None),
    "use_audio_in_video": Default(False), "video_config": Default(None), "watermark": Default(None),
    "token_ids_logprob": Default(None), "return_sampling_mask": Default(None), "sampling_logprobs_mode": Default(None),
    "return_flat_raw_top_logprobs": Default(False), "return_flat_raw_output_top_logprobs": Default(False),
    "return_flat_raw_top_logprobs_b64": Default(False), "return_hidden_states": Default(False),
    "return_indexer_topk": Default(False), "modalities": Default(None), "session_params": Default(None),
    "lora_path": Default(None), "lora_id": Default(None), "custom_logit_processor": Default(None),
    "positional_embed_overrides": Default(None), "bootstrap_host": Default(None), "bootstrap_port": Default(None),
    "bootstrap_room": Default(None), "bootstrap_pair_key": Default(None), "decode_tp_size": Default(None),
    "background": Default(False), "require_reasoning": Default(False), "max_thinking_tokens": Default(None),
    "priority": Default(None), "return_bytes": Default(False), "return_entropy": Default(False),
    "return_prompt_token_ids": Default(False), "need_wait_for_mm_inputs": Default(None),
    "num_items_assigned": Default(None), "encoder_urls": Default(None), "max_dynamic_patch": Default(None),
    "min_dynamic_patch": Default(None), "image_max_dynamic_patch": Default(None),
    "video_max_dynamic_patch": Default(None), "images_config": Default(None), "mm_processor_kwargs": Default(None),
    "multi_item_delimiter_indices": Default(None), "token_indices_to_pool": Default(None),
}  # fmt: skip

SAMPLING_PARAMS: dict[str, Handling] = {
    "max_new_tokens": SERVED, "temperature": SERVED, "top_p": SERVED, "top_k": SERVED, "min_p": SERVED,
    "stop_token_ids": SERVED, "ignore_eos": SERVED, "sampling_seed": SERVED,
    # shape only the detokenized text, which the engine returns as its tokenizer decodes it
    "skip_special_tokens": IGNORED, "spaces_between_special_tokens": IGNORED, "no_stop_trim": IGNORED,
    "stream_interval": IGNORED,  # streaming only; stream=true is refused
    "n": Default(1), "frequency_penalty": Default(0.0), "presence_penalty": Default(0.0),
    "repetition_penalty": Default(1.0), "min_new_tokens": Default(0), "stop": Default(None),
    "stop_regex": Default(None), "regex": Default(None), "json_schema": Default(None), "ebnf": Default(None),
    "structural_tag": Default(None),
    "logit_bias": Default({}), "custom_params": Default(None), "beam_width": Default(None), "watermark": Default(None),
    "choice": Default([]),
}  # fmt: skip

# The weight-update and control routes (embedded/server.py reads the served fields).
CONTROL: dict[str, dict[str, Handling]] = {
    "InitWeightsUpdateGroupReqInput": {**_BASE, "master_address": SERVED, "master_port": SERVED,
                                       "rank_offset": SERVED, "world_size": SERVED, "group_name": SERVED,
                                       "backend": SERVED},
    "DestroyWeightsUpdateGroupReqInput": {**_BASE, "group_name": SERVED},
    "UpdateWeightsFromDistributedReqInput": {**_BASE, "names": SERVED, "dtypes": SERVED, "shapes": SERVED,
                                             "group_name": SERVED, "flush_cache": SERVED,
                                             "abort_all_requests": SERVED, "weight_version": SERVED,
                                             "load_format": SERVED, "selector": Default("all"),
                                             "torch_empty_cache": IGNORED},
    "UpdateWeightsFromTensorReqInput": {**_BASE, "serialized_named_tensors": SERVED, "load_format": SERVED,
                                        "flush_cache": SERVED, "abort_all_requests": SERVED,
                                        "weight_version": SERVED, "selector": Default("all"),
                                        "torch_empty_cache": IGNORED},
    "UpdateWeightVersionReqInput": {**_BASE, "new_version": SERVED, "abort_all_requests": SERVED},
    "PauseGenerationReqInput": {**_BASE, "mode": SERVED},
    "ContinueGenerationReqInput": {**_BASE, "torch_empty_cache": IGNORED},
    "AbortReq": {**_BASE, "abort_all": SERVED, "finished_reason": Default(None), "abort_message": Default(None),
                 "weight_versions": Default(None)},
    "GetWeightsByNameReqInput": {**_BASE, "name": SERVED, "truncate_size": SERVED},
    "FlushCacheReqInput": {**_BASE, "timeout_s": IGNORED},
    "BeginWeightUpdateReqInput": {**_BASE, "selector": Default("all")},
    "EndWeightUpdateReqInput": dict(_BASE),
    "CheckWeightsReqInput": {**_BASE, "action": SERVED, "skip_tensor_list": SERVED,
                             "allow_quant_error": Default(False), "selector": Default("all")},
}  # fmt: skip
"""By struct name in io_struct.py; `rid` of a control request is served as SGLang serves it (a request id)."""


def check_fields(body: dict[str, Any], fields: dict[str, Handling], where: str) -> None:
    """ValueError naming the first field of `body` set to a value the engine cannot honour; keys that are no field of
    the struct pass, as SGLang's server lets them."""
    for key, value in body.items():
        handling = fields.get(key)
        if isinstance(handling, Default) and not handling.accepts(value):
            raise ValueError(f"{where}.{key}={value!r} is not supported by the embedded engine (it serves only "
                             f"SGLang's default, {handling.value!r}); drop the field or send its default")  # fmt: skip

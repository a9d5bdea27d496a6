"""/generate of the embedded engine: request validation and response building in SGLang's format (owned by
embedded/; called by embedded/server.py, feeds embedded/scheduler.py).

Accepted: `input_ids` (one list, or a list of lists for a batch) or, when the engine has a tokenizer, `text`;
`sampling_params` with the keys in SUPPORTED below; `return_logprob`, `return_text_in_logprobs`, `rid`,
`logprob_start_len` (-1 only), `top_logprobs_num` (0 only), `stream` (false only), `return_routed_experts` and
`routed_experts_start_len` (SGLang's routing capture: with --enable-return-routed-experts, meta_info.routed_experts
is base64 of int32 [seqlen - 1 - start_len, num_hidden_layers, top_k], the experts of positions [start_len,
seqlen - 1); without the flag SGLang returns none and neither does this engine). Every other field of SGLang's
GenerateReqInput and SamplingParams is classified in embedded/fields.py: accepted where it changes nothing the engine
computes, accepted at its default otherwise, and refused with a 400 naming the field and the value when set to what
the engine cannot honour (stop strings, grammars, penalties, n > 1, images, LoRA, ...), never silently dropped.
"""

from __future__ import annotations

import base64
import math
import time
import uuid
from typing import Any

import torch

from megatron_sao.engines.embedded.fields import GENERATE_REQ_INPUT, SAMPLING_PARAMS, check_fields
from megatron_sao.engines.embedded.model_runner import SamplingParams
from megatron_sao.engines.embedded.scheduler import Request, Scheduler

SUPPORTED = {
    "max_new_tokens": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "stop_token_ids": list,
    "ignore_eos": bool,
    "sampling_seed": int,
}
"""The sampling parameters the engine honours (fields.SAMPLING_PARAMS marks exactly these SERVED) and their types."""


def _typed(key: str, value: Any, kind: type) -> Any:
    """A served sampling parameter as its type; ValueError naming it when the JSON value is not of that type (a
    boolean is no number, a string no integer, 2.5 no integer)."""
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        bool: isinstance(value, bool),
        list: isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value),
    }[kind]
    if not ok:
        want = {int: "an integer", float: "a number", bool: "true or false", list: "a list of token ids"}[kind]
        raise ValueError(f"sampling_params.{key}={value!r} must be {want}")
    return tuple(value) if kind is list else kind(value)


def sampling_from_json(sp: dict[str, Any], vocab_size: int) -> SamplingParams:
    """Validate SGLang sampling_params into SamplingParams; ValueError names the offending key."""
    if not isinstance(sp, dict):
        raise ValueError(f"sampling_params must be a JSON object (or a list of them, one per input), got {sp!r}")
    unknown = sorted(set(sp) - set(SAMPLING_PARAMS))
    if unknown:  # SGLang rejects unknown sampling keys too
        raise ValueError(f"unknown sampling_params key {unknown[0]!r}; supported: {sorted(SUPPORTED)}")
    check_fields(sp, SAMPLING_PARAMS, "sampling_params")
    kwargs: dict[str, Any] = {}
    for key, value in sp.items():
        if key in SUPPORTED and value is not None:
            kwargs[key] = _typed(key, value, SUPPORTED[key])
    p = SamplingParams(**kwargs)
    for key in ("temperature", "top_p", "min_p"):  # NaN passes every comparison below: refuse it here
        if not math.isfinite(getattr(p, key)):
            raise ValueError(f"sampling_params.{key}={getattr(p, key)!r} must be a finite number")
    rules = [("temperature", p.temperature >= 0, ">= 0"), ("top_p", 0 < p.top_p <= 1, "in (0, 1]"),
             ("min_p", 0 <= p.min_p <= 1, "in [0, 1]"), ("max_new_tokens", p.max_new_tokens >= 0, ">= 0")]  # fmt: skip
    broken = [f"sampling_params.{k}={getattr(p, k)!r} must be {rule}" for k, ok, rule in rules if not ok]
    if broken:
        raise ValueError("; ".join(broken))
    if p.top_k == 0 or p.top_k < -1:
        raise ValueError(f"top_k must be -1 (disable) or at least 1, got {p.top_k}")
    if any(not 0 <= t < vocab_size for t in p.stop_token_ids):
        raise ValueError(f"stop_token_ids {list(p.stop_token_ids)} outside the vocabulary [0, {vocab_size})")
    return p


def version_spans(versions: list[str], current: str) -> list[dict[str, Any]]:
    """Per-token versions -> SGLang's meta_info.weight_versions spans over the output tokens."""
    if not versions:
        return [{"version": current, "start": 0, "end": 0}]
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


class GenerateHandler:
    def __init__(self, scheduler: Scheduler, tokenizer: Any, vocab_size: int) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        # The longest text a token can stand for, in bytes: a text longer than context x this cannot fit, and is
        # refused before it is tokenized (a huge body would otherwise hold a thread for seconds).
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        self.max_token_bytes = max((len(t.encode()) for t in vocab), default=1) if vocab else 1

    def handle(self, body: dict[str, Any]) -> tuple[int, Any]:
        try:
            reqs, opts, single = self._parse(body)
        except (ValueError, TypeError) as e:
            return 400, {"error": {"message": str(e)}}
        t0 = time.monotonic()
        for r in reqs:
            self.scheduler.submit(r)
        for r in reqs:
            r.done.wait()
        out = [self._response(r, opts, time.monotonic() - t0) for r in reqs]
        return 200, out[0] if single else out

    def _parse(self, body: dict[str, Any]) -> tuple[list[Request], dict[str, Any], bool]:
        check_fields(body, GENERATE_REQ_INPUT, "/generate")
        if body.get("stream"):
            raise ValueError("stream=true is not supported by the embedded engine; send stream=false")
        if body.get("logprob_start_len", -1) not in (-1, None) or body.get("top_logprobs_num") not in (0, None):
            raise ValueError("only output-token logprobs are served (logprob_start_len=-1, top_logprobs_num=0)")
        batch = self._input_batch(body)
        if not batch:
            raise ValueError("text must be a non-empty string or list of strings, got an empty list")
        single = not isinstance(batch[0], list)
        batch = [batch] if single else batch
        sps = body.get("sampling_params") or {}
        sps = sps if isinstance(sps, list) else [sps] * len(batch)
        rids = body.get("rid")
        if rids is None:
            rids = [uuid.uuid4().hex for _ in batch]
        elif isinstance(rids, str):
            rids = [rids] if single else [f"{rids}_{i}" for i in range(len(batch))]
        elif not isinstance(rids, list) or not all(isinstance(r, str) for r in rids):
            raise ValueError(f"rid={rids!r} must be a string (or a list of strings, one per input)")
        if not len(sps) == len(rids) == len(batch):
            raise ValueError("sampling_params / rid lists must have one entry per input")
        routes = bool(body.get("return_routed_experts")) and self.scheduler.runner.routes is not None
        start = body.get("routed_experts_start_len") or 0
        if not isinstance(start, int) or isinstance(start, bool):
            raise ValueError(f"routed_experts_start_len={start!r} must be an integer")
        reqs = []
        for ids, sp, rid in zip(batch, sps, rids):
            params = sampling_from_json(sp, self.vocab_size)
            sent = isinstance(sp, dict) and sp.get("max_new_tokens") is not None  # SGLang checks only a given one
            self._check_ids(ids, params.max_new_tokens if sent else 0)
            if body.get("return_routed_experts") and not 0 <= start <= len(ids):  # SGLang's scheduler checks
                raise ValueError(f"routed_experts_start_len={start} must be in [0, {len(ids)}] (the input tokens)")
            reqs.append(Request(str(rid), list(ids), params, return_routes=routes))
        opts = {"logprob": bool(body.get("return_logprob")), "text": bool(body.get("return_text_in_logprobs")),
                "routes_from": start}  # fmt: skip
        return reqs, opts, single

    def _input_batch(self, body: dict[str, Any]) -> list:
        if body.get("input_ids") is not None:
            ids = body["input_ids"]
            if not isinstance(ids, list) or not ids:
                raise ValueError(f"input_ids must be a non-empty list of token ids (or of lists of them), got "
                                 f"{type(ids).__name__ if ids else 'an empty list'}")  # fmt: skip
            return ids
        if body.get("text") is None:
            raise ValueError("Either text or input_ids should be provided.")
        if self.tokenizer is None:
            raise ValueError(
                "this engine serves token-in/token-out (no tokenizer / --skip-tokenizer-init): send input_ids"
            )
        texts = body["text"]
        if not isinstance(texts, str | list):
            raise ValueError(f"text must be a string or a list of strings, got {type(texts).__name__}")
        limit = self.scheduler.context_len * self.max_token_bytes
        for t in [texts] if isinstance(texts, str) else texts:
            if not isinstance(t, str):
                raise ValueError("text must be a string or a list of strings")
            if len(t) > limit:  # chars <= bytes: a cheap bound before the exact one
                raise ValueError(f"The input text ({len(t)} characters) cannot fit the model's context length "
                                 f"({self.scheduler.context_len} tokens); refused before tokenizing")  # fmt: skip
        encode = lambda t: self.tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
        return encode(texts) if isinstance(texts, str) else [encode(t) for t in texts]

    def _check_ids(self, ids: Any, max_new_tokens: int) -> None:
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids)
        ):
            raise ValueError(f"input_ids must be non-empty ints in [0, {self.vocab_size})")
        ctx = self.scheduler.context_len
        if len(ids) >= ctx:
            raise ValueError(f"The input ({len(ids)} tokens) is longer than the model's context length ({ctx} tokens).")
        if len(ids) + max_new_tokens > ctx:  # SGLang's check (tokenizer_manager, without --allow-auto-truncate)
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You "
                f"requested a total of {len(ids) + max_new_tokens} tokens: {len(ids)} tokens from the "
                f"input messages and {max_new_tokens} tokens for the completion. Please reduce the "
                "number of tokens in the input messages or the completion to fit within the limit."
            )

    def _response(self, r: Request, opts: dict[str, Any], latency: float) -> dict[str, Any]:
        n = len(r.output_ids)
        current = r.output_versions[-1] if r.output_versions else self.scheduler.weight_version
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": r.finish_reason,
            "prompt_tokens": len(r.input_ids),
            "weight_version": current,
            "completion_tokens": n,
            "cached_tokens": 0,
            "weight_versions": version_spans(r.output_versions, current),
            "e2e_latency": latency,
        }
        if opts["logprob"]:
            texts = [None] * n
            if opts["text"] and self.tokenizer is not None:
                texts = [self.tokenizer.decode([t]) for t in r.output_ids]
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[lp, t, s] for lp, t, s in zip(r.output_logprobs, r.output_ids, texts)]
            meta["output_token_logprobs_length"] = n
        if r.return_routes and r.routes:
            rows = torch.cat(r.routes)[opts["routes_from"] : len(r.input_ids) + n - 1]
            meta["routed_experts"] = base64.b64encode(rows.contiguous().numpy().tobytes()).decode("ascii")
        out: dict[str, Any] = {"output_ids": list(r.output_ids), "meta_info": meta}
        if self.tokenizer is not None:
            out["text"] = self.tokenizer.decode(r.output_ids, skip_special_tokens=True)
        return out

"""The embedded engine's HTTP server: the subset of SGLang's native API the project uses, over a real HF model on
CPU (owned by embedded/; started by `python -m megatron_sao engine`, see main(); spoken to by engines/client.py).

Endpoints (paths and bodies as in SGLang 0.5.23, see protocol.py and docs/rollout.md): /generate, /health,
/health_generate, /model_info, /get_model_info, /get_weight_version, /server_info (/get_server_info),
/pause_generation, /continue_generation, /flush_cache, /abort_request, /init_weights_update_group,
/destroy_weights_update_group, /begin_weight_update, /end_weight_update, /update_weights_from_distributed,
/update_weight_version, /get_weights_by_name, /weights_checker, and its own /weight_shards (which block of each
split tensor every TP rank holds, for load_format="sharded_bucket"). Every request gets an answer: a request the
engine cannot serve as sent (ValueError) gets HTTP 400 and any other failure of a handler HTTP 500, both with
SGLang's error body `{"error": {"message": "<ErrorType>: ..."}}`; the weight endpoints answer 400 `{"success": false,
"message"}` as SGLang.

The engine follows the rules of one SGLang release (`--emulate-sglang`, default the newest one read; its
`ServerProtocol`): which routes exist (sessions from 0.5.21), whether updates must run inside a session, whether a
flattened bucket is understood, and what a refused post-update cache flush does: it fails the call (0.5.22+), or, as
older schedulers `assert` and die, it ends this process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from megatron_sao.distributed import flat_bucket
from megatron_sao.engines import auth
from megatron_sao.engines import protocol as P
from megatron_sao.engines.embedded.fields import CONTROL, check_fields
from megatron_sao.engines.embedded.generate import GenerateHandler
from megatron_sao.engines.embedded.kv_cache import SlotKVCache
from megatron_sao.engines.embedded.scheduler import Scheduler
from megatron_sao.engines.embedded.tp import Follower, Peers, TPLayout, refusals
from megatron_sao.engines.embedded.weights import ReceivedUpdate, WeightUpdateError, WeightUpdater

log = logging.getLogger(__name__)

EMULATED_SGLANG = "0.5.23"
"""The SGLang release whose rules the embedded engine follows unless told otherwise (--emulate-sglang)."""


ORDER_SHOWN = 10_000
"""/server_info's weight_update_order: the group of each of the last this many updates, in the order received."""

CONTROL_STRUCTS = {
    P.INIT_WEIGHTS_UPDATE_GROUP: "InitWeightsUpdateGroupReqInput",
    P.DESTROY_WEIGHTS_UPDATE_GROUP: "DestroyWeightsUpdateGroupReqInput",
    P.UPDATE_WEIGHTS_FROM_DISTRIBUTED: "UpdateWeightsFromDistributedReqInput",
    P.UPDATE_WEIGHTS_FROM_TENSOR: "UpdateWeightsFromTensorReqInput",
    P.UPDATE_WEIGHT_VERSION: "UpdateWeightVersionReqInput",
    P.PAUSE_GENERATION: "PauseGenerationReqInput",
    P.CONTINUE_GENERATION: "ContinueGenerationReqInput",
    P.ABORT_REQUEST: "AbortReq",
    P.GET_WEIGHTS_BY_NAME: "GetWeightsByNameReqInput",
    P.FLUSH_CACHE: "FlushCacheReqInput",
    P.BEGIN_WEIGHT_UPDATE: "BeginWeightUpdateReqInput",
    P.END_WEIGHT_UPDATE: "EndWeightUpdateReqInput",
    P.WEIGHTS_CHECKER: "CheckWeightsReqInput",
}
"""The io_struct.py request struct behind each control route (fields.CONTROL classifies its fields)."""


class EngineState:
    """Everything the HTTP handlers need: the scheduler, the weight updater and static model facts."""

    def __init__(
        self, scheduler: Scheduler, updater: WeightUpdater, generate: GenerateHandler, model_info: dict,
        tp_size: int = 1,
    ) -> None:  # fmt: skip
        self.scheduler = scheduler
        self.updater = updater
        self.generate = generate
        self.model_info = model_info
        self.tp_size = tp_size
        self._shards: dict[str, Any] | None = None  # /weight_shards, once read
        self.api_key: str | None = None  # SGLang's --api-key: every endpoint but the probes needs it (engines/auth.py)
        self.weight_activity = time.monotonic()  # the last weight-update request (a pause's lease counts from it)

    # Each route returns (status, JSON-able body or str).
    def route(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        s = self.scheduler
        struct = CONTROL_STRUCTS.get(path)
        if struct is not None:  # a field set to what the engine cannot honour: 400 naming it (fields.py)
            check_fields(body, CONTROL[struct], path)
        if path == P.GENERATE and method in ("POST", "PUT"):
            return self.generate.handle(body)
        if path in (P.HEALTH, P.HEALTH_GENERATE):
            return (200, "") if s.alive() else (503, "scheduler thread is not running\n")
        if path in (P.MODEL_INFO, P.GET_MODEL_INFO):
            return 200, {**self.model_info, "weight_version": s.weight_version}
        if path in (P.GET_WEIGHT_VERSION, "/weight_version"):
            return 200, {"weight_version": s.weight_version}
        if path == P.GET_SERVER_INFO or (path == P.SERVER_INFO and self.protocol.server_info_route):
            return 200, self.server_info()
        if path == P.PAUSE_GENERATION and method == "POST":
            mode = str(body.get("mode", "abort")) if self.protocol.pause_modes != ("abort",) else "abort"
            s.pause(mode)  # before 0.5.6 SGLang's pause takes no mode: it aborts every request
            return 200, {"message": "Generation paused successfully.", "status": "ok"}
        if path == P.CONTINUE_GENERATION and method == "POST":
            s.resume()
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        if path == P.FLUSH_CACHE:
            # No prefix cache is kept between requests; SGLang's rule decides whether the flush is refused.
            if not s.flushable():
                return 400, "Flush cache failed: there are running or waiting requests.\n"
            return 200, "Cache flushed.\n"
        if path == P.ABORT_REQUEST and method == "POST":
            s.abort(None if body.get("abort_all") else str(body.get("rid", "")))
            return 200, ""
        if path == P.GET_WEIGHTS_BY_NAME and method in ("GET", "POST"):
            try:
                name, rows = str(body["name"]), int(body.get("truncate_size", 100))
                return 200, s.at_boundary(lambda: self.updater.get(name, rows))
            except (WeightUpdateError, KeyError, TypeError, ValueError) as e:
                return 400, {"error": {"message": f"Get parameter by name failed: {e}"}}
        if path == P.WEIGHTS_CHECKER and self.protocol.weights_checker and method in ("GET", "POST"):
            return self._check_weights(body)
        if path == P.WEIGHT_SHARDS and method == "GET":
            return 200, self.weight_shards()
        sessions = (P.BEGIN_WEIGHT_UPDATE, P.END_WEIGHT_UPDATE) if self.protocol.session else ()
        weight_paths = (P.INIT_WEIGHTS_UPDATE_GROUP, P.DESTROY_WEIGHTS_UPDATE_GROUP,
                        P.UPDATE_WEIGHTS_FROM_DISTRIBUTED, P.UPDATE_WEIGHTS_FROM_TENSOR, P.UPDATE_WEIGHT_VERSION,
                        *sessions)  # fmt: skip
        if path in weight_paths and method == "POST":
            self.weight_activity = time.monotonic()
            return self._weights(path, body)
        return 404, {"error": {"message": f"{method} {path} is not served by the embedded engine "
                                          f"(following SGLang {self.protocol.version})"}}  # fmt: skip

    def orphaned(self, reason: str) -> None:
        """The push that paused this engine can no longer be finished: resume on the intact previous weights."""
        log.warning("weight push abandoned by its trainer (%s); the staged push is discarded and generation resumes "
                    "on version %s", reason, self.scheduler.weight_version)  # fmt: skip
        self.scheduler.resume()

    def watch_sessions(self, period_s: float = 1.0) -> None:
        while self.scheduler.alive():
            time.sleep(period_s)
            self.updater.expire_idle_session()
            self.end_abandoned_pause()

    def end_abandoned_pause(self) -> bool:
        """A pause that no weight update followed for --weight-session-timeout seconds ends: whoever paused this
        engine is not pushing (a trainer that died between its pause and its first update, or a client that only
        paused), and generation would otherwise wait forever. A pause whose push is under way is the session's
        (expire_idle_session). True when it resumed generation."""
        paused = self.scheduler.paused_for()
        timeout = self.updater.session_timeout_s
        if paused is None or self.updater.session is not None:
            return False
        if min(paused, time.monotonic() - self.weight_activity) < timeout:
            return False
        log.warning("paused for %.0fs with no weight update since (--weight-session-timeout %.0fs): whoever paused "
                    "this engine is not pushing; generation resumes on version %s", paused, timeout,
                    self.scheduler.weight_version)  # fmt: skip
        self.scheduler.resume()
        return True

    @property
    def protocol(self) -> P.ServerProtocol:
        return self.updater.protocol

    def server_info(self) -> dict[str, Any]:
        return {
            **self.model_info,
            "engine": P.EMBEDDED_ENGINE,
            "version": self.protocol.version,
            P.LOADS_IN_PLACE_INFO: self.protocol.in_place,
            "tp_size": self.tp_size,
            "dp_size": 1,
            "enable_return_routed_experts": self.scheduler.runner.routes is not None,  # a server argument, as SGLang's
            "load": self.scheduler.load(),
            "weight_update_groups": {k: dict(v, names=list(v["names"])) for k, v in self.updater.traffic.items()},
            "weight_update_order": list(self.updater.order[-ORDER_SHOWN:]),
            "live_weight_update_groups": sorted(self.updater.groups),  # joined and not destroyed
            P.DELTA_BASE_INFO: self.updater.delta_base,
            P.WEIGHT_COMMITS_INFO: self.scheduler.weight_commits,
            "tp_ranks": self._rank_traffic() if self.tp_size > 1 else [],
        }

    def weight_shards(self) -> dict[str, Any]:
        """/weight_shards (the embedded engine's own): which block of each split tensor every TP rank holds, so a
        trainer can send each rank only its block (load_format="sharded_bucket"). Fixed by the model: read once."""
        if self._shards is None:
            mine = self.updater.shard_boxes()
            ranks = [mine]
            if self.updater.peers is not None:
                peers = self.updater.peers
                replies = self.scheduler.at_boundary(lambda: peers.call("step", "boxes"))
                if (refused := refusals(replies)) is not None:
                    raise RuntimeError(refused)
                ranks += [r.value for r in replies]
            self._shards = {"tp_size": self.tp_size, "shards": {n: [r.get(n) for r in ranks] for n in mine}}
        return self._shards

    def _rank_traffic(self) -> list[dict[str, Any]]:
        """What every TP rank's update groups carried (tensors, bytes), rank 0 first."""
        mine = {"tp_rank": 0, "weight_update_groups": traffic_summary(self.updater)}
        peers = self.updater.peers
        assert peers is not None
        replies = self.scheduler.at_boundary(lambda: peers.call("step", "traffic"))
        return [mine, *({"tp_rank": r.rank, "weight_update_groups": r.value} for r in replies)]

    def _check_weights(self, body: dict[str, Any]) -> tuple[int, Any]:
        """SGLang's /weights_checker answer for action=checksum (one rank; the other actions are not served)."""
        action = str(body.get("action", "checksum"))
        if action != "checksum":
            return 400, {"success": False, "message": f"Unsupported action={action!r} (the embedded engine serves "
                                                      "'checksum')"}  # fmt: skip
        skip = [str(x) for x in body.get("skip_tensor_list") or []]

        def every_rank() -> list[dict[str, str]]:
            mine = self.updater.checksums(skip)
            if self.updater.peers is None:
                return [mine]
            replies = self.updater.peers.call("step", "checksums", skip=skip)
            if (refused := refusals(replies)) is not None:
                raise RuntimeError(refused)
            return [mine, *(r.value for r in replies)]

        ranks = []
        for tp_rank, checksums in enumerate(self.scheduler.at_boundary(every_rank)):
            info = {"role": "target", "tp_rank": tp_rank, "tp_size": self.tp_size, "dp_rank": 0, "dp_size": 1,
                    "pp_rank": 0, "pp_size": 1, "rank": tp_rank, "size": self.tp_size}  # fmt: skip
            per_gpu = flat_bucket.overall_checksum(checksums)
            ranks.append({"checksums": checksums, "per_gpu_checksum": per_gpu, "parallelism_info": [info]})
        engine = hashlib.sha256("".join(r["per_gpu_checksum"] for r in ranks).encode()).hexdigest()
        return 200, {"success": True, "message": "Success.", "ranks": ranks, "per_engine_checksum": engine}

    def _weights(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        try:
            if path == P.BEGIN_WEIGHT_UPDATE:
                msg = self.updater.begin()
            elif path == P.END_WEIGHT_UPDATE:
                update, msg = self.updater.end()
                if update is not None:  # weights and version switch together, between two decode steps
                    self.scheduler.apply_update(update)
                    self.updater.recycle(update.buffers)
            elif path == P.UPDATE_WEIGHT_VERSION:
                if body.get("abort_all_requests", True):
                    self.scheduler.abort(None, "Aborted by /update_weight_version")
                self.scheduler.set_weight_version(str(body["new_version"]))
                return 200, {"success": True, "message": f"Weight version updated to {body['new_version']}",
                             "new_version": str(body["new_version"])}  # fmt: skip
            elif path == P.INIT_WEIGHTS_UPDATE_GROUP:
                msg = self.updater.init_group(
                    str(body["master_address"]),
                    int(body["master_port"]),
                    int(body["rank_offset"]),
                    int(body["world_size"]),
                    str(body.get("group_name", "weight_update_group")),
                    str(body.get("backend", "nccl")),
                    body.get("block_groups"),
                )
            elif path == P.DESTROY_WEIGHTS_UPDATE_GROUP:
                msg = self.updater.destroy_group(str(body.get("group_name", "weight_update_group")))
            elif path == P.UPDATE_WEIGHTS_FROM_TENSOR:
                msg = self._update_from_tensor(body)
            else:
                msg = self._update_from_distributed(body)
        except (WeightUpdateError, KeyError, TypeError, ValueError) as e:
            return 400, {"success": False, "message": f"{type(e).__name__}: {e}"}
        return 200, {"success": True, "message": msg}

    def _update_from_distributed(self, body: dict[str, Any]) -> str:
        if body.get("abort_all_requests"):
            self.scheduler.abort(None, "Aborted by update_weights_from_distributed(abort_all_requests=True)")
        version = body.get("weight_version")
        load_format = body.get("load_format") if self.protocol.flattened_bucket else None  # unknown field before
        update = self.updater.receive(
            list(body["names"]),
            list(body["dtypes"]),
            [list(s) for s in body["shapes"]],
            str(body.get("group_name", "weight_update_group")),
            None if version is None else str(version),
            load_format=load_format,
            delta=body.get(P.DELTA),
        )
        staged = self.protocol.staged  # staged in its session (receive refuses one discarded meanwhile)
        if not staged:
            self.scheduler.apply_update(update)
            self.updater.recycle(update.buffers)
        if body.get("flush_cache", True) and not self.scheduler.flushable():
            self._flush_refused()
        done = "staged for the session's end" if staged else "updated in place"
        suffix = f" Weight version updated to {version}." if version is not None else ""
        return f"Succeeded: {len(update.tensors)} tensors {done}.{suffix}"

    def _update_from_tensor(self, body: dict[str, Any]) -> str:
        """SGLang's /update_weights_from_tensor: each TP rank opens its own entry of serialized_named_tensors
        (distributed/tensor_payload.py) and loads it by load_format: None -- full HF tensors, each rank keeping
        what it holds, any subset --, "direct" -- the rank's own layout: HF names, this rank's /weight_shards block
        of each tensor it holds split --, or "flattened_bucket"; staged in the session like a distributed update."""
        entries = body["serialized_named_tensors"]
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            raise ValueError("serialized_named_tensors must be a list of base64 strings, one per TP rank")
        if body.get("abort_all_requests"):
            self.scheduler.abort(None, "Aborted by update_weights_from_tensor(abort_all_requests=True)")
        version = body.get("weight_version")
        update = self.updater.receive_tensors(entries, body.get("load_format"),
                                              None if version is None else str(version))  # fmt: skip
        if not self.protocol.staged:  # loaded now, from the sender's memory lent for this call
            self.scheduler.apply_update(update)
            self.updater.recycle(update.buffers)
        if body.get("flush_cache", True) and not self.scheduler.flushable():
            self._flush_refused()
        return "Success"

    def _flush_refused(self) -> None:
        """SGLang's answer to a refused post-update flush: 0.5.22+ fails the call; older schedulers die on it."""
        if self.protocol.flush_refusal_fails:
            reason = ("Weights were updated, but the cache was not flushed because requests are still running or "
                      "queued. Retract or finish them, then call /flush_cache.")  # fmt: skip
            self.updater.fail_session(reason)
            raise WeightUpdateError(reason)
        log.critical("AssertionError: Cache flush failed after updating weights (SGLang %s's scheduler asserts here "
                     "and the server dies; so does this engine)", self.protocol.version)  # fmt: skip
        logging.shutdown()
        os._exit(1)


def _error_body(e: BaseException) -> dict[str, Any]:
    """SGLang's error body of the native API (`{"error": {"message": ...}}`), the message naming the error type."""
    return {"error": {"message": f"{type(e).__name__}: {e}"}}


MAX_BODY_BYTES = 64 << 20
"""Largest request body read (a 128k-token input_ids list is ~1 MB of JSON); more gets 413 unread."""

READ_TIMEOUT_S = 60.0
"""A client that stops sending mid-request (or never sends) is dropped after this long."""


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = READ_TIMEOUT_S  # socket timeout of every read and write of the connection
    state: EngineState  # set on the subclass made by make_server

    def _read_chunked(self) -> bytes | None:
        """A `Transfer-Encoding: chunked` body (HTTP/1.1 clients that stream their request); None when it is
        malformed or over MAX_BODY_BYTES (answered here)."""
        parts, total = [], 0
        while True:
            line = self.rfile.readline(1024)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
                if size < 0:
                    raise ValueError(size)
            except ValueError:
                self.close_connection = True
                self._reply(400, {"error": {"message": f"malformed chunked request body (chunk size {line[:40]!r})"}})
                return None
            total += size
            if total > MAX_BODY_BYTES:
                self.close_connection = True
                self._reply(413, {"error": {"message": f"chunked request body exceeds the engine's limit of "
                                                       f"{MAX_BODY_BYTES} bytes"}})  # fmt: skip
                return None
            if size == 0:
                while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return b"".join(parts)
            parts.append(self.rfile.read(size))
            self.rfile.readline(8)  # the CRLF after each chunk

    def _serve(self, method: str) -> None:
        key = getattr(self.state, "api_key", None)  # (a state without one serves everyone)
        if not auth.allowed(urlparse(self.path).path, self.headers.get("Authorization"), key):
            self.close_connection = True  # SGLang's --api-key: refused before the body is read
            self._reply(401, auth.UNAUTHORIZED)
            return
        chunked = "chunked" in (self.headers.get("Transfer-Encoding") or "").lower()
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if length < 0:
                raise ValueError(length)
        except ValueError:
            self.close_connection = True
            self._reply(400, {"error": {"message": f"invalid Content-Length {self.headers.get('Content-Length')!r}"}})
            return
        if length > MAX_BODY_BYTES:
            self.close_connection = True  # the body is never read
            self._reply(413, {"error": {"message": f"request body of {length} bytes exceeds the engine's limit of "
                                                   f"{MAX_BODY_BYTES} bytes"}})  # fmt: skip
            return
        if chunked:
            raw = self._read_chunked()
            if raw is None:
                return
            length = len(raw)
        else:
            raw = self.rfile.read(length) if length else b""
        if len(raw) < length:
            return  # the client went away mid-body: nothing to answer
        try:
            body = json.loads(raw, parse_constant=_no_constants) if raw.strip() else {}
            if not isinstance(body, dict):
                raise ValueError("the request body must be a JSON object")
        except ValueError as e:
            self._reply(400, {"error": {"message": f"invalid JSON body: {e}"}})
            return
        path = urlparse(self.path).path
        try:
            status, out = self.state.route(method, path, body)
        except ValueError as e:  # a request the engine cannot serve as sent (SGLang answers these with a 400 too)
            status, out = 400, _error_body(e)
        except Exception as e:  # always an answer: a dropped connection would make the client guess the outcome
            log.exception("%s %s failed", method, path)
            status, out = 500, _error_body(e)
        self._reply(status, out)

    def _reply(self, status: int, out: Any) -> None:
        data = out.encode() if isinstance(out, str) else json.dumps(out).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain" if isinstance(out, str) else "application/json")
        self.send_header("Content-Length", str(len(data)))
        try:
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError, TimeoutError) as e:  # the client left before its answer
            log.debug("%s %s: the client went away before its %d answer (%r)", self.command, self.path, status, e)

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)


def make_server(
    state: EngineState, host: str, port: int, read_timeout_s: float = READ_TIMEOUT_S
) -> ThreadingHTTPServer:
    handler = type("EngineHandler", (_Handler,), {"state": state, "timeout": read_timeout_s})
    # the standard library's listen backlog is 5: a burst of concurrent clients got connection resets
    server_cls = type("EngineHTTPServer", (ThreadingHTTPServer,), {"request_queue_size": 1024})
    server = server_cls((host, port), handler)
    server.daemon_threads = True
    return server


def build_state(
    model_dir: str,
    *,
    dtype: str = "auto",
    max_running: int = 32,
    context_length: int | None = None,
    skip_tokenizer_init: bool = False,
    weight_version: str = P.DEFAULT_WEIGHT_VERSION,
    sglang_version: str = EMULATED_SGLANG,
    in_place: bool = False,
    session_timeout_s: float = 300.0,
    tp_store: Any = None,
    tp_layout: TPLayout | None = None,
    enable_return_routed_experts: bool = False,
) -> EngineState:
    """Load the model (and tokenizer unless skipped or absent) and start the scheduler thread. At --tp-size > 1 this
    is rank 0 (embedded/tp.py): the ranks joined `tp_store`; the model is sharded over them, and once every rank has
    loaded its shard, rank 0 opens its channels to the others."""
    from megatron_sao.engines.embedded.model_runner import ModelRunner, eos_token_ids, load_engine_model

    tp_size = 1 if tp_layout is None else tp_layout.tp_size
    model, fp8 = load_engine_model(model_dir, dtype, tp_size)
    peers = Peers(tp_store, tp_layout) if tp_layout is not None and tp_size > 1 else None
    ctx = context_length or int(getattr(model.config, "max_position_embeddings", 4096))
    tokenizer = None if skip_tokenizer_init else _maybe_tokenizer(model_dir)
    protocol = P.ServerProtocol(sglang_version, embedded=True, in_place=in_place)
    updater = WeightUpdater(model, protocol, session_timeout_s, fp8=fp8, peers=peers)
    mirror = None
    if peers is not None:

        def mirror(slots: list[int], starts: list[int], ids: Any) -> None:
            peers.send("step", "forward", slots=slots, starts=starts, input_ids=ids)

    scheduler = Scheduler(
        ModelRunner(model, mirror, capture_routes=enable_return_routed_experts),
        updater,
        max_running=max_running,
        context_len=ctx,
        eos_ids=eos_token_ids(model_dir, model),
        weight_version=weight_version,
    )
    info = {
        "model_path": str(model_dir),
        "tokenizer_path": str(model_dir) if tokenizer is not None else None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "model_type": getattr(model.config, "model_type", None),
        "architectures": getattr(model.config, "architectures", None),
        "context_length": ctx,
        "skip_tokenizer_init": tokenizer is None,
    }
    scheduler.start()
    generate = GenerateHandler(scheduler, tokenizer, model.config.vocab_size)
    state = EngineState(scheduler, updater, generate, info, tp_size)
    updater.on_orphaned = state.orphaned
    threading.Thread(target=state.watch_sessions, name="engine-session-watch", daemon=True).start()
    return state


def _maybe_tokenizer(model_dir: str) -> Any:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any((Path(model_dir) / n).is_file() for n in names):
        log.info("%s has no tokenizer files: serving token-in/token-out (like --skip-tokenizer-init)", model_dir)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def serve(state: EngineState, host: str, port: int) -> None:
    server = make_server(state, host, port)
    log.info("embedded engine serving %s on http://%s:%d", state.model_info["model_path"], host, port)
    print(f"engine ready on http://{host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        state.scheduler.stop()


def traffic_summary(updater: WeightUpdater) -> dict[str, dict[str, int]]:
    """What each of a rank's update groups carried: tensors and bytes."""
    return {k: {"tensors": v["tensors"], "bytes": v["bytes"]} for k, v in updater.traffic.items()}


def serve_follower(
    store: Any,
    tp_rank: int,
    tp_size: int,
    model_dir: str,
    *,
    dtype: str,
    max_running: int,
    context_length: int | None,
    sglang_version: str,
    in_place: bool = False,
) -> None:
    """A TP rank other than 0 (embedded/tp.py): its shard of the model, its own KV cache of its heads and its own
    weight updater, driven by rank 0's commands; never returns (ends with rank 0). `tp_size`: the engine's TP ranks
    (its TPLayout; the process group tp.join made)."""
    from megatron_sao.engines.embedded.model_runner import ModelRunner, load_engine_model

    model, _ = load_engine_model(model_dir, dtype, tp_size)
    ctx = context_length or int(getattr(model.config, "max_position_embeddings", 4096))
    runner, cache = ModelRunner(model), SlotKVCache(max_running, ctx)
    protocol = P.ServerProtocol(sglang_version, embedded=True, in_place=in_place)
    updater = WeightUpdater(model, protocol, float("inf"), tp_rank=tp_rank)
    pending: list[ReceivedUpdate] = []  # what the next commit applies: a session's staging, or a live update

    def forward(slots: list[int], starts: list[int], input_ids: Any) -> None:
        runner.forward(cache, slots, starts, input_ids)

    def apply() -> str:
        while pending:
            update = pending.pop(0)
            updater.apply(update)
            updater.recycle(update.buffers)
        return "applied"

    def drop_pending() -> str:
        while pending:
            updater.recycle(pending.pop(0).buffers)
        return "dropped"

    def init_group(rank_offset: int, **kwargs: Any) -> str:  # SGLang: every rank joins as rank_offset + tp_rank
        return updater.init_group(rank_offset=rank_offset + tp_rank, **kwargs)

    def end() -> str:
        update, msg = updater.end()
        if update is not None:
            pending.append(update)
        return msg

    def receive(**kwargs: Any) -> str:
        update = updater.receive(**kwargs)
        if not updater.protocol.staged:
            pending.append(update)
        return f"received {len(update.tensors)} tensors"

    def receive_tensors(**kwargs: Any) -> str:
        update = updater.receive_tensors(**kwargs)
        if not updater.protocol.staged:
            pending.append(update)
        return f"loaded {len(update.tensors)} tensors"

    handlers = {
        "step": {
            "forward": forward,
            "apply": apply,
            "checksums": lambda skip: updater.checksums(skip),
            "held": lambda key, lo, hi: updater.held(key, lo, hi),
            "traffic": lambda: traffic_summary(updater),
            "boxes": updater.shard_boxes,
        },
        "weights": {
            "init_group": init_group,
            "destroy_group": updater.destroy_group,
            "begin": updater.begin,
            "end": end,
            "receive": receive,
            "receive_tensors": receive_tensors,
            "drop_pending": drop_pending,
            "discard": updater.discard,
        },
    }
    log.info("engine TP rank %d serving rank 0's commands", tp_rank)
    Follower(store, tp_rank, handlers).run()

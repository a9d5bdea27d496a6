"""The push agent's HTTP face (owned by engines/agent/): to the learner an engine that takes shard-aware pushes and
keeps serving while they arrive; to the engine behind it a trainer handing each rank its slice.

- Weight protocol, answered here: `/init_weights_update_group`, `/destroy_weights_update_group`,
  `/begin_weight_update`, `/update_weights_from_distributed` (sharded or flattened buckets, received by every agent
  rank as its engine rank: ranks.py) and `/weight_shards` (the handover's blocks: handover.py). The engine is not
  touched while a push arrives: it keeps generating on its weights.
- `/end_weight_update` closes the session on every agent rank, then hands the push over (`handover`): pause the
  engine in place (unless it stages a push itself, as the embedded engine does), open its session, one
  `/update_weights_from_tensor` per part (every rank's entry; the push's weight_version on the last; no flush: an
  in-place pause keeps the paused requests' KV), close its session, continue. What stalls the engine is this alone.
- A handover that fails after a part loaded leaves an SGLang engine "partially updated" (its words): the agent
  keeps it paused, refusing `/continue_generation`, until a complete handover lands. An engine that stages a push
  discards it at the failed session's end and goes on serving its previous weights.
- Everything else (generation, pause, the weights checker, versions, health) is passed to the engine as sent.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any

from megatron_sao.engines import protocol as P
from megatron_sao.engines.agent.handover import Handover, parts
from megatron_sao.engines.agent.ranks import AgentReceiver
from megatron_sao.engines.client import EngineError, SGLangClient
from megatron_sao.engines.embedded.server import make_server, traffic_summary
from megatron_sao.engines.embedded.tp import refusals
from megatron_sao.engines.embedded.weights import WeightUpdateError

log = logging.getLogger(__name__)

WEIGHT_ROUTES = (P.INIT_WEIGHTS_UPDATE_GROUP, P.DESTROY_WEIGHTS_UPDATE_GROUP, P.BEGIN_WEIGHT_UPDATE,
                 P.END_WEIGHT_UPDATE, P.UPDATE_WEIGHTS_FROM_DISTRIBUTED)  # fmt: skip
HANDOVER_TIMEOUT_S = 600.0


class AgentState:
    """Rank 0 of the agent: the learner's requests, the engine behind, the handover."""

    def __init__(self, engine: SGLangClient, engine_info: dict[str, Any], receiver: AgentReceiver,
                 handover: Handover, part_bytes: int, pause_always: bool = False) -> None:  # fmt: skip
        self.engine, self.receiver, self.handover, self.part_bytes = engine, receiver, handover, part_bytes
        self.pause_always = pause_always  # pause even an engine that stages a push (measuring SGLang's stall)
        self.api_key: str | None = None  # asked of the agent's callers as the engine asks it (engines/auth.py)
        self.engine_protocol = P.ServerProtocol.from_server_info(engine_info, engine.url)
        self.device = P.checksum_device(engine_info)
        self.partial: str | None = None  # why the engine holds part of a handover (kept paused), or None
        self.stats: dict[str, Any] = {"handovers": 0, "parts": 0, "handover_s": 0.0, "engine_paused_s": 0.0,
                                      "bytes": [0] * handover.tp_size, "failed": 0}  # fmt: skip
        receiver.on_orphaned = lambda reason: log.warning("push abandoned by its trainer (%s); nothing was handed "
                                                          "over, the engine serves its weights", reason)  # fmt: skip

    # ---- routes -------------------------------------------------------------------------------------------------
    def route(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        if path in (P.SERVER_INFO, P.GET_SERVER_INFO) and method == "GET":
            return 200, self.server_info()
        if path == P.WEIGHT_SHARDS and method == "GET":
            return 200, self.handover.weight_shards()
        if path in WEIGHT_ROUTES and method == "POST":
            try:
                return 200, {"success": True, "message": self._weights(path, body)}
            except (WeightUpdateError, KeyError, TypeError, ValueError) as e:
                return 400, {"success": False, "message": f"{type(e).__name__}: {e}"}
        if path == P.UPDATE_WEIGHTS_FROM_TENSOR:
            return 400, {"success": False, "message": "the push agent hands tensors over itself; send "
                                                      "/update_weights_from_distributed"}  # fmt: skip
        if path == P.CONTINUE_GENERATION and self.partial is not None:
            return 400, {"error": {"message": f"the engine holds part of a push and stays paused until a complete "
                                              f"one lands ({self.partial})"}}  # fmt: skip
        return self._pass(method, path, body)

    def _pass(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        try:
            return 200, self.engine.request(method, path, body if method != "GET" or body else None,
                                            idempotent=False)  # fmt: skip
        except EngineError as e:
            return e.status, e.body
        except OSError as e:
            return 502, {"error": {"message": f"the engine behind the push agent ({self.engine.url}) did not answer: "
                                              f"{e}"}}  # fmt: skip

    def server_info(self) -> dict[str, Any]:
        """The engine's /server_info, as the agent: its engine, version rules and TP size, and the agent's own
        weight-update traffic (per rank in `tp_ranks`) and handover record."""
        info = dict(self.engine.server_info())
        r = self.receiver
        ranks = [{"tp_rank": 0, "weight_update_groups": traffic_summary(r)}]
        if r.peers is not None:
            ranks += [{"tp_rank": x.rank, "weight_update_groups": x.value} for x in r.peers.call("step", "traffic")]
        info.update({
            "engine": P.PUSH_AGENT,
            "engine_url": self.engine.url,
            "engine_kind": info.get("engine", "sglang"),
            "device": self.device,
            "handover": {"mode": self.handover.mode, "load_format": self.handover.load_format,
                         "partial": self.partial, **self.stats},
            "weight_update_groups": {k: dict(v, names=list(v["names"])) for k, v in r.traffic.items()},
            "weight_update_order": list(r.order[-64:]),
            "live_weight_update_groups": sorted(r.groups),
            P.DELTA_BASE_INFO: r.delta_base,
            "tp_ranks": ranks,
        })  # fmt: skip
        return info

    def _weights(self, path: str, body: dict[str, Any]) -> str:
        r = self.receiver
        if path == P.INIT_WEIGHTS_UPDATE_GROUP:
            return r.init_group(str(body["master_address"]), int(body["master_port"]), int(body["rank_offset"]),
                                int(body["world_size"]), str(body.get("group_name", "weight_update_group")),
                                str(body.get("backend", "nccl")), body.get("block_groups"))  # fmt: skip
        if path == P.DESTROY_WEIGHTS_UPDATE_GROUP:
            return r.destroy_group(str(body.get("group_name", "weight_update_group")))
        if path == P.BEGIN_WEIGHT_UPDATE:
            return r.begin()
        if path == P.UPDATE_WEIGHTS_FROM_DISTRIBUTED:
            version = body.get("weight_version")
            update = r.receive(list(body["names"]), list(body["dtypes"]), [list(s) for s in body["shapes"]],
                               str(body.get("group_name", "weight_update_group")),
                               None if version is None else str(version),
                               load_format=body.get("load_format"), delta=body.get(P.DELTA))  # fmt: skip
            return f"Succeeded: {len(update.tensors)} tensors received beside the engine for the session's end."
        r.release()
        update, msg = r.end()  # every rank closes its session (ranks.AgentReceiver.close on the others)
        r.pending = update
        if update is None:
            return msg
        with r.serial:  # no other weight request until the push is handed over
            try:
                return self._hand_over(update.weight_version)
            finally:
                r.release()
                if r.peers is not None:
                    r.peers.call("weights", "drop_pending")

    # ---- the handover -------------------------------------------------------------------------------------------
    def _hand_over(self, version: str | None) -> str:
        """Every rank's pending push into the engine, part by part, inside its session; see the module docstring."""
        r, engine, t0 = self.receiver, self.engine, time.monotonic()
        sizes = [r.sizes()]
        if r.peers is not None:
            replies = r.peers.call("weights", "sizes")
            if (refused := refusals(replies)) is not None:
                raise WeightUpdateError(refused)
            sizes += [[tuple(x) for x in reply.value] for reply in replies]
        plan = parts(sizes, self.part_bytes)
        pause = self.pause_always or not self.engine_protocol.staged
        loaded = False
        phases = self.stats.setdefault("phases_s", {})

        def lap(phase: str, since: float) -> float:
            now = time.monotonic()
            phases[phase] = phases.get(phase, 0.0) + now - since
            return now

        try:
            t = lap("plan", t0)
            if pause:
                engine.pause_generation("in_place")
            paused_at = t = lap("pause", t)
            _begin(engine)
            t = lap("begin", t)
            for i, names in enumerate(plan):
                entries = [r.lend(names)]
                if r.peers is not None:
                    replies = r.peers.call("weights", "lend", names=names)
                    if (refused := refusals(replies)) is not None:
                        raise WeightUpdateError(refused)
                    entries += [x.value for x in replies]
                t = lap("lend", t)
                last = i == len(plan) - 1
                loaded = True
                engine.update_weights_from_tensor(entries, load_format=self.handover.load_format,
                                                  weight_version=version if last else None, flush_cache=False,
                                                  timeout_s=HANDOVER_TIMEOUT_S)  # fmt: skip
                t = lap("load", t)
                r.returned()
                if r.peers is not None:
                    r.peers.call("weights", "returned")
                t = lap("lend", t)
            engine.end_weight_update()
            t = lap("end", t)
        except (EngineError, OSError, WeightUpdateError) as e:
            self.stats["failed"] += 1
            _quietly(engine.end_weight_update)
            if loaded and not self.engine_protocol.staged:
                self.partial = f"handover failed: {e}"
                log.error("push agent: the handover to %s failed after loading part of it; the engine stays paused "
                          "until a complete push lands (%s)", engine.url, e)  # fmt: skip
            elif pause:
                _quietly(engine.continue_generation)
            raise WeightUpdateError(f"handover to the engine failed, version {version} not live: {e}") from e
        self.partial = None
        if pause:
            engine.continue_generation()
        done = lap("continue", t)
        self.stats["handovers"] += 1
        self.stats["parts"] += len(plan)
        self.stats["handover_s"] += done - t0
        self.stats["engine_paused_s"] += (done - paused_at) if pause else 0.0
        for k, rank in enumerate(sizes):
            self.stats["bytes"][k] += sum(b for _, b in rank)
        return f"Success: handed over in {len(plan)} part(s) ({done - t0:.3f}s)"


def _begin(engine: SGLangClient) -> None:
    """The engine's session; one a dead agent left open is closed first (SGLang refuses a second begin)."""
    try:
        engine.begin_weight_update()
    except EngineError as e:
        if "already open" not in str(e) and "already" not in json.dumps(e.body):
            raise
        _quietly(engine.end_weight_update)
        engine.begin_weight_update()


def _quietly(fn: Any) -> Any:
    try:
        return fn()
    except (EngineError, OSError) as e:
        return e


def serve(state: AgentState, host: str, port: int) -> None:
    server: ThreadingHTTPServer = make_server(state, host, port)  # type: ignore[arg-type]
    threading.Thread(target=_watch_sessions, args=(state,), name="agent-session-watch", daemon=True).start()
    log.info("push agent for %s serving on http://%s:%d", state.engine.url, host, server.server_address[1])
    print(f"agent ready on http://{host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()


def _watch_sessions(state: AgentState, period_s: float = 1.0) -> None:
    while True:
        time.sleep(period_s)
        state.receiver.expire_idle_session()

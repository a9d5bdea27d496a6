"""HTTP client of one SGLang engine (real server or the embedded engine) and a router over many (owned by engines/;
used by agent_loop.py and worker.py for generation, by the weight-sync side for pause / update / continue).

Transport is the standard library (http.client), one connection per call, JSON bodies; nothing is pickled.
Retries (exponential back-off) only where resending cannot act twice: a call whose connection could not be opened
(refused: an engine restarting) never reached the engine; an idempotent call (GET, abort, continue, flush) may be
resent after its connection dropped. A non-idempotent POST (/generate, weight updates, pause) whose connection
dropped after it was sent raises EngineConnectionLost (the engine may or may not have acted on it). An answer with
an error status is never resent: EngineBadRequest (4xx), EngineInternalError (5xx). A /generate that times out is
aborted on the engine (`/abort_request` with its rid) and raised as EngineTimeout so the router can re-issue it
elsewhere.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from megatron_sao.engines import protocol as P
from megatron_sao.engines.auth import run_key

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """An engine answered with an error status (the message carries its body). Never resent by the client."""

    note = ""

    def __init__(self, url: str, status: int, body: Any) -> None:
        super().__init__(f"{url}: HTTP {status}{self.note}: {body}")
        self.url, self.status, self.body = url, status, body

    def __reduce__(self) -> tuple[Any, ...]:  # keeps it intact across process boundaries (multiprocessing queues)
        return (type(self), (self.url, self.status, self.body))

    @staticmethod
    def of(url: str, status: int, body: Any) -> EngineError:
        """The error for an answer with a non-2xx `status`: EngineBadRequest, EngineInternalError or EngineError."""
        cls = EngineBadRequest if 400 <= status < 500 else EngineInternalError if status >= 500 else EngineError
        return cls(url, status, body)


class EngineBadRequest(EngineError):
    """HTTP 4xx: the engine refused the request as sent; sending it again cannot succeed (not retryable)."""

    note = " (request refused as sent; not retried)"


class EngineInternalError(EngineError):
    """HTTP 5xx: the engine failed while handling the request (it answered, so the client does not resend it)."""

    note = " (engine failed handling the request; not resent)"


class EngineMalformedResponse(EngineInternalError):
    """A 2xx answer that is not what the protocol says (unparseable JSON, a /generate answer missing its fields):
    the engine is broken; the router takes it out of rotation and re-issues the turn on another engine."""

    note = " (malformed answer from the engine)"


class EngineUnavailable(ConnectionError):
    """The engine could not be reached (refused, reset, died mid-request), after the retries."""


class EngineConnectionLost(EngineUnavailable):
    """The connection dropped after a non-idempotent request was sent and before its answer: the engine may or may
    not have acted on it (generated, applied an update), so it was not resent."""


class _NotSent(ConnectionError):
    """The connection could not be opened: the request surely did not reach the engine."""


_LOST = (ConnectionError, http.client.HTTPException)  # reset, broken pipe, closed without (a complete) answer
_IDEMPOTENT_POSTS = frozenset({P.ABORT_REQUEST, P.CONTINUE_GENERATION, P.FLUSH_CACHE, P.GET_WEIGHTS_BY_NAME})


class EngineTimeout(TimeoutError):
    """A request did not finish in time; the engine was asked to abort it."""


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 3
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0

    def delays(self) -> list[float]:
        return [min(self.backoff_s * 2**i, self.max_backoff_s) for i in range(self.max_retries)]


class SGLangClient:
    """Client of the SGLang native API at `url` (http://host:port)."""

    def __init__(self, url: str, *, timeout_s: float = 600.0, retry: RetryPolicy | None = None,
                 api_key: str | None = None) -> None:  # fmt: skip
        """`api_key`: sent as `Authorization: Bearer` (SGLang's --api-key); default the run's (engines/auth.py)."""
        u = urlparse(url if "://" in url else f"http://{url}")
        if u.scheme != "http" or not u.hostname or not u.port:
            raise ValueError(f"engine url {url!r}: expected http://HOST:PORT")
        self.url = f"http://{u.hostname}:{u.port}"
        self._host, self._port = u.hostname, u.port
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self.api_key = api_key if api_key is not None else run_key()

    # ---- transport ----------------------------------------------------------------------------------------------
    def _once(self, method: str, path: str, body: Any, timeout_s: float) -> tuple[int, Any]:
        conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout_s)
        try:
            try:
                conn.connect()
            except ConnectionError as e:
                raise _NotSent(str(e)) from e
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if data is not None else {}
            if self.api_key:
                headers["Authorization"] = f"Bearer {self.api_key}"
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        ctype = resp.getheader("Content-Type", "")
        if not raw or "json" not in ctype:
            return resp.status, raw.decode(errors="replace")
        try:
            return resp.status, json.loads(raw)
        except ValueError as e:
            text = raw[:200].decode(errors="replace")
            raise EngineMalformedResponse(self.url, resp.status, f"{path}: unparseable JSON ({e}): {text!r}") from e

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout_s: float | None = None,
        idempotent: bool | None = None,
    ) -> Any:
        """One call. Resent with back-off when the connection could not be opened, and, for an idempotent call
        (default: GET and the POSTs in _IDEMPOTENT_POSTS), when it dropped before the answer; a non-idempotent call
        whose connection dropped raises EngineConnectionLost. EngineUnavailable when the retries ran out; a non-2xx
        answer raises EngineBadRequest (4xx) / EngineInternalError (5xx) at once."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if idempotent is None:
            idempotent = method == "GET" or path in _IDEMPOTENT_POSTS
        for attempt, delay in enumerate([*self.retry.delays(), None]):
            try:
                status, out = self._once(method, path, body, timeout)
                break
            except _NotSent as e:
                cause: BaseException = e.__cause__ or e
            except _LOST as e:
                if not idempotent:
                    raise EngineConnectionLost(
                        f"{self.url}{path}: connection lost after the request was sent ({e!r}); the engine may or "
                        "may not have acted on it, so it was not resent"
                    ) from e
                cause = e
            if delay is None:
                raise EngineUnavailable(f"{self.url}{path}: {cause!r} after {attempt} retries") from cause
            time.sleep(delay)
        if not 200 <= status < 300:
            raise EngineError.of(self.url, status, out)
        return out

    # ---- generation ---------------------------------------------------------------------------------------------
    def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        *,
        rid: str | None = None,
        timeout_s: float | None = None,
        routed_experts_start_len: int | None = None,
    ) -> P.GenerateResult:
        """Token-in/token-out generation of one sequence with per-token log-probs and weight versions;
        `routed_experts_start_len` set: with the experts of positions [it, seqlen - 1) too (check_routes first)."""
        rid = rid or uuid.uuid4().hex
        body = P.build_generate_request(input_ids, sampling_params, rid=rid,
                                        routed_experts_start_len=routed_experts_start_len)  # fmt: skip
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            out = self.request("POST", P.GENERATE, body, timeout_s=timeout)
        except TimeoutError as e:
            self._abort_quietly(rid)
            raise EngineTimeout(f"{self.url}: request {rid} exceeded {timeout:.1f}s; aborted it") from e
        try:
            return P.parse_generate_response(out, expect_routes=routed_experts_start_len is not None)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise EngineMalformedResponse(self.url, 200, f"{P.GENERATE}: {e!r} in {str(out)[:200]!r}") from e

    def _abort_quietly(self, rid: str) -> None:
        try:  # best effort, kept short: the engine that just timed out may be hung, and the turn waits to fail over
            self.abort(rid, timeout_s=2.0)
        except (OSError, EngineError) as e:  # the engine may be gone; the timeout is what gets reported
            log.warning("abort of %s on %s failed: %r", rid, self.url, e)

    def abort(self, rid: str | None = None, *, abort_all: bool = False, timeout_s: float = 10.0) -> None:
        body = {"rid": rid or "", "abort_all": abort_all}
        self.request("POST", P.ABORT_REQUEST, body, timeout_s=timeout_s)

    # ---- status -------------------------------------------------------------------------------------------------
    def health(self, timeout_s: float = 5.0) -> bool:
        """True when /health answers 200 (one try, no retries)."""
        try:
            status, _ = self._once("GET", P.HEALTH, None, timeout_s)
        except (OSError, http.client.HTTPException):
            return False
        return status == 200

    def model_info(self) -> dict[str, Any]:
        """/model_info (newer servers), falling back to /get_model_info (older ones)."""
        try:
            return self.request("GET", P.MODEL_INFO, timeout_s=10.0)
        except EngineError as e:
            if e.status != 404:
                raise
        return self.request("GET", P.GET_MODEL_INFO, timeout_s=10.0)

    def server_info(self) -> dict[str, Any]:
        """/server_info (0.5.6+), falling back to the older /get_server_info."""
        try:
            return self.request("GET", P.SERVER_INFO, timeout_s=30.0)
        except EngineError as e:
            if e.status != 404:
                raise
        return self.request("GET", P.GET_SERVER_INFO, timeout_s=30.0)

    def protocol(self) -> P.ServerProtocol:
        """The weight-update protocol this engine speaks (from its /server_info version); ValueError when it does
        not say."""
        return P.ServerProtocol.from_server_info(self.server_info(), self.url)

    def check_routes(self, multi_turn: bool) -> None:
        """Refuse, naming what to change, an engine that cannot return routed experts (rollout.return_routed_experts):
        a release before 0.5.7, a server started without --enable-return-routed-experts, or, for multi-turn episodes,
        a release without routed_experts_start_len (0.5.8)."""
        info = self.server_info()
        proto = P.ServerProtocol.from_server_info(info, self.url)
        off = "or set learner.routing_replay and rollout.return_routed_experts false"
        if not proto.routed_experts:
            raise ValueError(f"engine {self.url} runs SGLang {proto.version}, which cannot return routed experts "
                             f"(0.5.7+): upgrade it, {off}")  # fmt: skip
        if multi_turn and not proto.routed_experts_start:
            raise ValueError(f"engine {self.url} runs SGLang {proto.version}: multi-turn routes need "
                             f"routed_experts_start_len (0.5.8+): upgrade, use rollout.max_turns=1, {off}")  # fmt: skip
        if not info.get("enable_return_routed_experts"):
            raise ValueError(f"engine {self.url} was started without --enable-return-routed-experts: restart it "
                             f"with the flag (`run` adds it to the engines it starts), {off}")  # fmt: skip

    def weight_version(self) -> int:
        """Current weight version: /model_info's weight_version, else the older /get_weight_version."""
        info = self.model_info()
        if "weight_version" in info:
            return P.version_to_int(info["weight_version"])
        return P.version_to_int(self.request("GET", P.GET_WEIGHT_VERSION, timeout_s=10.0)["weight_version"])

    # ---- control around weight updates --------------------------------------------------------------------------
    def pause_generation(self, mode: str = "in_place") -> None:
        """mode: in_place (keep requests and their KV), retract (requeue, recompute), abort (finish them as aborted)."""
        self.request("POST", P.PAUSE_GENERATION, {"mode": mode}, timeout_s=60.0)

    def continue_generation(self) -> None:
        self.request("POST", P.CONTINUE_GENERATION, {}, timeout_s=60.0)

    def flush_cache(self) -> bool:
        try:
            self.request("POST", P.FLUSH_CACHE, timeout_s=60.0)
        except EngineError as e:
            if e.status == 400:
                return False
            raise
        return True

    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str,
        block_groups: list[list[int]] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """`block_groups` (the embedded engine's sharded_bucket pushes only; SGLang has no such field): the group's
        engine ranks partitioned by the blocks they hold, each part joining a sub-group with the trainer."""
        body: dict[str, Any] = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        if block_groups is not None:
            body["block_groups"] = block_groups
        return self.request("POST", P.INIT_WEIGHTS_UPDATE_GROUP, body)

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str,
        weight_version: int | str | None = None,
        flush_cache: bool = True,
        load_format: str | None = None,
        delta: P.DeltaHeader | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """One update: the engine receives `names` from the group's rank 0 (one broadcast per tensor, or one for the
        whole bucket with load_format="flattened_bucket", SGLang >= 0.5.6) and loads them. `delta`: the bucket
        travels as a delta and/or is kept as the next one's base (engines whose protocol takes deltas only)."""
        body: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "weight_version": None if weight_version is None else str(weight_version),
        }
        if load_format is not None:  # the field exists from 0.5.6 on; older servers never get it
            body["load_format"] = load_format
        if delta is not None:
            body[P.DELTA] = delta.to_json()
        return self.request("POST", P.UPDATE_WEIGHTS_FROM_DISTRIBUTED, body, timeout_s=timeout_s)

    def update_weights_from_tensor(
        self,
        entries: list[str],
        *,
        load_format: str | None = None,
        weight_version: int | str | None = None,
        flush_cache: bool = True,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """One update by payload: `entries[i]` is TP rank i's (name, tensor) list packed by
        distributed/tensor_payload.pack; load_format None (full HF tensors), "direct" (each rank's own layout) or
        "flattened_bucket". Inside a session (SGLang >= 0.5.21). SGLang's scheduler dies on a payload it cannot
        load: check names and shapes before sending."""
        body: dict[str, Any] = {
            "serialized_named_tensors": list(entries),
            "load_format": load_format,
            "flush_cache": flush_cache,
            "weight_version": None if weight_version is None else str(weight_version),
        }
        return self.request("POST", P.UPDATE_WEIGHTS_FROM_TENSOR, body, timeout_s=timeout_s)

    def begin_weight_update(self) -> dict[str, Any]:
        """Open the weight-update session updates must run in (SGLang >= 0.5.21)."""
        return self.request("POST", P.BEGIN_WEIGHT_UPDATE, {}, timeout_s=120.0)

    def end_weight_update(self) -> dict[str, Any]:
        """Close the session (SGLang finalizes the loaded weights; the embedded engine commits its staged push)."""
        return self.request("POST", P.END_WEIGHT_UPDATE, {}, timeout_s=600.0)

    def update_weight_version(self, version: int | str, abort_all_requests: bool = False) -> dict[str, Any]:
        body = {"new_version": str(version), "abort_all_requests": abort_all_requests}
        return self.request("POST", P.UPDATE_WEIGHT_VERSION, body, timeout_s=60.0)

    def weights_checksum(self, skip_tensor_list: list[str] | None = None) -> dict[str, Any]:
        """/weights_checker {action: checksum} (SGLang >= 0.5.6): {"success", "ranks": [{"checksums",
        "per_gpu_checksum", "parallelism_info"}], "per_engine_checksum"}."""
        body: dict[str, Any] = {"action": "checksum"}
        if skip_tensor_list:
            body["skip_tensor_list"] = list(skip_tensor_list)
        return self.request("POST", P.WEIGHTS_CHECKER, body, timeout_s=600.0, idempotent=True)

    def weight_shards(self) -> dict[str, Any]:
        """The embedded engine's /weight_shards: {"tp_size", "shards": {HF name: [[offset, shape] or null per TP
        rank]}} for every tensor its ranks hold split (the others are whole on every rank)."""
        return self.request("GET", P.WEIGHT_SHARDS, timeout_s=120.0)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        """The first `truncate_size` rows of an engine weight (HF name) as float lists."""
        return self.request("POST", P.GET_WEIGHTS_BY_NAME, {"name": name, "truncate_size": truncate_size})

    def destroy_weights_update_group(self, group_name: str) -> dict[str, Any]:
        return self.request("POST", P.DESTROY_WEIGHTS_UPDATE_GROUP, {"group_name": group_name})


class NoHealthyEngine(RuntimeError):
    """Every engine is marked down (or was tried) for this request."""


class EngineRouter:
    """Spreads /generate calls over engines by outstanding load; fails a request over to another engine when its
    engine is unreachable or times out. Down engines are probed again by `check_health()`.

    Engines behind on weights get no new work: every answer carries the engine's weight_version, and an engine whose
    version is below the newest one seen on a healthy engine (a restarted engine back on its launch weights, a late
    one, one the learner keeps paused after a partial push) is left out until a probe (every VERSION_PROBE_S) finds
    it caught up -- the learner pushes to an engine as soon as it joins. When every engine lags, all are used."""

    VERSION_PROBE_S = 2.0
    GATEWAY_RETRY_S = 10.0
    """After the gateway failed a request, requests go to the engines directly for this long, then it is tried."""

    def __init__(self, clients: list[SGLangClient], gateway: SGLangClient | None = None) -> None:
        """`gateway` (rollout.router_url): generations go to it, and it picks the engine (it does not know weight
        versions, so lagging engines are not left out); when it is unreachable, this router picks for the request."""
        if not clients:
            raise ValueError("EngineRouter needs at least one engine (rollout.engine_urls or launched engines)")
        self.clients = clients
        self.gateway = gateway
        self._gateway = {"requests": 0, "failures": 0, "tokens": 0, "outstanding": 0, "healthy": True}
        self._gateway_retry_at = 0.0  # after a failure the engines are picked directly until then
        self._lock = threading.Lock()
        self._outstanding = {c.url: 0 for c in clients}
        self._healthy = {c.url: True for c in clients}
        self._counts = {c.url: {"requests": 0, "failures": 0, "tokens": 0} for c in clients}
        self._versions: dict[str, int] = {}  # last weight_version each engine reported
        self._probed = {c.url: 0.0 for c in clients}

    @classmethod
    def from_urls(cls, urls: list[str], **client_kwargs: Any) -> EngineRouter:
        return cls([SGLangClient(u) for u in urls])

    def _newest(self) -> int | None:
        known = [v for u, v in self._versions.items() if self._healthy[u]]
        return max(known) if known else None

    def current_version(self) -> int | None:
        """The weight version every healthy engine holds now (the lowest, asked of each); None when none answers.
        The group arms' batches open on it (rollout/worker.py BatchGate)."""
        versions = []
        for c in self.clients:
            if not self._healthy[c.url]:
                continue
            try:
                v = c.weight_version()
            except (OSError, EngineError, ValueError):
                continue
            versions.append(v)
            with self._lock:
                self._versions[c.url] = v
        return min(versions) if versions else None

    def version_floor(self) -> int | None:
        """A weight version no healthy engine is below: the lowest each last reported, else asked now (None: no
        engine answers). Versions only grow, so an episode started later generates at this version or newer
        (rollout admission, rollout/worker.py)."""
        with self._lock:
            known = [v for u, v in self._versions.items() if self._healthy[u]]
            every = len(known) == sum(self._healthy.values())
        return min(known) if known and every else self.current_version()

    def lagging(self) -> list[str]:
        """Healthy engines behind the newest weights seen (no new work goes to them)."""
        with self._lock:
            newest = self._newest()
            if newest is None:
                return []
            return sorted(u for u, v in self._versions.items() if self._healthy[u] and v < newest)

    def _pick(self, exclude: set[str]) -> SGLangClient:
        with self._lock:
            live = [c for c in self.clients if self._healthy[c.url] and c.url not in exclude]
            if not live:
                raise NoHealthyEngine(f"no healthy engine left (down: {self.down()}, tried: {sorted(exclude)})")
            newest = self._newest()
            current = [c for c in live if newest is None or self._versions.get(c.url, newest) >= newest]
            best = min(current or live, key=lambda c: self._outstanding[c.url])
            self._outstanding[best.url] += 1
            self._counts[best.url]["requests"] += 1
            return best

    def _done(self, client: SGLangClient, ok: bool, tokens: int = 0, version: int | None = None) -> None:
        with self._lock:
            self._outstanding[client.url] -= 1
            self._counts[client.url]["tokens"] += tokens
            if version is not None:
                self._versions[client.url] = version
            if not ok:
                self._counts[client.url]["failures"] += 1
                self._healthy[client.url] = False

    def _probe_lagging(self) -> None:
        """Ask the lagging engines for their version again (at most every VERSION_PROBE_S each)."""
        now = time.monotonic()
        due = [c for c in self.clients if c.url in self.lagging() and now - self._probed[c.url] >= self.VERSION_PROBE_S]
        for c in due:
            self._probed[c.url] = now
            try:
                version = c.weight_version()
            except (OSError, EngineError, ValueError):
                continue
            with self._lock:
                self._versions[c.url] = version

    def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        *,
        timeout_s: float | None = None,
        routed_experts_start_len: int | None = None,
    ) -> tuple[P.GenerateResult, str]:
        """Generate on the least-loaded healthy engine that is not behind on weights, failing over; returns (result,
        engine url). With a gateway: on the gateway (result, gateway url), falling back to the above when it is
        unreachable."""
        if self.gateway is not None and time.monotonic() >= self._gateway_retry_at:
            with self._lock:
                self._gateway["requests"] += 1
                self._gateway["outstanding"] += 1
            try:
                result = self.gateway.generate(input_ids, sampling_params, timeout_s=timeout_s,
                                               routed_experts_start_len=routed_experts_start_len)  # fmt: skip
            except (EngineUnavailable, EngineTimeout) as e:
                log.warning("gateway %s failed (%s); picking an engine directly for this request", self.gateway.url, e)
                with self._lock:
                    self._gateway.update(failures=self._gateway["failures"] + 1, healthy=False)
                    self._gateway_retry_at = time.monotonic() + self.GATEWAY_RETRY_S
            else:
                with self._lock:
                    self._gateway.update(tokens=self._gateway["tokens"] + len(result.output_ids), healthy=True)
                return result, self.gateway.url
            finally:
                with self._lock:
                    self._gateway["outstanding"] -= 1
        self._probe_lagging()
        tried: set[str] = set()
        while True:
            client = self._pick(tried)
            tried.add(client.url)
            try:
                result = client.generate(input_ids, sampling_params, timeout_s=timeout_s,
                                         routed_experts_start_len=routed_experts_start_len)  # fmt: skip
            except (EngineUnavailable, EngineTimeout, EngineMalformedResponse) as e:
                log.warning("engine %s failed (%s); re-issuing on another engine", client.url, e)
                self._done(client, ok=False)
                continue
            except BaseException:
                self._done(client, ok=True)
                raise
            self._done(client, ok=True, tokens=len(result.output_ids), version=result.weight_version)
            return result, client.url

    def check_health(self) -> dict[str, bool]:
        """Probe every engine; a down engine that answers again is taken back once its weight version is known (it
        may have restarted on its launch weights: then it waits for the learner's next push)."""
        status = {c.url: c.health() for c in self.clients}
        back = {c.url: c for c in self.clients if status[c.url] and not self._healthy[c.url]}
        versions: dict[str, int] = {}
        for url, c in back.items():
            try:
                versions[url] = c.weight_version()
            except (OSError, EngineError, ValueError):
                status[url] = False  # answers /health but not /model_info yet: not back
        with self._lock:
            self._healthy.update(status)
            self._versions.update(versions)
        return status

    def down(self) -> list[str]:
        return sorted(u for u, ok in self._healthy.items() if not ok)

    def stats(self) -> dict[str, Any]:
        lagging = set(self.lagging())
        with self._lock:
            out = {
                u: {**self._counts[u], "outstanding": self._outstanding[u], "healthy": self._healthy[u],
                    "weight_version": self._versions.get(u), "lagging": u in lagging}
                for u in self._outstanding
            }  # fmt: skip
            if self.gateway is not None:
                out[self.gateway.url] = {**self._gateway, "weight_version": None, "lagging": False, "gateway": True}
            return out

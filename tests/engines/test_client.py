"""SGLangClient and EngineRouter against the embedded engine (over HTTP), plus fakes for older servers / outages."""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from megatron_sao.distributed.spawn import find_free_port
from megatron_sao.engines import protocol as P
from megatron_sao.engines.client import (
    EngineError,
    EngineRouter,
    EngineTimeout,
    EngineUnavailable,
    RetryPolicy,
    SGLangClient,
)

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _wait_running(client: SGLangClient, n: int = 1, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.request("GET", P.SERVER_INFO)["load"]["num_running"] < n:
        assert time.monotonic() < deadline, "request never started running"
        time.sleep(0.01)


def test_generate_is_token_in_token_out_with_aligned_logprobs(engine_url: str) -> None:
    r = SGLangClient(engine_url).generate([1, 7, 8], {"max_new_tokens": 6, **GREEDY})
    assert len(r.output_ids) == len(r.logprobs) == len(r.versions) == 6
    assert r.versions == [0] * 6 and r.finish_type == "length" and r.prompt_tokens == 3
    assert all(lp <= 0 for lp in r.logprobs)


def test_32_concurrent_requests_match_the_same_requests_run_one_by_one(engine_url: str) -> None:
    client = SGLangClient(engine_url)
    prompts = [[1, 3 + i % 50, 4 + (i * 7) % 60, 5] for i in range(32)]
    lengths = [4 + i % 9 for i in range(32)]
    with cf.ThreadPoolExecutor(32) as pool:
        futs = [pool.submit(client.generate, p, {"max_new_tokens": n, **GREEDY}) for p, n in zip(prompts, lengths)]
        concurrent = [f.result(timeout=300) for f in futs]
    sequential = [client.generate(p, {"max_new_tokens": n, **GREEDY}) for p, n in zip(prompts, lengths)]
    for c, s, n in zip(concurrent, sequential, lengths):
        assert c.output_ids == s.output_ids and len(c.output_ids) == n
        assert max(abs(a - b) for a, b in zip(c.logprobs, s.logprobs)) <= 1e-4


def test_abort_request_finishes_it_as_abort(engine_url: str) -> None:
    client = SGLangClient(engine_url)
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(client.generate, [1, 2, 3], {"max_new_tokens": 3000, **GREEDY}, rid="long-1")
        _wait_running(client)
        client.abort("long-1")
        r = fut.result(timeout=60)
    assert r.aborted and r.finish_reason["type"] == "abort" and len(r.output_ids) < 3000


def test_timeout_aborts_the_request_on_the_engine(engine_url: str) -> None:
    client = SGLangClient(engine_url)
    with pytest.raises(EngineTimeout):
        client.generate([1, 2], {"max_new_tokens": 3000, **GREEDY}, timeout_s=0.5)
    deadline = time.monotonic() + 10
    while client.request("GET", P.SERVER_INFO)["load"]["num_running"]:
        assert time.monotonic() < deadline, "timed-out request still running on the engine"
        time.sleep(0.05)


def test_pause_in_place_freezes_and_continue_resumes(engine_url: str) -> None:
    client = SGLangClient(engine_url)
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(client.generate, [1, 2, 3], {"max_new_tokens": 400, **GREEDY})
        _wait_running(client)
        client.pause_generation("in_place")
        try:
            before = client.request("GET", P.SERVER_INFO)["load"]["generated_tokens"]
            time.sleep(0.3)
            assert client.request("GET", P.SERVER_INFO)["load"]["generated_tokens"] == before
            assert not client.flush_cache()  # refused while a request is in flight, as in SGLang
        finally:
            client.continue_generation()
        r = fut.result(timeout=120)
    assert len(r.output_ids) == 400 and not r.aborted
    assert client.flush_cache()


def test_pause_retract_recomputes_and_gives_the_uninterrupted_result(engine_url: str) -> None:
    client = SGLangClient(engine_url)
    plain = client.generate([1, 4, 9], {"max_new_tokens": 300, **GREEDY})
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(client.generate, [1, 4, 9], {"max_new_tokens": 300, **GREEDY})
        _wait_running(client)
        client.pause_generation("retract")
        client.continue_generation()
        r = fut.result(timeout=120)
    assert r.output_ids == plain.output_ids


def test_generate_rejects_what_the_engine_cannot_honour(engine_url: str) -> None:
    client = SGLangClient(engine_url)
    cases = [
        ({"input_ids": [1, 2], "sampling_params": {"stop": ["x"]}}, "stop"),
        ({"input_ids": [1, 2], "sampling_params": {"n": 2}}, "n=2"),
        ({"input_ids": [1, 2], "stream": True}, "stream"),
        ({"input_ids": [1, 10**6]}, "input_ids"),
        ({"input_ids": list(range(1, 200)) * 30}, "context length"),
    ]
    for body, words in cases:
        with pytest.raises(EngineError, match=words) as e:
            client.request("POST", P.GENERATE, body)
        assert e.value.status == 400


def test_token_only_engine_serves_ids_and_refuses_text(tiny_dirs: dict[str, Path]) -> None:
    from megatron_sao.engines.embedded.server import build_state

    state = build_state(str(tiny_dirs["qwen3_moe_notok"]), max_running=2)
    try:
        status, out = state.generate.handle({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        assert status == 200 and "text" not in out and len(out["output_ids"]) == 2
        status, out = state.generate.handle({"text": "hello"})
        assert status == 400 and "input_ids" in out["error"]["message"]
        assert state.model_info["skip_tokenizer_init"] is True
    finally:
        state.scheduler.stop()


class _OldServer(BaseHTTPRequestHandler):
    """An older SGLang: no /model_info, /get_model_info without weight_version, /get_weight_version."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        body: Any = {
            "/get_model_info": {"model_path": "m", "is_generation": True},
            "/get_weight_version": {"weight_version": "3"},
            "/health": "",
        }.get(self.path)
        data = b"" if body in (None, "") else json.dumps(body).encode()
        self.send_response(404 if body is None else 200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def _serve_old(port: int = 0) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), _OldServer)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


def test_model_info_and_weight_version_fall_back_to_older_spellings(engine_url: str) -> None:
    server = _serve_old()
    try:
        old = SGLangClient(f"http://127.0.0.1:{server.server_address[1]}")
        assert old.model_info()["model_path"] == "m" and old.weight_version() == 3
    finally:
        server.shutdown()
    assert SGLangClient(engine_url).weight_version() == 0  # newer spelling: /model_info carries it ("default")


def test_calls_retry_with_backoff_until_the_engine_is_up() -> None:
    port = find_free_port()
    holder: list[ThreadingHTTPServer] = []
    timer = threading.Timer(0.5, lambda: holder.append(_serve_old(port)))
    timer.start()
    try:
        client = SGLangClient(f"http://127.0.0.1:{port}", retry=RetryPolicy(max_retries=6, backoff_s=0.1))
        assert client.weight_version() == 3
    finally:
        timer.join()
        for s in holder:
            s.shutdown()
    with pytest.raises(EngineUnavailable):
        SGLangClient(f"http://127.0.0.1:{find_free_port()}", retry=RetryPolicy(2, 0.01)).model_info()


def test_router_spreads_by_outstanding_load_and_fails_over(engine_url: str) -> None:
    port = engine_url.rsplit(":", 1)[1]
    same_engine_two_urls = [engine_url, f"http://localhost:{port}"]
    router = EngineRouter.from_urls(same_engine_two_urls)
    client = SGLangClient(engine_url)
    client.pause_generation("in_place")  # hold all 8 requests in flight
    try:
        with cf.ThreadPoolExecutor(8) as pool:
            futs = [pool.submit(router.generate, [1, 2, i + 3], {"max_new_tokens": 5, **GREEDY}) for i in range(8)]
            deadline = time.monotonic() + 30
            while sum(s["outstanding"] for s in router.stats().values()) < 8:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert sorted(s["outstanding"] for s in router.stats().values()) == [4, 4]
            client.continue_generation()
            for f in futs:
                f.result(timeout=120)
    finally:
        client.continue_generation()
    assert [s["outstanding"] for s in router.stats().values()] == [0, 0]

    dead = f"http://127.0.0.1:{find_free_port()}"
    router = EngineRouter([SGLangClient(dead, retry=RetryPolicy(1, 0.01)), SGLangClient(engine_url)])
    for _ in range(3):
        result, url = router.generate([1, 2], {"max_new_tokens": 2, **GREEDY})
        assert url == engine_url and len(result.output_ids) == 2
    assert router.down() == [dead] and router.stats()[dead]["failures"] == 1
    assert router.check_health() == {dead: False, engine_url: True}


class _Failing:
    """An engine state whose handlers raise: ValueError for /pause_generation, RuntimeError for anything else."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def route(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        self.calls.append(f"{method} {path}")
        if path == P.PAUSE_GENERATION:
            raise ValueError(f"pause mode {body.get('mode')!r}")
        raise RuntimeError("applying the weight update failed")


def test_a_handler_that_raises_gets_an_error_answer_and_is_not_resent() -> None:
    from megatron_sao.engines import client as C
    from megatron_sao.engines.embedded.server import make_server

    state = _Failing()
    server = make_server(state, "127.0.0.1", 0)  # type: ignore[arg-type]
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    client = SGLangClient(f"http://127.0.0.1:{server.server_address[1]}", retry=RetryPolicy(3, 0.01))
    try:
        with pytest.raises(EngineError) as e:
            client.update_weights_from_distributed(["w"], ["float32"], [[2]], group_name="g", weight_version=1)
        assert e.value.status == 500 and state.calls == [f"POST {P.UPDATE_WEIGHTS_FROM_DISTRIBUTED}"]  # sent once
        assert e.value.body == {"error": {"message": "RuntimeError: applying the weight update failed"}}
        assert isinstance(e.value, C.EngineInternalError)
        with pytest.raises(EngineError) as e:
            client.pause_generation("sideways")
        assert e.value.status == 400 and e.value.body == {"error": {"message": "ValueError: pause mode 'sideways'"}}
        assert isinstance(e.value, C.EngineBadRequest) and "not retried" in str(e.value)
        assert len(state.calls) == 2
    finally:
        server.shutdown()
        server.server_close()


def test_the_embedded_engine_answers_a_bad_control_request_with_400(engine_url: str) -> None:
    client = SGLangClient(engine_url, retry=RetryPolicy(2, 0.01))
    with pytest.raises(EngineError) as e:
        client.pause_generation("sideways")  # the scheduler raises ValueError
    assert e.value.status == 400 and "ValueError" in e.value.body["error"]["message"]
    assert client.generate([1, 2], {"max_new_tokens": 2, **GREEDY}).output_ids  # not left paused


class _Dropper(BaseHTTPRequestHandler):
    """Reads each request, counts it, and closes the connection without an answer (an engine dying mid-request)."""

    protocol_version = "HTTP/1.1"
    seen: list[str]

    def _drop(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append(f"{self.command} {self.path}")
        self.close_connection = True

    do_GET = do_POST = _drop

    def log_message(self, *args: Any) -> None:
        pass


def test_a_dropped_connection_resends_only_idempotent_calls() -> None:
    from megatron_sao.engines import client as C

    seen: list[str] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("D", (_Dropper,), {"seen": seen}))
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    client = SGLangClient(f"http://127.0.0.1:{server.server_address[1]}", retry=RetryPolicy(3, 0.01))
    try:
        for call, path in [
            (lambda: client.generate([1, 2], {"max_new_tokens": 2}), P.GENERATE),
            (lambda: client.update_weights_from_distributed(["w"], ["float32"], [[2]], group_name="g"),
             P.UPDATE_WEIGHTS_FROM_DISTRIBUTED),
        ]:  # fmt: skip
            seen.clear()
            with pytest.raises(EngineUnavailable, match="not resent") as e:
                call()
            assert seen == [f"POST {path}"]  # the engine may have acted on it: sent once, never again
            assert isinstance(e.value, C.EngineConnectionLost)
        seen.clear()
        with pytest.raises(EngineUnavailable, match="after 3 retries"):
            client.model_info()  # GET: safe to resend
        assert seen == [f"GET {P.MODEL_INFO}"] * 4
    finally:
        server.shutdown()
        server.server_close()


def test_a_post_is_resent_while_the_connection_is_refused() -> None:
    port = find_free_port()
    seen: list[str] = []

    class Ok(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            seen.append(self.path)
            data = json.dumps({"message": "ok", "status": "ok"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    holder: list[ThreadingHTTPServer] = []

    def start() -> None:
        holder.append(ThreadingHTTPServer(("127.0.0.1", port), Ok))
        threading.Thread(target=holder[0].serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    timer = threading.Timer(0.4, start)
    timer.start()
    try:
        SGLangClient(f"http://127.0.0.1:{port}", retry=RetryPolicy(6, 0.1)).pause_generation("in_place")
        assert seen == [P.PAUSE_GENERATION]  # refused attempts never reached it; the one that did is not repeated
    finally:
        timer.join()
        for s in holder:
            s.shutdown()
            s.server_close()


class _VersionedEngine(SGLangClient):
    """A fake engine: answers /generate with its current weight_version; up or down at will."""

    def __init__(self, url: str, version: int) -> None:
        super().__init__(url)
        self.version, self.up, self.served = version, True, 0

    def generate(self, input_ids: list[int], sampling_params: dict[str, Any], **_: Any) -> P.GenerateResult:
        if not self.up:
            raise EngineUnavailable(f"{self.url} is down")
        self.served += 1
        return P.GenerateResult("r", [1], [-0.1], [self.version], "length", {"type": "length"}, self.version, 1)

    def weight_version(self) -> int:
        return self.version

    def health(self, timeout_s: float = 5.0) -> bool:
        return self.up


def test_router_keeps_work_off_an_engine_behind_on_weights_until_it_caught_up() -> None:
    a, b = _VersionedEngine("http://a:1", 5), _VersionedEngine("http://b:1", 5)
    router = EngineRouter([a, b])
    router.VERSION_PROBE_S = 0.0
    router._outstanding["http://a:1"] = 10  # a is busy: an engine on current weights, b, gets the work
    router.generate([1], {"max_new_tokens": 1})
    assert b.served == 1
    b.up = False  # b dies and comes back on its launch weights (version 0)
    router.generate([1], {"max_new_tokens": 1})
    assert router.down() == ["http://b:1"]
    b.up, b.version = True, 0
    router.check_health()
    assert router.lagging() == ["http://b:1"] and router.stats()["http://b:1"]["lagging"]
    for _ in range(4):  # busy or not, a takes the work while b lags
        _, url = router.generate([1], {"max_new_tokens": 1})
        assert url == "http://a:1"
    assert b.served == 1, "an engine on old weights got work"
    b.version = 5  # the learner pushed to it; the next probe sees it
    _, url = router.generate([1], {"max_new_tokens": 1})
    assert url == "http://b:1" and router.lagging() == []
    router._versions = {"http://a:1": 3, "http://b:1": 2}  # only lagging engines left up: they still serve
    a.up = False
    router.check_health()
    b.version = 2
    _, url = router.generate([1], {"max_new_tokens": 1})
    assert url == "http://b:1"


class _Broken(BaseHTTPRequestHandler):
    """An engine gone wrong: /generate answers 200 with `answer` (cut JSON, JSON without the fields), or never."""

    answer: bytes = b""
    hang = threading.Event()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if not self.answer:
            self.hang.wait(30)  # hold the connection without a byte of answer
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.answer)))
        self.end_headers()
        self.wfile.write(self.answer)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize(
    "answer",
    [b'{"text": "hi", "meta_info": {"id": "r", "output_tok', b'{"text": "hi"}', b'"ok"', b""],
    ids=["cut-json", "no-meta-info", "not-an-object", "hangs"],
)
def test_a_garbage_or_hanging_engine_is_taken_out_and_the_turn_goes_to_another(engine_url: str, answer: bytes) -> None:
    from megatron_sao.engines import client as C

    broken = ThreadingHTTPServer(("127.0.0.1", 0), type("B", (_Broken,), {"answer": answer, "hang": threading.Event()}))
    threading.Thread(target=broken.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    url = f"http://127.0.0.1:{broken.server_address[1]}"
    try:
        alone = SGLangClient(url, retry=RetryPolicy(0))
        expected = EngineTimeout if not answer else C.EngineMalformedResponse
        with pytest.raises(expected) as e:
            alone.generate([1, 2], {"max_new_tokens": 2, **GREEDY}, timeout_s=1.0)
        assert url in str(e.value)
        router = EngineRouter([SGLangClient(url, retry=RetryPolicy(0)), SGLangClient(engine_url)])
        result, served_by = router.generate([1, 2], {"max_new_tokens": 2, **GREEDY}, timeout_s=5.0)  # broken first
        assert served_by == engine_url and len(result.output_ids) == 2
        assert router.down() == [url] and router.stats()[url]["failures"] == 1
    finally:
        broken.RequestHandlerClass.hang.set()  # type: ignore[attr-defined]  # the hanging handler lets go
        broken.shutdown()
        broken.server_close()

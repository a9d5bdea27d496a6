"""The embedded engine under bad input (what SGLang's server also refuses): a NaN / inf sampling field gets a 400
for that request only while others keep decoding; a burst of 2x max-running-requests concurrent /generate calls
gets no connection reset; a body over the size limit is refused unread (413); a client that stops sending is dropped
after the read timeout; a text that cannot fit the context is refused before it is tokenized."""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from megatron_sao.engines.client import SGLangClient


def _post(url: str, body: bytes, headers: dict[str, str] | None = None, timeout: float = 60.0) -> tuple[int, dict]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("POST", "/generate", body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, json.loads(raw) if raw else {}
    finally:
        conn.close()


def _generate(max_new_tokens: int = 2, **sampling: object) -> bytes:
    body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": max_new_tokens, **sampling}}
    return json.dumps(body).encode()


def test_a_nan_or_inf_sampling_field_is_refused_for_that_request_only(engine_url: str) -> None:
    long_one: dict = {}
    worker = threading.Thread(target=lambda: long_one.update(result=_post(engine_url, _generate(24))))
    worker.start()
    time.sleep(0.2)
    for body in (
        b'{"input_ids": [1, 2], "sampling_params": {"temperature": NaN}}',  # the JSON constant
        _generate(temperature="nan"),
        _generate(top_p="inf"),
        _generate(min_p=float("-inf")),
    ):
        status, out = _post(engine_url, body)
        assert status == 400, out
        said = out["error"]["message"]
        assert "finite" in said or "not a JSON number" in said or "must be a number" in said, said
    worker.join(timeout=120)
    status, out = long_one["result"]
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length"  # untouched by the bad ones
    assert len(out["output_ids"]) == 24


def test_a_burst_of_twice_max_running_requests_gets_no_reset(engine_url: str) -> None:
    burst = 2 * 64  # the fixture's engine: max_running=64
    with cf.ThreadPoolExecutor(burst) as pool:
        results = list(pool.map(lambda _: _post(engine_url, _generate(1)), range(burst)))
    assert [status for status, _ in results] == [200] * burst


def test_an_oversized_body_is_refused_unread(engine_url: str) -> None:
    u = urlparse(engine_url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 10000000000\r\n\r\n{")  # fmt: skip
        reply = b""
        while chunk := s.recv(4096):  # the engine answers and closes the connection
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 413") and b"exceeds the engine's limit" in reply
        assert time.monotonic() - t0 < 5
    assert SGLangClient(engine_url).health()


def test_a_client_that_stops_sending_is_dropped_after_the_read_timeout(tiny_dirs: dict[str, Path]) -> None:
    from megatron_sao.engines.embedded.server import build_state, make_server

    state = build_state(str(tiny_dirs["qwen3_moe"]), max_running=4)
    server = make_server(state, "127.0.0.1", 0, read_timeout_s=1.0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    try:
        with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=10) as s:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")  # 99 bytes never come
            t0 = time.monotonic()
            assert s.recv(4096) == b""  # the server closed the connection
            assert 0.5 < time.monotonic() - t0 < 8
    finally:
        server.shutdown()
        server.server_close()
        state.scheduler.stop()


def test_a_client_gone_before_its_answer_leaves_no_traceback(engine_url: str, capfd: pytest.CaptureFixture) -> None:
    """Clients that reset their connection right after sending: the engine answers the next client and prints
    nothing (socketserver printed a ConnectionResetError traceback per such client)."""
    u = urlparse(engine_url)
    body = _generate(16, temperature=0.0)
    for _ in range(3):
        s = socket.create_connection((u.hostname, u.port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # close = RST
        head = f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
        s.sendall(head.encode() + b"\r\n\r\n" + body)
        s.close()
    assert _post(engine_url, _generate(16, temperature=0.0))[0] == 200
    time.sleep(0.5)  # the three answers were due with the fourth's (one batch)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ConnectionResetError" not in err, err[-2000:]


def test_a_text_that_cannot_fit_is_refused_before_tokenizing(engine_url: str) -> None:
    body = json.dumps({"text": "word " * 1_000_000, "sampling_params": {"max_new_tokens": 1}}).encode()  # 5 MB
    status, out = _post(engine_url, body)
    assert status == 400 and "refused before tokenizing" in out["error"]["message"]  # (tokenizing it took ~8 s)


def test_fields_of_the_wrong_type_get_a_400_naming_the_field(engine_url: str) -> None:
    """What a client gets wrong by type is named, never a Python message (issue 31)."""
    cases = [
        ({"text": 123}, "text must be a string or a list of strings, got int"),
        ({"input_ids": "1 2 3"}, "input_ids must be a non-empty list of token ids"),
        ({"input_ids": [1, 2, True]}, "input_ids must be non-empty ints"),
        ({"input_ids": [1, 2], "sampling_params": "fast"}, "sampling_params must be a JSON object"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": True}}, "sampling_params.max_new_tokens=True"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "5"}}, "sampling_params.max_new_tokens='5'"),
        ({"input_ids": [1, 2], "sampling_params": {"top_k": 2.5}}, "sampling_params.top_k=2.5 must be an integer"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "must be a number"),
    ]
    for body, said in cases:
        status, out = _post(engine_url, json.dumps(body).encode())
        assert status == 400 and said in out["error"]["message"], (body, status, out)


def test_max_new_tokens_past_the_context_is_refused_as_sglang_refuses_it(engine_url: str) -> None:
    ctx = SGLangClient(engine_url).model_info().get("context_length") or 0
    status, out = _post(engine_url, _generate(max_new_tokens=10**6))
    assert status == 400 and "Requested token count exceeds the model's maximum context length" in out["error"][
        "message"], (ctx, out)  # fmt: skip
    assert "4 tokens from the input messages and 1000000 tokens for the completion" in out["error"]["message"]


def test_a_chunked_body_is_read(engine_url: str) -> None:
    u = urlparse(engine_url)
    body = _generate(2, temperature=0.0)
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i : i + 7]), body[i : i + 7]) for i in range(0, len(body), 7))
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + chunks + b"0\r\n\r\n")  # fmt: skip
        raw = b""
        while data := sock.recv(65536):
            raw += data
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), raw[:300]
    assert len(json.loads(payload)["output_ids"]) == 2


def test_a_config_json_that_does_not_describe_the_weights_is_named(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """config.json's expert count above the checkpoint's (transformers' own report named neither file nor field)."""
    import shutil

    import pytest

    from megatron_sao.engines.embedded.model_runner import load_engine_model

    bad = tmp_path / "model"
    shutil.copytree(tiny_dirs["qwen3_moe"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    key = "num_local_experts" if "num_local_experts" in cfg else "num_experts"
    cfg[key] = int(cfg[key]) * 2
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config.json does not describe the weights in .*config.json gives \d+ "
                       r"experts, the checkpoint holds \d+"):  # fmt: skip
        load_engine_model(bad)


def test_a_malformed_generate_field_is_named_with_a_400(engine_url: str) -> None:
    """Each refusal names the field that is wrong: a negative max_new_tokens, an int rid, an empty text list."""
    for body, said in (
        (_generate(max_new_tokens=-5), "sampling_params.max_new_tokens=-5 must be >= 0"),
        (json.dumps({"input_ids": [1, 2], "rid": 5}).encode(), "rid=5 must be a string"),
        (json.dumps({"text": []}).encode(), "text must be a non-empty string or list of strings"),
    ):
        status, out = _post(engine_url, body)
        assert status == 400 and said in out["error"]["message"], (status, out)


@pytest.mark.multiproc
def test_an_engine_with_a_key_answers_only_to_it(start_engine: Any, tiny_dirs: dict[str, Path]) -> None:
    """SGLang's --api-key (engines/auth.py): without the key, or with another, every endpoint but the probes answers
    401 `{"error": "Unauthorized"}` before anything happens -- a foreign pause, update group, weight-update session
    or generation changes nothing; with the key everything is served."""
    from megatron_sao.engines.client import EngineError, SGLangClient

    engine = start_engine(tiny_dirs["qwen3_moe_notok"], "--api-key", "the-runs-key")
    engine.wait_healthy()  # /health needs no key
    for key in (None, "another"):
        stranger = SGLangClient(engine.url, api_key=key or "")
        for call in (lambda c: c.pause_generation("in_place"), lambda c: c.begin_weight_update(),
                     lambda c: c.init_weights_update_group("127.0.0.1", 1, 1, 2, "g", "gloo"),
                     lambda c: c.generate([1, 2, 3], {"max_new_tokens": 2}), lambda c: c.server_info()):  # fmt: skip
            with pytest.raises(EngineError) as refused:
                call(stranger)
            assert refused.value.status == 401 and refused.value.body == {"error": "Unauthorized"}
    owner = SGLangClient(engine.url, api_key="the-runs-key")
    assert not owner.server_info()["load"]["paused"]  # the stranger's pause never happened
    assert len(owner.generate([1, 2, 3], {"max_new_tokens": 2, "ignore_eos": True}).output_ids) == 2
    owner.begin_weight_update()
    owner.end_weight_update()


def test_a_pause_no_weight_update_follows_ends_after_the_session_timeout(tiny_dirs: dict[str, Path]) -> None:
    """Issue 46 item 8: a foreign /pause_generation stopped training with no timeout. A pause that no weight-update
    request follows for --weight-session-timeout seconds ends; a pause whose push is under way (a session open, or
    updates still arriving) is left to the session's own timeout."""
    from megatron_sao.engines.embedded.server import build_state

    state = build_state(str(tiny_dirs["qwen3_moe"]), max_running=4, session_timeout_s=0.2)
    try:
        assert state.route("POST", "/pause_generation", {"mode": "in_place"})[0] == 200
        assert not state.end_abandoned_pause(), "a pause ended before its lease"
        time.sleep(0.3)
        state.route("POST", "/update_weight_version", {"new_version": "1", "abort_all_requests": False})
        assert not state.end_abandoned_pause(), "a pause whose trainer is still sending ended"
        assert state.scheduler.paused_for() is not None
        time.sleep(0.3)
        assert state.end_abandoned_pause() and state.scheduler.paused_for() is None
        assert not state.end_abandoned_pause()  # generating: nothing to end
        assert state.route("POST", "/pause_generation", {"mode": "in_place"})[0] == 200
        assert state.route("POST", "/begin_weight_update", {})[0] == 200
        time.sleep(0.3)
        assert not state.end_abandoned_pause(), "the session's pause is the session timeout's to end"
    finally:
        state.scheduler.stop()

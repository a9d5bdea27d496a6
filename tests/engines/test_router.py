"""SGLang's own gateway in front of the embedded engines: sglang-router (PyPI; a Rust binary that runs on CPU)
registers two engines, forwards text and token-id requests to both (SGLang's fields at their defaults, and keys
that are no field: engines/embedded/fields.py), its /workers agrees with the engines' /health; and the rollout
workers' EngineRouter sends generations through it (rollout.router_url), falling back to the engines when it is
gone."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from megatron_sao.distributed.spawn import find_free_port
from megatron_sao.engines import protocol as P
from megatron_sao.engines.client import EngineRouter, SGLangClient


def _start_router(urls: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    port = find_free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(find_free_port()),  # its default port: 29000
           "--worker-urls", *urls, "--policy", "round_robin", "--log-level", "warn"]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    gateway, deadline = SGLangClient(url, timeout_s=30), time.monotonic() + 120
    while True:
        try:
            workers = gateway.request("GET", "/workers")["workers"]
            if len(workers) == len(urls) and all(w["is_healthy"] for w in workers):
                return proc, url
        except (OSError, ValueError, KeyError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"sglang-router did not register {urls}:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.5)


@pytest.mark.multiproc
def test_sglang_router_serves_text_and_token_requests_from_both_engines(
    start_engine: Any, tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    engines = [start_engine(tiny_dirs["qwen3_moe"]) for _ in range(2)]
    for e in engines:
        e.wait_healthy()
    router, url = _start_router([e.url for e in engines], tmp_path / "router.log")
    try:
        gateway = SGLangClient(url, timeout_s=60)
        workers = {w["url"]: w for w in gateway.request("GET", "/workers")["workers"]}
        assert {u: w["is_healthy"] for u, w in workers.items()} == {e.url: SGLangClient(e.url).health() for e in
                                                                     engines}  # fmt: skip
        ids = P.build_generate_request([1, 5, 6, 7], {"max_new_tokens": 4, "temperature": 0.0})
        text = {"text": "hello there", "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
        direct = SGLangClient(engines[0].url).request("POST", P.GENERATE, ids)
        for _ in range(3):  # round robin: each engine gets both kinds
            out = gateway.request("POST", P.GENERATE, ids)
            assert P.parse_generate_response(out).output_ids == direct["output_ids"]  # greedy: either engine
            out = gateway.request("POST", P.GENERATE, text)
            assert out["output_ids"] and isinstance(out["text"], str)
        served = [SGLangClient(e.url).server_info()["load"]["finished"] for e in engines]
        assert served[0] >= 3 and served[1] >= 3, served  # (engine 0 also served the direct request)

        pool = EngineRouter([SGLangClient(e.url) for e in engines], gateway=gateway)
        result, via = pool.generate([1, 5, 6, 7], {"max_new_tokens": 4, "temperature": 0.0})
        assert via == url and result.output_ids == direct["output_ids"] and result.weight_version == 0
        router.kill()
        router.wait(timeout=30)
        result, via = pool.generate([1, 5, 6, 7], {"max_new_tokens": 4, "temperature": 0.0})
        assert via in {e.url for e in engines} and result.output_ids == direct["output_ids"]
        stats = pool.stats()[url]
        assert stats["gateway"] and stats["requests"] == 2 and stats["failures"] == 1 and not stats["healthy"]
    finally:
        if router.poll() is None:
            router.kill()

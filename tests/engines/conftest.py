"""Fixtures of the rollout tests: tiny HF models and embedded engines (in-process over HTTP, or as processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from megatron_sao.distributed.spawn import find_free_port
from megatron_sao.engines.client import SGLangClient
from megatron_sao.models.tiny import make_tiny_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """qwen3_moe / glm4_moe / glm_moe_dsa with tokenizer, and qwen3_moe without (token-in/token-out)."""
    root = tmp_path_factory.mktemp("tiny")
    dirs = {f: make_tiny_model(f, root / f) for f in ("qwen3_moe", "glm4_moe", "glm_moe_dsa")}
    dirs["qwen3_moe_notok"] = make_tiny_model("qwen3_moe", root / "qwen3_moe_notok", tokenizer=False)
    return dirs


def serve_in_thread(model_dir: Path, max_running: int = 64, **kwargs: Any) -> Iterator[str]:
    """An embedded engine served from a thread of the test process (build_state's keyword arguments)."""
    from megatron_sao.engines.embedded.server import build_state, make_server

    state = build_state(str(model_dir), max_running=max_running, **kwargs)
    server = make_server(state, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    state.scheduler.stop()


@pytest.fixture(scope="session")
def engine_url(tiny_dirs: dict[str, Path]) -> Iterator[str]:
    """An embedded engine on qwen3_moe served from a thread of the test process."""
    yield from serve_in_thread(tiny_dirs["qwen3_moe"])


@pytest.fixture(scope="session")
def routed_engine_url(tiny_dirs: dict[str, Path]) -> Iterator[str]:
    """The same, started with --enable-return-routed-experts."""
    yield from serve_in_thread(tiny_dirs["qwen3_moe"], enable_return_routed_experts=True)


class EngineProc:
    """`python -m megatron_sao engine` as a child process (for SIGKILL and torch.distributed tests)."""

    def __init__(self, model_dir: Path, log_path: Path, *extra: str, port: int | None = None) -> None:
        self.port = port or find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "megatron_sao", "engine", "--model", str(model_dir), "--port", str(self.port)]
        self.log_path = log_path
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [*cmd, "--threads", "1", *extra], stdout=out, stderr=subprocess.STDOUT, env=env
            )

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        client = SGLangClient(self.url)
        while not client.health(timeout_s=1.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"engine did not start:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.2)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def start_engine(tmp_path: Path) -> Iterator[Callable[..., EngineProc]]:
    """start_engine(model_dir, *extra_args) -> EngineProc; every engine started is killed at teardown."""
    procs: list[EngineProc] = []

    def start(model_dir: Path, *extra: str) -> EngineProc:
        procs.append(EngineProc(model_dir, tmp_path / f"engine{len(procs)}.log", *extra))
        return procs[-1]

    yield start
    for p in procs:
        p.kill()

"""Forming an update group fails fast: an engine that refuses to join ends the wait at once, not after the
rendezvous timeout (weight_sync.connect_timeout_s, 300 s by default) spent waiting for it."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from megatron_sao.distributed.spawn import find_free_port
from megatron_sao.engines.protocol import ServerProtocol
from megatron_sao.weight_sync.sender import GroupSpec, Member, StageSender, WeightSyncError, in_threads


class _Refuses(BaseHTTPRequestHandler):
    """An engine that answers init_weights_update_group at once with an error (a leftover of another run would)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"success": False, "message": "group g already initialized"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_an_engine_refusing_to_join_fails_the_group_at_once() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refuses)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    spec = GroupSpec(members=(Member(url, ServerProtocol("0.5.9"), 1, 1),), attempt=0, num_stages=1,
                     group_name="g", master_port=find_free_port(), master_addr="127.0.0.1", backend="gloo",
                     load_format=None, connect_timeout_s=300.0, bucket_timeout_s=60.0)  # fmt: skip
    started = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match="group g already initialized"):
            StageSender.connect(0, spec)
    finally:
        server.shutdown()
        server.server_close()
    assert time.monotonic() - started < 30  # not the 300 s rendezvous timeout


def test_in_threads_waits_for_all_unless_told_to_give_up() -> None:
    calls = {"fast": lambda: 1, "slow": lambda: time.sleep(0.3) or 2}
    assert in_threads(calls, 10.0) == {"fast": 1, "slow": 2}

    def boom() -> None:
        raise RuntimeError("refused")

    got = in_threads({"bad": boom, "hangs": lambda: time.sleep(30)}, 60.0, give_up=lambda k, v: k == "bad")
    assert isinstance(got["bad"], RuntimeError) and "abandoned" in str(got["hangs"])

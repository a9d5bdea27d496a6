"""Rank 0's view of the engines across pushes (weight_sync/engines.py), against fake SGLang clients that record
what they are asked: an engine that holds a partial push stays paused until a complete push lands on it, whatever
fails in between; pause_mode none is refused where requests would run on mixed weights."""

from __future__ import annotations

from typing import Any

import pytest

from megatron_sao.config.weight_sync import WeightSyncConfig
from megatron_sao.engines.client import SGLangClient
from megatron_sao.engines.protocol import EMBEDDED_ENGINE, ServerProtocol
from megatron_sao.weight_sync.engines import EngineSet
from megatron_sao.weight_sync.sender import GroupSpec, Member

URLS = ["http://127.0.0.1:9", "http://127.0.0.1:10"]


class FakeEngine(SGLangClient):
    """Answers every control call with success and records it."""

    version = "0.5.23"
    engine: str | None = None

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.calls: list[str] = []

    def _ok(self, name: str) -> dict[str, Any]:
        self.calls.append(name)
        return {"success": True, "message": "ok"}

    def server_info(self) -> dict[str, Any]:
        return {"version": self.version, "tp_size": 1, "dp_size": 1, "engine": self.engine}

    def pause_generation(self, mode: str = "abort") -> Any:
        return self._ok(f"pause:{mode}")

    def continue_generation(self) -> Any:
        return self._ok("continue")

    def destroy_weights_update_group(self, group_name: str) -> Any:
        return self._ok("destroy")

    def end_weight_update(self) -> Any:
        return self._ok("end")


def _engines(**cfg: Any) -> EngineSet:
    engines = EngineSet(WeightSyncConfig(**cfg), URLS, "gloo", 1, updates=4)
    engines.clients = {u: FakeEngine(u) for u in URLS}
    return engines


def _spec(protocol: ServerProtocol) -> GroupSpec:
    members = tuple(Member(u, protocol, 1, 1 + i) for i, u in enumerate(URLS))
    return GroupSpec(members=members, attempt=0, num_stages=1, group_name="g", master_port=1, master_addr="auto",
                     backend="gloo", load_format=None, connect_timeout_s=10.0, bucket_timeout_s=10.0)  # fmt: skip


def test_a_quarantined_engine_stays_paused_through_later_failures_until_a_push_lands() -> None:
    engines = _engines()
    spec = _spec(ServerProtocol("0.5.23"))  # real SGLang: a partial push stays in its live weights
    a, b = URLS
    engines.abandon(spec, "stage 0: bucket 3 failed", touched={a})  # a got part of the push, b nothing
    assert engines.quarantined == {a}
    assert "continue" not in engines.clients[a].calls and "continue" in engines.clients[b].calls
    # the next push fails before any update reaches an engine (a connect or begin failure): a stays out of service
    for client in engines.clients.values():
        client.calls.clear()
    engines.abandon(spec, "could not form update group", touched=set())
    assert engines.quarantined == {a}, "a failure that touched nothing must not release a partially updated engine"
    assert "continue" not in engines.clients[a].calls
    # a complete push lands on both: a serves again
    engines.conclude(spec, {}, touched={a, b}, version=3)
    assert engines.quarantined == set() and "continue" in engines.clients[a].calls
    assert engines.held == {a: 3, b: 3}


def test_pause_mode_none_is_refused_for_sglang_pushes_of_several_updates() -> None:
    engines = _engines(pause_mode="none")
    with pytest.raises(ValueError, match=r"weight_sync.pause_mode='none'.*4 updates.*mixed weights"):
        engines._describe(URLS[0])
    one = EngineSet(WeightSyncConfig(pause_mode="none"), URLS, "gloo", 1, updates=1)
    one.clients = {u: FakeEngine(u) for u in URLS}
    assert one._describe(URLS[0])[0].version == "0.5.23"  # a one-update push switches at once: allowed
    embedded = _engines(pause_mode="none")
    for client in embedded.clients.values():
        client.engine = EMBEDDED_ENGINE  # stages the whole push and switches at its end
    assert embedded._describe(URLS[0])[0].staged

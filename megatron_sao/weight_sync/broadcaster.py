"""Trainer side of the weight sync (learner rank 0): the update group with the engines and one push per version.

    connect():  POST /init_weights_update_group to every healthy engine (rank_offset 1, 1 + tp_0, ...) while
                joining the group as rank 0 (group.py), backend nccl on GPU and gloo on CPU (weight_sync.backend).
    push(weights, version):
                pause the engines (weight_sync.pause_mode), then bucket by bucket (weight_sync.bucket_mb):
                POST /update_weights_from_distributed {names, dtypes, shapes} to every engine and broadcast each
                tensor from rank 0 in that order; the last bucket carries weight_version (and flush_cache), so
                tokens are tagged with the new version only once every tensor is in; then continue generation.
    close():    destroy the group on the engines and here.

An engine that refuses a bucket (shape/dtype mismatch: it drains the tensors, keeps its weights, answers 400) or
fails mid-push raises WeightSyncError naming the engine and its message; the group is then torn down, and the
next push() reconnects on the next port (weight_sync.master_port + attempt). SGLang servers and the embedded engine
speak the same protocol, so this code is the same on a cluster and on one CPU machine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from megatron_sao.config.weight_sync import WeightSyncConfig
from megatron_sao.distributed.update_group import destroy_update_group, init_update_group
from megatron_sao.rollout.client import EngineError, SGLangClient

log = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 300.0


class WeightSyncError(RuntimeError):
    """A push or connect that did not reach every engine; the message names the engine and what it said."""


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def _in_threads(calls: dict[str, Callable[[], Any]], timeout_s: float) -> dict[str, Any]:
    """Run each call on its own thread; {key: result or the exception it raised}."""
    out: dict[str, Any] = {}

    def run(key: str, fn: Callable[[], Any]) -> None:
        try:
            out[key] = fn()
        except BaseException as e:  # reported to the caller, never lost
            out[key] = e

    threads = [threading.Thread(target=run, args=kv, daemon=True) for kv in calls.items()]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    for key in calls:
        out.setdefault(key, TimeoutError(f"no answer within {timeout_s:.0f}s"))
    return out


class WeightBroadcaster:
    def __init__(self, cfg: WeightSyncConfig, engine_urls: list[str], timeout_s: float = GROUP_TIMEOUT_S) -> None:
        if not engine_urls:
            raise ValueError("WeightBroadcaster needs at least one engine url")
        self.cfg = cfg
        self.backend = resolve_backend(cfg.backend)
        self.clients = [SGLangClient(u, timeout_s=timeout_s) for u in engine_urls]
        self.timeout_s = timeout_s
        self.group: Any = None
        self.members: list[SGLangClient] = []  # the engines in the current group
        self.attempt = 0

    def _tp_size(self, client: SGLangClient) -> int:
        """Ranks an engine puts in the group: its tensor-parallel size (SGLang reports tp_size; embedded: 1)."""
        try:
            info = client.request("GET", "/server_info", timeout_s=30.0)
        except EngineError:
            return 1
        return int(info.get("tp_size", 1)) if isinstance(info, dict) else 1

    def healthy(self) -> list[SGLangClient]:
        """The engines answering /health now (asked in parallel)."""
        ok = _in_threads({c.url: (lambda c=c: c.health(timeout_s=5.0)) for c in self.clients}, 15.0)
        return [c for c in self.clients if ok.get(c.url) is True]

    def connect(self, members: list[SGLangClient] | None = None) -> None:
        """Form the group with `members` (default: every engine)."""
        members = list(self.clients if members is None else members)
        port = self.cfg.master_port + self.attempt
        offsets, world = {}, 1
        for c in members:
            offsets[c.url] = world
            world += self._tp_size(c)
        name = f"{self.cfg.group_name}_{self.attempt}"
        calls = {
            c.url: (lambda c=c: c.init_weights_update_group(
                self.cfg.master_addr, port, offsets[c.url], world, name, self.backend))
            for c in members
        }  # fmt: skip
        box: dict[str, Any] = {}

        def join() -> None:
            box["group"] = init_update_group(self.backend, self.cfg.master_addr, port, world, 0, name, self.timeout_s)

        results = _in_threads({**calls, "trainer": join}, self.timeout_s + 10)
        failed = {k: v for k, v in results.items() if isinstance(v, BaseException)}
        if failed:
            self.attempt += 1
            if "group" in box:
                destroy_update_group(box["group"])
            raise WeightSyncError(f"could not form the weight update group on port {port}: " + _describe(failed))
        self.group, self.group_name, self.members = box["group"], name, members
        log.info("weight sync: update group %s with %d of %d engines (world %d, %s)", name, len(members),
                 len(self.clients), world, self.backend)  # fmt: skip

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        """Send every (HF name, tensor) to every healthy engine and tag them with `version`; returns metrics.

        Engines that do not answer /health are left out (they keep generating with older weights, which the
        staleness gate sees); when the healthy set changed since the group was formed (an engine died or came
        back, e.g. restarted with its initial weights), the group is formed again first."""
        healthy = self.healthy()
        if not healthy:
            raise WeightSyncError(f"no engine answers /health ({', '.join(c.url for c in self.clients)})")
        if self.group is not None and [c.url for c in healthy] != [c.url for c in self.members]:
            log.warning("weight sync: engines up changed (%s -> %s); forming the group again",
                        [c.url for c in self.members], [c.url for c in healthy])  # fmt: skip
            self._teardown()
        if self.group is None:
            self.connect(healthy)
        t0 = time.monotonic()
        pause = self.cfg.pause_mode != "none"
        tensors = nbytes = buckets = 0
        try:
            if pause:
                self._each(lambda c: c.pause_generation(self.cfg.pause_mode), "pause_generation")
            self._each(lambda c: c.begin_weight_update() if c.protocol().session else None, "begin_weight_update")
            pending: list[tuple[str, torch.Tensor]] = []
            size = 0
            limit = int(self.cfg.bucket_mb * 2**20)
            for name, tensor in weights:
                if pending and size + tensor.nbytes > limit:
                    self._bucket(pending, None)
                    buckets += 1
                    pending, size = [], 0
                pending.append((name, tensor))
                size += tensor.nbytes
                tensors += 1
                nbytes += tensor.nbytes
            self._bucket(pending, version)  # the last one (possibly empty) carries the version
            buckets += 1
            self._each(lambda c: c.end_weight_update() if c.protocol().session else None, "end_weight_update")
        except BaseException:
            self._teardown()  # destroying the groups discards what the engines staged
            self._each(lambda c: c.end_weight_update() if c.protocol().session else None, "end_weight_update",
                       raise_errors=False)  # fmt: skip
            raise
        finally:
            if pause:
                self._each(lambda c: c.continue_generation(), "continue_generation", raise_errors=False)
        return {"sync/seconds": time.monotonic() - t0, "sync/tensors": float(tensors), "sync/bytes": float(nbytes),
                "sync/buckets": float(buckets), "sync/version": float(version)}  # fmt: skip

    def _bucket(self, items: list[tuple[str, torch.Tensor]], version: int | None) -> None:
        names = [n for n, _ in items]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in items]
        shapes = [list(t.shape) for _, t in items]
        last = version is not None
        calls = {
            c.url: (lambda c=c: c.update_weights_from_distributed(
                names, dtypes, shapes, group_name=self.group_name, weight_version=version,
                flush_cache=self.cfg.flush_cache and last and self.cfg.pause_mode in ("abort", "retract")))
            for c in self.members
        }  # fmt: skip
        # NCCL sends from this rank's GPU; the CUDA device is per thread, so the sending thread sets it again
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else None

        def send() -> None:
            if device is not None:
                torch.cuda.set_device(device)
            for _, tensor in items:
                dist.broadcast(tensor if device is None else tensor.to(device), src=0, group=self.group)

        results = _in_threads({**calls, "trainer": send}, self.timeout_s)
        failed = {k: v for k, v in results.items() if isinstance(v, BaseException)}
        refused = {k: v for k, v in results.items() if isinstance(v, dict) and not v.get("success", False)}
        if failed or refused:
            raise WeightSyncError(f"weight update (version {version}) failed: " + _describe({**failed, **refused}))

    def _each(self, fn: Callable[[SGLangClient], Any], what: str, raise_errors: bool = True) -> None:
        results = _in_threads({c.url: (lambda c=c: fn(c)) for c in self.members}, 120.0)
        failed = {k: v for k, v in results.items() if isinstance(v, BaseException)}
        if failed and raise_errors:
            raise WeightSyncError(f"{what} failed: " + _describe(failed))
        for url, e in failed.items():
            log.warning("weight sync: %s on %s failed: %r", what, url, e)

    def _teardown(self) -> None:
        """Forget a group a failed push left behind (the engines may still hold theirs: they are asked to drop it);
        the next push reconnects on the next port."""
        group, self.group = self.group, None
        self.attempt += 1
        if group is None:
            return
        name = getattr(self, "group_name", None)
        if name is not None:
            _in_threads({c.url: (lambda c=c: c.destroy_weights_update_group(name)) for c in self.members}, 30.0)
        try:
            destroy_update_group(group)
        except Exception as e:  # a broken group may refuse to be destroyed; it is dropped either way
            log.warning("weight sync: destroying the broken update group: %r", e)
        self.members = []

    def close(self) -> None:
        if self.group is None:
            return
        name = self.group_name
        _in_threads({c.url: (lambda c=c: c.destroy_weights_update_group(name)) for c in self.members}, 30.0)
        destroy_update_group(self.group)
        self.group, self.members = None, []


def _describe(errors: dict[str, Any]) -> str:
    parts = []
    for key, err in errors.items():
        msg = err.get("message") if isinstance(err, dict) else repr(err)
        parts.append(f"{key}: {msg}")
    return "; ".join(parts)

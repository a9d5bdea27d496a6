"""Continuous batching of the embedded engine (owned by embedded/; embedded/server.py submits requests and commands).

One scheduler thread owns the model. Each iteration is a token boundary: it first applies pending commands (weight
updates, aborts, pause/continue), then admits waiting requests into free KV slots (one prefill forward each, which
samples their first token), then runs ONE batched decode forward over every running request (one new token each).
Finished requests leave the batch and free their slot at once; new ones join at the next iteration. Every
generated token records the weight version of the forward that produced it, so a weight update applied between
two steps shows up inside a running request as a version change (SGLang's in-place semantics: the KV cache
computed under the old weights is kept).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_sao.engines.embedded.kv_cache import SlotKVCache
from megatron_sao.engines.embedded.model_runner import ModelRunner, SamplingParams, sample
from megatron_sao.engines.embedded.weights import ReceivedUpdate, WeightUpdater

log = logging.getLogger(__name__)


@dataclass
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[str] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    slot: int | None = None
    kv_len: int = 0  # tokens of this request held in its slot
    generator: torch.Generator | None = None
    return_routes: bool = False  # return_routed_experts: keep each forwarded position's experts (capture on)
    routes: list[torch.Tensor] = field(default_factory=list)  # int32 [n, layers, top_k] pieces, position order
    created_at: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        updater: WeightUpdater,
        *,
        max_running: int,
        context_len: int,
        eos_ids: tuple[int, ...],
        weight_version: str,
    ) -> None:
        self.runner = runner
        self.updater = updater
        self.cache = SlotKVCache(max_running, context_len)
        self.context_len = context_len
        self.eos_ids = frozenset(eos_ids)
        self.weight_version = weight_version
        self._cv = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        self._boundary: list[tuple[Callable[[], Any], threading.Event, list[Any]]] = []  # run between two steps
        self._paused = False
        self._stopped = False
        self._in_step = False  # a prefill/decode step is running outside the lock
        self.stats = {"generated_tokens": 0, "decode_steps": 0, "prefills": 0, "finished": 0, "aborted": 0}
        self.busy_s = 0.0  # time in forward passes (prefills and decode steps) since start
        # time the engine did not decode because of a push: calls run at a token boundary (a push's commit, a
        # version switch) while not paused, and time paused (/pause_generation until /continue_generation)
        self.boundary_s = 0.0
        self.paused_s = 0.0
        self.weight_commits = 0  # weight updates applied since start (/server_info weight_commits)
        self._paused_since: float | None = None
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout=30)

    # ---- API for the HTTP handlers (any thread) -----------------------------------------------------------------
    def submit(self, req: Request) -> None:
        if req.params.sampling_seed is not None:
            req.generator = torch.Generator().manual_seed(req.params.sampling_seed)
        with self._cv:
            if req.params.max_new_tokens == 0:
                self._finish(req, {"type": "length", "length": 0})
                return
            self._waiting.append(req)
            self._cv.notify_all()

    def abort(self, rid: str | None, message: str = "Aborted by /abort_request") -> int:
        """Abort request `rid` (None: all). Returns how many were aborted."""
        with self._cv:
            victims = [r for r in [*self._waiting, *self._running] if rid is None or r.rid == rid]
            for r in victims:
                self._drop(r)
                self.stats["aborted"] += 1
                self._finish(r, {"type": "abort", "message": message, "status_code": None, "err_type": None})
            return len(victims)

    def pause(self, mode: str) -> None:
        with self._cv:
            if mode == "abort":
                self.abort(None, "Aborted by /pause_generation (mode=abort)")  # the condition's lock is re-entrant
            elif mode == "retract":  # free the KV; the request is recomputed (prompt + output so far) on continue
                for r in reversed(self._running):
                    self._drop(r)
                    self._waiting.appendleft(r)
            elif mode != "in_place":
                raise ValueError(f"pause mode {mode!r}; use abort, retract or in_place")
            self._paused = True
            if self._paused_since is None:
                self._paused_since = time.monotonic()
            while self._in_step and not self._stopped:  # return at a token boundary: nothing runs after this
                self._cv.wait(timeout=1.0)

    def paused_for(self) -> float | None:
        """Seconds since /pause_generation while paused; None when generating."""
        with self._cv:
            return None if self._paused_since is None else time.monotonic() - self._paused_since

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            if self._paused_since is not None:
                self.paused_s += time.monotonic() - self._paused_since
                self._paused_since = None
            self._cv.notify_all()

    def at_boundary(self, fn: Callable[[], Any], timeout_s: float = 600.0) -> Any:
        """Run `fn` on the scheduler thread at the next token boundary (no forward running, none half-sampled) and
        return its result; what it raises is raised here. Runs while paused too."""
        done, box = threading.Event(), []
        with self._cv:
            self._boundary.append((fn, done, box))
            self._cv.notify_all()
        if not done.wait(timeout_s):
            raise TimeoutError(f"not run at a token boundary within {timeout_s}s (scheduler stuck?)")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def apply_update(self, update: ReceivedUpdate, timeout_s: float = 600.0) -> None:
        """Copy a received update into the model and switch to its weight_version (if any) at one token boundary:
        every token sampled after it comes from the new weights and carries the new version."""

        def apply() -> None:
            self.updater.apply(update)
            self.weight_commits += 1
            if update.weight_version is not None:
                self.weight_version = update.weight_version

        try:
            self.at_boundary(apply, timeout_s)
        except (RuntimeError, ValueError) as e:  # the version is not bumped
            log.exception("applying a weight update failed")
            raise RuntimeError(f"applying the weight update failed: {e!r}") from e

    def set_weight_version(self, version: str) -> None:
        self.at_boundary(lambda: setattr(self, "weight_version", version))

    def flushable(self) -> bool:
        """SGLang's rule for a cache flush (Scheduler.flush_cache: is_fully_idle(ignore_waiting=paused)): nothing
        holds KV (no running request: an in_place pause keeps them running), and nothing waits unless paused (a
        retracted request waits without KV)."""
        with self._cv:
            return not self._running and (self._paused or not self._waiting)

    def load(self) -> dict[str, Any]:
        with self._cv:
            return {
                "num_running": len(self._running),
                "num_waiting": len(self._waiting),
                "paused": self._paused,
                "weight_version": self.weight_version,
                "busy_s": self.busy_s,
                "boundary_s": self.boundary_s,  # the engine's own count of what a push stopped it for
                "paused_s": self.paused_s + (time.monotonic() - self._paused_since if self._paused_since else 0.0),
                "uptime_s": time.monotonic() - self.started,
                **self.stats,
            }

    def idle(self) -> bool:
        with self._cv:
            return not self._running and not self._waiting

    # ---- scheduler thread ---------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while (
                    not self._stopped and not self._boundary and (self._paused or not (self._waiting or self._running))
                ):
                    self._cv.wait(timeout=1.0)
                if self._stopped:
                    return
                calls, self._boundary = self._boundary, []
                t_boundary = time.monotonic()
                for fn, done, box in calls:  # token boundary: no forward is running
                    try:
                        box.append((True, fn()))
                    except Exception as e:  # handed to the caller of at_boundary
                        box.append((False, e))
                    done.set()
                if calls and not self._paused:  # while paused the time counts once, in paused_s
                    self.boundary_s += time.monotonic() - t_boundary
                if self._paused:
                    continue
                admitted = self._admit()
                batch = [r for r in self._running if r not in admitted]
                self._in_step = True
            started = time.monotonic()
            try:
                for req in admitted:
                    self._prefill(req)
                if batch:
                    self._decode(batch)
            except Exception as e:
                log.exception("forward pass failed")
                with self._cv:
                    for r in [*admitted, *batch]:
                        if r.done.is_set():  # finished (e.g. aborted) before the failure: keep its result
                            continue
                        self._drop(r)
                        self._finish(r, {"type": "abort", "message": f"engine error: {e!r}", "status_code": 500})
            finally:
                with self._cv:
                    self._in_step = False
                    self.busy_s += time.monotonic() - started
                    self._cv.notify_all()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _admit(self) -> list[Request]:
        admitted = []
        while self._waiting and self.cache.free_slots:
            req = self._waiting.popleft()
            req.slot = self.cache.acquire()
            req.kv_len = 0
            self._running.append(req)
            admitted.append(req)
        return admitted

    def _prefill(self, req: Request) -> None:
        tokens = req.input_ids + req.output_ids  # output_ids is non-empty only after a retract
        ids = torch.tensor([tokens], dtype=torch.long)
        logits = self.runner.forward(self.cache, [req.slot], [0], ids)
        self.stats["prefills"] += 1
        with self._cv:
            if req.slot is None:  # aborted meanwhile
                return
            req.kv_len = len(tokens)
            if req.return_routes and self.runner.last_routes is not None:  # a retract recomputes every position
                req.routes = [self.runner.last_routes[0]]
            self._append([req], logits)

    def _decode(self, batch: list[Request]) -> None:
        with self._cv:  # requests aborted or retracted while the prefills ran have no slot any more
            batch = [r for r in batch if r.slot is not None]
            if not batch:
                return
            ids = torch.tensor([[r.output_ids[-1]] for r in batch], dtype=torch.long)
            slots, lengths = [r.slot for r in batch], [r.kv_len for r in batch]
        logits = self.runner.forward(self.cache, slots, lengths, ids)
        self.stats["decode_steps"] += 1
        with self._cv:
            live = [(i, r) for i, r in enumerate(batch) if r.slot is not None]
            routes = self.runner.last_routes if any(r.return_routes for _, r in live) else None
            for i, r in live:
                r.kv_len += 1
                if r.return_routes and routes is not None:
                    r.routes.append(routes[i])
            if live:
                self._append([r for _, r in live], logits[[i for i, _ in live]])

    def _append(self, reqs: list[Request], logits: torch.Tensor) -> None:
        """Sample one token per request (caller holds the lock) and finish those that are done."""
        tokens, logprobs = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        for r, tok, lp in zip(reqs, tokens, logprobs):
            r.output_ids.append(tok)
            r.output_logprobs.append(lp)
            r.output_versions.append(self.weight_version)
            self.stats["generated_tokens"] += 1
            reason = self._finish_reason(r, tok)
            if reason is not None:
                self._drop(r)
                self.stats["finished"] += 1
                self._finish(r, reason)

    def _finish_reason(self, r: Request, tok: int) -> dict[str, Any] | None:
        p = r.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            return {"type": "stop", "matched": tok}
        if len(r.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if len(r.input_ids) + len(r.output_ids) >= self.context_len:
            return {"type": "length", "length": len(r.output_ids)}
        return None

    def _drop(self, r: Request) -> None:
        """Remove r from the queues and free its slot (caller holds the lock)."""
        if r in self._running:
            self._running.remove(r)
        if r in self._waiting:
            self._waiting.remove(r)
        if r.slot is not None:
            self.cache.release(r.slot)
            r.slot = None

    @staticmethod
    def _finish(r: Request, reason: dict[str, Any]) -> None:
        r.finish_reason = reason
        r.done.set()

"""The rollout worker: prompts -> episodes on the engines -> each finished trajectory onto the sink at once (owned
by rollout/; started by the launch scripts, wired to the bus by the merge: the bus `TrajectorySender` is a sink).

`concurrency` episodes run at a time (threads; each episode is sequential HTTP). Each prompt is rolled out
`rollouts_per_prompt` times (1 for SAO, G for the group arms; sample_index 0..G-1); the prompt is marked complete in
the cursor when all of them were pushed (or given up), and the cursor state is saved then. The group arms generate in
batches of `batch_prompts` prompts (BatchGate: lockstep with the learner's weight versions) and push a group only
whole, once all its G samples finished (a group with a failed sample is dropped and another prompt takes its place).
A turn whose engine dies or times out is re-issued on another engine by the router; an episode that still fails
(aborted turn, an engine error 5xx) is re-issued from scratch after a back-off, up to `max_attempts` times; with no
healthy engine at all (the only one restarting) it waits for one without using up attempts, and no new prompt is
taken while `concurrency` episodes run or wait. Any other exception of an episode (the environment, the agent loop,
a request the engine refuses) fails that sample only: it is logged with the prompt id and counted in `failed`, and
the run goes on. Every (prompt, sample) is pushed at most once. A log line with throughput and engine health is
written every `log_interval_s`.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from megatron_sao.bus.schema import Trajectory
from megatron_sao.config.tree import SAOConfig
from megatron_sao.engines.client import (
    EngineInternalError,
    EngineRouter,
    EngineTimeout,
    EngineUnavailable,
    NoHealthyEngine,
)
from megatron_sao.files import JsonlAppender, rollout_metrics_file
from megatron_sao.files.metrics_schema import unlisted_keys
from megatron_sao.rollout.agent_loop import AgentLoop, EpisodeAborted
from megatron_sao.rollout.prompts import PromptCursor

log = logging.getLogger(__name__)

RETRYABLE = (NoHealthyEngine, EpisodeAborted, EngineUnavailable, EngineTimeout, EngineInternalError)


class TrajectorySink(Protocol):
    """Where finished trajectories go; the bus TrajectorySender satisfies it. A sink that gives a trajectory up (the
    run is stopping while the bus is full) raises Undelivered: its prompt is then not marked done, and is
    re-issued by the next run. A sink whose trajectories are not durable once sent (a bus without a spool, until the
    learner commits them) also has `volatile_ids() -> set[str]`: the cursor saves their prompts as pending. A sink that
    can refuse or lose a trajectory after send() returned has `rejected() -> [(id, reason, detail)]`: each is recorded
    in the ledger, and a prompt whose trajectory was lost from a damaged spool file is generated again. A sink under
    rollout admission (bus/admission.py) has `admitting`, `take_starts(k, floor)` and `end_start(floor)`: an episode
    starts only under a start the learner granted."""

    def send(self, traj: Trajectory) -> None: ...


FLOOR_REFRESH_S = 0.5
"""Rollout admission: while the learner grants no start, the engines are asked for their weight version this often
(the versions they reported with their last tokens go stale while nothing runs)."""


class WorkerIdInUse(ValueError):
    """Another live worker holds this worker id's cursor file."""


class Undelivered(RuntimeError):
    """The sink did not take the trajectory (rollout/cli.py's StoppableSink when stopping)."""


class InMemorySink:
    def __init__(self) -> None:
        self.items: list[Trajectory] = []
        self._lock = threading.Lock()

    def send(self, traj: Trajectory) -> None:
        with self._lock:
            self.items.append(traj)


@dataclass
class WorkerConfig:
    worker_id: str = "rollout-0"
    concurrency: int = 32
    rollouts_per_prompt: int = 1
    max_attempts: int = 3
    retry_backoff_s: float = 1.0  # rollout.episode_retry_backoff_s
    log_interval_s: float = 30.0
    state_path: str | None = None  # cursor state, saved whenever a prompt completes, at every log interval, at the end
    batch_prompts: int | None = None  # group arms: prompts per batch (B); None streams (SAO, running_mean)
    batch_lag: int = 0  # group arms: 0 synchronous (grpo), 1 one-step-off (grpo_async)
    gate_poll_s: float = 0.1  # rollout.batch_gate_poll_s
    metrics_path: str | None = None  # JSON lines of the worker's metrics, one per log interval and at the end
    ledger_path: str | None = None  # JSON lines of the worker's side of the trajectory ledger (run/ledger.py)


class BatchGate:
    """When the next batch of a group arm may be generated. Batch i opens once batch i-1 was sent whole and, past the
    first 1 + lag batches, once the engines hold a version newer than the one batch i-1 was generated with: with lag
    0 (grpo) that is the version the learner trained on batch i-1, so generation never overlaps training; with lag 1
    (grpo_async) batch i runs while batch i-1 trains, on the weights trained on batch i-2 -- one version old."""

    def __init__(self, prompts: int, lag: int, engine_version: Callable[[], int | None]) -> None:
        self.prompts, self.lag, self.engine_version = prompts, lag, engine_version
        self.index = -1  # the batch being generated
        self.versions: list[int] = []  # the engines' version when each batch opened
        self.taken = 0  # prompts taken into the current batch (a dropped group gives its place back)
        self.sent = 0  # groups of the current batch sent whole

    @property
    def full(self) -> bool:
        return self.index >= 0 and self.taken >= self.prompts

    def try_open(self) -> bool:
        """Open the next batch if it may start now."""
        if self.index >= 0 and self.sent < self.prompts:
            return False
        version = self.engine_version()
        if version is None:
            return False
        if self.index + 1 >= 1 + self.lag and version <= self.versions[-1]:
            return False
        self.index += 1
        self.versions.append(version)
        self.taken = self.sent = 0
        log.info("batch %d opens on weights version %d", self.index, version)
        return True


@dataclass
class _Task:
    key: str
    record: dict[str, Any]
    sample_index: int
    attempt: int = 1
    not_before: float = 0.0  # monotonic time before which a re-issued task is not started (back-off)
    floor: int | None = None  # rollout admission: the engines' version its granted start counts from (kept on retry)


@dataclass
class WorkerMetrics:
    started: float = field(default_factory=time.monotonic)
    trajectories: int = 0
    prompts_done: int = 0
    tokens: int = 0
    action_tokens: int = 0
    reward_sum: float = 0.0
    reissued: int = 0
    failed: int = 0
    dropped_groups: int = 0
    turns: int = 0
    tool_calls: int = 0  # turns an observation followed
    generate_s: float = 0.0  # engine time over all turns
    tool_s: float = 0.0

    def count(self, traj: Trajectory) -> None:
        self.trajectories += 1
        self.tokens += traj.header.num_tokens
        self.action_tokens += traj.num_action_tokens
        self.reward_sum += traj.header.reward
        turns = traj.header.turns
        self.turns += len(turns)
        self.tool_calls += sum(t.observation_end > t.action_end for t in turns)
        self.generate_s += sum(t.generate_s for t in turns)
        self.tool_s += sum(t.tool_s for t in turns)

    def snapshot(self) -> dict[str, float]:
        dt = max(time.monotonic() - self.started, 1e-9)
        n = max(self.trajectories, 1)
        return {
            "trajectories": self.trajectories,
            "prompts_done": self.prompts_done,
            "trajectories_per_s": self.trajectories / dt,
            "action_tokens_per_s": self.action_tokens / dt,
            "mean_reward": self.reward_sum / n,
            "reissued": self.reissued,
            "failed": self.failed,
            "dropped_groups": self.dropped_groups,
            "episode_tokens_mean": self.tokens / n,
            "turns_mean": self.turns / n,
            "tool_calls_mean": self.tool_calls / n,
            "engine_latency_s_mean": self.generate_s / max(self.turns, 1),  # per turn: request to last token
            "tool_s_mean": self.tool_s / max(self.tool_calls, 1),
        }


class RolloutWorker:
    def __init__(
        self,
        cursor: PromptCursor,
        loop: AgentLoop,
        sink: TrajectorySink,
        cfg: WorkerConfig,
        router: EngineRouter | None = None,
    ) -> None:
        self.cursor, self.loop, self.sink, self.cfg, self.router = cursor, loop, sink, cfg, router
        self.metrics = WorkerMetrics()
        self._lock = threading.Lock()
        self._ledger_lock = threading.Lock()
        self._ledger_file: JsonlAppender | None = None
        self._metrics_file: JsonlAppender | None = None
        self._unlisted_warned: set[str] = set()
        self._undelivered: set[str] = set()  # prompts a sample of which the sink gave up
        self._sent: set[tuple[str, int]] = set()
        self._sent_keys: dict[str, str] = {}  # trajectory id -> prompt key, while the sink may still lose it
        self._state_lock_fd = -1
        self._rejected_seen: set[str] = set()
        self._next_wait_log = 0.0
        self._remaining: dict[str, int] = {}  # prompt key -> samples not pushed yet
        self._backoff: list[_Task] = []  # re-issued tasks waiting out their back-off (never slept on the run thread)
        self._health_pool: cf.ThreadPoolExecutor | None = None  # engine probes, off the run thread
        self._probe: cf.Future[dict[str, bool]] | None = None
        self._groups: dict[str, dict[int, Trajectory]] = {}  # group arms: finished samples, held until the group is in
        self._failed_samples: dict[str, int] = {}
        self._granted: list[int] = []  # rollout admission: starts granted and not yet given to an episode (floors)
        self._denied = False  # the last ask for starts got none
        self._floor_asked = 0.0  # when the engines were last asked for their version while denied
        self.gate: BatchGate | None = None
        if cfg.batch_prompts is not None:
            if router is None:
                raise ValueError("a batched worker (group arms) needs the engine router to read the weight version")
            self.gate = BatchGate(cfg.batch_prompts, cfg.batch_lag, router.current_version)
        if cfg.state_path:
            cursor.load(cfg.state_path)

    def _hold_state(self) -> None:
        """One live worker per cursor file: a second worker with the same id would interleave their saves."""
        assert self.cfg.state_path
        lock = Path(f"{self.cfg.state_path}.lock")
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise WorkerIdInUse(
                f"rollout worker {self.cfg.worker_id!r}: its cursor {self.cfg.state_path} is held by a live worker "
                f"(pid {holder}); give each worker its own --worker-id, or stop pid {holder}"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._state_lock_fd = fd

    def close(self) -> None:
        """Save the cursor (what the learner committed since is now done) and let another worker take it."""
        self._take_rejected()
        self.save_state()
        self._release_state()
        for f in (self._ledger_file, self._metrics_file):
            if f is not None:
                f.close()
        self._ledger_file = self._metrics_file = None

    def _release_state(self) -> None:
        if self._state_lock_fd >= 0:
            fcntl.flock(self._state_lock_fd, fcntl.LOCK_UN)
            os.close(self._state_lock_fd)
            self._state_lock_fd = -1

    def run(self, max_prompts: int | None = None, stop: threading.Event | None = None) -> dict[str, Any]:
        """Roll out until the cursor is exhausted, `max_prompts` prompts were taken, or `stop` is set. Holds the
        cursor file (one live worker per id) until close()."""
        if self.cfg.state_path and self._state_lock_fd < 0:
            self._hold_state()
        self._ledger({"event": "start", "worker": self.cfg.worker_id, "pid": os.getpid()})
        try:
            return self._run(max_prompts, stop or threading.Event())
        except BaseException:
            self._release_state()  # as the process's death would; what was saved along the way stands
            raise

    def _run(self, max_prompts: int | None, stop: threading.Event) -> dict[str, Any]:
        queue: list[_Task] = []
        self._backoff = []
        taken = 0
        next_log = time.monotonic() + self.cfg.log_interval_s
        with (
            cf.ThreadPoolExecutor(self.cfg.concurrency, thread_name_prefix=self.cfg.worker_id) as pool,
            cf.ThreadPoolExecutor(1, thread_name_prefix=f"{self.cfg.worker_id}-health") as self._health_pool,
        ):
            running: dict[cf.Future[Trajectory], _Task] = {}
            while not stop.is_set():
                self._take_rejected()
                now = time.monotonic()
                due = [t for t in self._backoff if t.not_before <= now]
                if due:
                    self._backoff = [t for t in self._backoff if t.not_before > now]
                    queue[:0] = due
                exhausted = False
                while len(running) < self.cfg.concurrency:
                    room = len(running) + len(self._backoff) < self.cfg.concurrency  # waiting episodes count
                    if not queue and room and (max_prompts is None or taken < max_prompts) and self._may_take():
                        if self._refill(queue):
                            taken += 1
                            if self.gate is not None:
                                self.gate.taken += 1
                        else:
                            exhausted = True
                    if not queue:
                        break
                    if not self._admitted(queue[0], self.cfg.concurrency - len(running) - len(self._backoff)):
                        break  # the learner grants more as it trains (bus/admission.py)
                    task = queue.pop(0)
                    running[pool.submit(self._episode, task)] = task
                waiting = self.gate is not None and not exhausted and (max_prompts is None or taken < max_prompts)
                if not running and not self._backoff and not waiting and not queue:
                    break
                wake = min((t.not_before for t in self._backoff), default=now + 1.0)
                if (waiting and not running) or queue:
                    wake = min(wake, now + self.cfg.gate_poll_s)
                timeout = min(max(wake - time.monotonic(), 0.0), 1.0)
                if running:
                    done, _ = cf.wait(running, timeout=timeout, return_when=cf.FIRST_COMPLETED)
                    for fut in done:
                        self._collect(fut, running.pop(fut))
                else:
                    stop.wait(timeout)
                if time.monotonic() >= next_log:
                    self.log_status()
                    next_log = time.monotonic() + self.cfg.log_interval_s
            for fut in cf.as_completed(running):  # stop requested: finish what is in flight
                self._collect(fut, running[fut])
        for floor in self._granted:  # granted starts no episode took: the learner may grant them to others
            self.sink.end_start(floor)  # type: ignore[attr-defined]
        self._granted = []
        self._health_pool = None
        self.log_status()
        return self.status()

    def _take_rejected(self) -> None:
        """Record what the bus refused or lost after send() returned; re-open the prompts of lost trajectories."""
        rejected = getattr(self.sink, "rejected", None)
        if rejected is None:
            return
        for tid, reason, detail in rejected():
            if tid in self._rejected_seen:
                continue
            self._rejected_seen.add(tid)
            key = self._prompt_of(tid) if reason == "spool_corrupt" else None
            self._ledger({"event": "rejected", "id": tid, "reason": reason, "detail": detail[:300],
                          "worker": self.cfg.worker_id, "reopened": key})  # fmt: skip
            if key is not None:
                log.warning("trajectory %s of prompt %s was lost (%s): generating the prompt again", tid, key, detail)
                with self._lock:  # its samples may be pushed again: the lost one never reached the learner
                    self._sent = {ident for ident in self._sent if ident[0] != key}
                self.cursor.reopen(key)
                self.save_state()
            if reason == "spool_corrupt" and hasattr(self.sink, "acknowledge_lost"):
                self.sink.acknowledge_lost(tid)  # recorded (and re-opened): later starts need not report it again

    def _prompt_of(self, trajectory_id: str) -> str | None:
        """The prompt key a trajectory was generated from, from this worker's ledger (it may predate this process)."""
        if not self.cfg.ledger_path or not Path(self.cfg.ledger_path).is_file():
            return None
        with self._ledger_lock, open(self.cfg.ledger_path) as f:
            for line in f:
                if trajectory_id in line:
                    with contextlib.suppress(ValueError):
                        x = json.loads(line)
                        if x.get("event") == "sending" and x.get("id") == trajectory_id:
                            return str(x["prompt"])
        return None

    def _admitted(self, task: _Task, free: int) -> bool:
        """Rollout admission: whether `task` may start now, holding a start the learner granted (a re-issued task
        keeps its own). Without admission (group arms, a sink that does not ask, a receiver that does not grant)
        every task may."""
        if task.floor is not None or self.gate is not None:
            return True
        admitting = getattr(self.sink, "admitting", False)
        if admitting is False:
            return True
        if admitting is None:  # no learner answered yet: nothing started now could be sent either
            return False
        if not self._granted:
            if self.router is None:
                raise ValueError("rollout admission needs the engine router to read the engines' weight version")
            now = time.monotonic()
            if self._denied and now - self._floor_asked >= FLOOR_REFRESH_S:
                # the versions engines reported with their last tokens go stale while nothing runs: the room the
                # learner grants may wait on the engines' new version
                self._floor_asked = now
                self.router.current_version()
            floor = self.router.version_floor()
            if floor is None:
                return False  # no engine answers: the episode could not run anyway
            self._granted += [floor] * self.sink.take_starts(max(free, 1), floor)  # type: ignore[attr-defined]
            self._denied = not self._granted
            if self._denied:
                return False
        task.floor = self._granted.pop()
        return True

    def _end_start(self, task: _Task) -> None:
        """The episode of an admitted `task` is over (its trajectory was handed to the sink, or it was given up)."""
        if task.floor is not None and hasattr(self.sink, "end_start"):
            self.sink.end_start(task.floor)

    def _may_take(self) -> bool:
        """Streaming: always. Group arms: while the current batch has room, else once the next one may open."""
        if self.gate is None:
            return True
        return (self.gate.index >= 0 and not self.gate.full) or self.gate.try_open()

    def _refill(self, queue: list[_Task]) -> bool:
        item = self.cursor.take()
        if item is None:
            return False
        key, record = item
        self._remaining[key] = self.cfg.rollouts_per_prompt
        queue.extend(_Task(key, record, i) for i in range(self.cfg.rollouts_per_prompt))
        return True

    def _episode(self, task: _Task) -> Trajectory:
        return self.loop.run(task.record, worker_id=self.cfg.worker_id, sample_index=task.sample_index)

    def _collect(self, fut: cf.Future[Trajectory], task: _Task) -> None:
        try:
            traj = fut.result()
        except RETRYABLE as e:
            self._retry(task, e)
            return
        except Exception as e:  # this sample only: a bad prompt, an environment / agent-loop bug, a refused request
            log.error(
                "prompt %s (%s) sample %d failed, not retried: %r",
                task.record.get("id"),
                task.key,
                task.sample_index,
                e,
                exc_info=e,
            )
            self._sample_failed(task.key, task.sample_index)
            self._end_start(task)
            return
        if self.gate is not None:  # group arms: a group goes out whole, in sample order, or not at all
            self._groups.setdefault(task.key, {})[task.sample_index] = traj
            self._sample_finished(task.key)
            return
        self._send(task.key, task.sample_index, traj)
        self._end_start(task)
        self._sample_finished(task.key)

    def _send(self, key: str, sample_index: int, traj: Trajectory) -> None:
        ident = (key, sample_index)
        with self._lock:
            assert ident not in self._sent, f"{ident} would be pushed twice"
            self._sent.add(ident)
        h = traj.header
        self._ledger({"event": "sending", "id": h.trajectory_id, "prompt": key, "worker": h.worker_id})
        if hasattr(self.sink, "volatile_ids"):
            with self._lock:
                self._sent_keys[h.trajectory_id] = key
        try:
            self.sink.send(traj)
        except Undelivered:
            self._undelivered.add(key)
            self._ledger({"event": "undelivered", "id": h.trajectory_id, "prompt": key, "sample": sample_index,
                          "worker": h.worker_id})  # fmt: skip
            return
        self.metrics.count(traj)
        acted = traj.weight_versions[traj.action_mask]
        self._ledger({"event": "produced", "id": h.trajectory_id, "prompt": key, "prompt_id": h.prompt_id,
                      "sample": sample_index, "worker": h.worker_id, "reward": h.reward, "metadata": h.metadata,
                      "versions": [int(acted.min()), int(acted.max())] if acted.size else None})  # fmt: skip

    def _ledger(self, line: dict[str, Any]) -> None:
        """A whole line before the event it records happens (a full disk raises DiskFull: the event does not)."""
        if self.cfg.ledger_path:
            with self._ledger_lock:
                if self._ledger_file is None:
                    self._ledger_file = JsonlAppender(self.cfg.ledger_path, "launch.run_dir")
                self._ledger_file.write({**line, "time": time.time()})

    def _sample_failed(self, key: str, sample_index: int) -> None:
        self._ledger({"event": "failed", "prompt": key, "sample": sample_index, "worker": self.cfg.worker_id})
        self.metrics.failed += 1
        self._failed_samples[key] = self._failed_samples.get(key, 0) + 1
        self._sample_finished(key)

    def _retry(self, task: _Task, error: BaseException) -> None:
        """Re-issue `task` once its back-off has passed (the run loop starts it; nothing sleeps here). With no healthy
        engine at all the episode waits for one (an engine restarting) without using up its attempts: a restart must
        not burn through prompts."""
        pid = task.record.get("id")
        if isinstance(error, NoHealthyEngine):
            self._probe_engines()
            now = time.monotonic()
            if now >= self._next_wait_log:
                log.warning("no healthy engine (%s): %d episodes wait for one", error, len(self._backoff) + 1)
                self._next_wait_log = now + 30.0
            self.metrics.reissued += 1
            task.not_before = now + min(self.cfg.retry_backoff_s, 5.0)
            self._backoff.append(task)
            return
        if task.attempt >= self.cfg.max_attempts:
            log.error(
                "prompt %s (%s) sample %d failed %d times, giving up: %r",
                *(pid, task.key, task.sample_index, task.attempt, error),
            )
            self._sample_failed(task.key, task.sample_index)
            self._end_start(task)
            return
        log.warning(
            "re-issuing prompt %s (%s) sample %d (attempt %d): %r",
            *(pid, task.key, task.sample_index, task.attempt, error),
        )
        self.metrics.reissued += 1
        self._probe_engines()
        again = _Task(task.key, task.record, task.sample_index, task.attempt + 1, floor=task.floor)
        again.not_before = time.monotonic() + self.cfg.retry_backoff_s * task.attempt
        self._backoff.append(again)

    def _probe_engines(self) -> None:
        """Probe the engines (takes back those up again) on the health thread, one probe at a time."""
        if self.router is None or self._health_pool is None or (self._probe is not None and not self._probe.done()):
            return
        with contextlib.suppress(RuntimeError):  # the run is ending (pool shut down)
            self._probe = self._health_pool.submit(self.router.check_health)

    def _sample_finished(self, key: str) -> None:
        self._remaining[key] -= 1
        if self._remaining[key] == 0:
            del self._remaining[key]
            if self.gate is not None:
                self._group_done(key)
            self._failed_samples.pop(key, None)
            if key in self._undelivered:  # not done: the next run takes this prompt again
                self._undelivered.discard(key)
                return
            self.cursor.complete(key)
            self._ledger({"event": "prompt_done", "prompt": key, "worker": self.cfg.worker_id})
            self.metrics.prompts_done += 1
            self.save_state()

    def _group_done(self, key: str) -> None:
        """Every sample of a group arm's prompt finished: send the group whole, or drop it (a sample failed) and give
        its place in the batch to another prompt."""
        assert self.gate is not None
        group = self._groups.pop(key, {})
        if self._failed_samples.get(key) or len(group) != self.cfg.rollouts_per_prompt:
            log.error("group of prompt %s dropped: %d of its %d samples failed; another prompt takes its place",
                      key, self._failed_samples.get(key, 0), self.cfg.rollouts_per_prompt)  # fmt: skip
            self.metrics.dropped_groups += 1
            self._ledger({"event": "dropped_group", "prompt": key, "worker": self.cfg.worker_id,
                          "samples": sorted(group)})  # fmt: skip
            self.gate.taken -= 1
            return
        for index in sorted(group):
            self._send(key, index, group[index])
        self.gate.sent += 1

    def save_state(self) -> None:
        """Save the cursor; prompts whose trajectories the sink could still lose are saved as pending."""
        if not self.cfg.state_path:
            return
        volatile_ids = getattr(self.sink, "volatile_ids", None)
        not_durable: set[str] = set()
        if volatile_ids is not None:
            volatile = volatile_ids()
            with self._lock:
                self._sent_keys = {t: k for t, k in self._sent_keys.items() if t in volatile}
                not_durable = set(self._sent_keys.values())
        Path(self.cfg.state_path).parent.mkdir(parents=True, exist_ok=True)
        self.cursor.save(self.cfg.state_path, not_durable)

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = self.metrics.snapshot()
        if self.router is not None:
            out["engines"] = self.router.stats()
        return out

    def log_status(self) -> None:
        s = self.status()
        engines = s.get("engines", {})
        health = ", ".join(
            f"{u} {'up' if e['healthy'] else 'DOWN'} ({e['outstanding']} out)" for u, e in engines.items()
        )
        log.info(
            "[%s] %d trajectories (%.2f/s, %.1f action tok/s), mean reward %.3f, re-issued %d, failed %d; engines: %s",
            self.cfg.worker_id,
            s["trajectories"],
            s["trajectories_per_s"],
            s["action_tokens_per_s"],
            s["mean_reward"],
            s["reissued"],
            s["failed"],
            health or "n/a",
        )
        self.save_state()
        if self.cfg.metrics_path:
            record = {"time": time.time(), "worker": self.cfg.worker_id,
                      **{f"rollout/{k}": v for k, v in s.items() if k != "engines"}}  # fmt: skip
            for url, e in engines.items():
                record.update({f"engine/{url}/{k}": e[k] for k in ("requests", "failures", "tokens", "outstanding")})
            unlisted = set(unlisted_keys(record, "rollout")) - self._unlisted_warned
            if unlisted:  # a key docs/run.md does not explain: written, and named once
                self._unlisted_warned |= unlisted
                log.warning("[%s] metrics keys missing from files/metrics_schema.py: %s", self.cfg.worker_id,
                            sorted(unlisted))  # fmt: skip
            if self._metrics_file is None:
                self._metrics_file = JsonlAppender(self.cfg.metrics_path, "launch.run_dir")
            self._metrics_file.write(record)


def worker_from_config(
    cfg: SAOConfig,
    sink: TrajectorySink,
    engine_urls: list[str],
    worker_id: str = "rollout-0",
    shard: tuple[int, int] = (0, 1),
) -> RolloutWorker:
    """A worker wired from the config tree: env + prompts (rollout.env; `shard` (i, n): every n-th prompt from the
    i-th, so n workers never share a prompt), tokenizer (model.hf_path), router over
    `engine_urls`, sampling / limits (rollout.*), G per prompt (algo.rollouts_per_prompt), cursor state file
    (rollout.cursor_state, else <run_dir>/rollout_cursor.json for rollout-0 and rollout_cursor_<id>.json for others)."""
    from transformers import AutoTokenizer

    from megatron_sao.engines.client import RetryPolicy, SGLangClient
    from megatron_sao.rollout.agent_loop import AgentLoopConfig, ChatTemplateCodec
    from megatron_sao.rollout.envs import make_env
    from megatron_sao.rollout.prompts import training_prompts

    r = cfg.rollout
    if cfg.model.hf_path is None:
        raise ValueError("model.hf_path is not set: the rollout worker needs the model's tokenizer and chat template")
    env = make_env(r.env.name, r.env.options)
    records = training_prompts(env, r.env.prompts)
    index, count = shard
    if not 0 <= index < count:
        raise ValueError(f"prompt shard {index}/{count}: the index must be in 0..{count - 1}")
    records = records[index::count]
    if not records:
        raise ValueError(f"prompt shard {index}/{count} is empty: {count} workers for fewer prompts; run fewer workers")
    clients = [SGLangClient(u, timeout_s=r.request_timeout_s, retry=RetryPolicy(r.max_retries)) for u in engine_urls]
    gateway = None if r.router_url is None else SGLangClient(r.router_url, timeout_s=r.request_timeout_s,
                                                             retry=RetryPolicy(r.max_retries))  # fmt: skip
    router = EngineRouter(clients, gateway)
    routes = None
    if r.return_routed_experts:
        from megatron_sao.bus.schema import Routes

        routes = Routes.of_model(cfg.model.hf_config_dict() or {}, cfg.model.resolved_num_experts() or 0)
        for client in clients:  # refuse, naming the fix, an engine that cannot return them
            client.check_routes(multi_turn=r.max_turns > 1)
    sampling = {"temperature": r.sampling.temperature, "top_p": r.sampling.top_p, "top_k": r.sampling.top_k,
                "max_new_tokens": r.sampling.max_new_tokens}  # fmt: skip
    loop = AgentLoop(
        env,
        ChatTemplateCodec(AutoTokenizer.from_pretrained(cfg.model.hf_path)),
        router.generate,
        AgentLoopConfig(max_turns=r.max_turns, max_total_tokens=r.max_total_tokens, sampling=sampling, routes=routes),
    )
    cursor_file = "rollout_cursor.json" if worker_id == "rollout-0" else f"rollout_cursor_{worker_id}.json"
    wcfg = WorkerConfig(
        worker_id=worker_id,
        concurrency=r.concurrency,
        rollouts_per_prompt=cfg.algo.rollouts_per_prompt,
        batch_prompts=cfg.learner.trajectories_per_step // cfg.algo.rollouts_per_prompt if cfg.algo.grouped else None,
        batch_lag=cfg.algo.batch_lag or 0,
        max_attempts=r.max_episode_attempts,
        retry_backoff_s=r.episode_retry_backoff_s,
        gate_poll_s=r.batch_gate_poll_s,
        log_interval_s=r.log_interval_s,
        state_path=r.cursor_state or str(Path(cfg.launch.run_dir) / cursor_file),
        metrics_path=str(Path(cfg.launch.run_dir) / rollout_metrics_file(worker_id)),
        ledger_path=str(Path(cfg.launch.run_dir) / "ledger" / f"{worker_id}.jsonl"),
    )
    return RolloutWorker(PromptCursor(records, epochs=None), loop, sink, wcfg, router)

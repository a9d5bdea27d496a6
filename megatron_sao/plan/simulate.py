"""A discrete-event simulation of the RL pipeline: engines with continuous batching, multi-turn episodes with tool
calls, a learner whose steps cost what their tokens cost, weight pushes that pause the engines -- run as
synchronous GRPO, one-step-off GRPO or SAO streaming. Answers what a cluster run would look like before it is
booked: busy fraction of each role, trajectories per hour, staleness. tools/simulate.py calibrates it on the CPU
pipeline-efficiency measurements and projects the examples (docs/scaling.md).

Engines are fluid processor-sharing servers: B active requests each advance one token per decode iteration of
tau(B) = tau0 + tau1 * B seconds (weights read once per iteration, each sequence's KV and compute on top); a turn's
prompt/observation tokens cost `prefill_per_token` iterations each. Nothing runs while a push pauses an engine."""

from __future__ import annotations

import heapq
import itertools
import math
import random
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

Arm = Literal["sao", "grpo", "grpo_async"]
ARMS: tuple[Arm, ...] = ("sao", "grpo", "grpo_async")


@dataclass(frozen=True)
class Turn:
    prefill_tokens: int
    """Tokens the engine reads before generating (the prompt, or the last tool observation)."""
    gen_tokens: int
    tool_s: float
    """The tool call after this turn (0 for the last)."""


@dataclass(frozen=True)
class Episode:
    turns: tuple[Turn, ...]

    @property
    def tokens(self) -> int:
        return sum(t.prefill_tokens + t.gen_tokens for t in self.turns)

    @property
    def gen_tokens(self) -> int:
        return sum(t.gen_tokens for t in self.turns)


@dataclass(frozen=True)
class EpisodeSource:
    """Episodes drawn from recorded ones (the learner's trajectories.jsonl records: turns, tokens, action tokens,
    tool seconds), optionally scaled: more tokens per turn, slower tools, a longer tail of turns."""

    records: tuple[dict[str, Any], ...]
    gen_scale: float = 1.0
    prefill_scale: float = 1.0
    tool_scale: float = 1.0
    tail_scale: float = 1.0
    """Episodes with more turns than the median get (turns - median) * tail_scale extra turns of the same kind."""

    @cached_property
    def prompts(self) -> list[list[dict[str, Any]]]:
        """The records grouped by prompt."""
        by: dict[str, list[dict[str, Any]]] = {}
        for r in self.records:
            by.setdefault(str(r.get("prompt_id", id(r))), []).append(r)
        return list(by.values())

    @cached_property
    def median_turns(self) -> float:
        return statistics.median(int(x["turns"]) for x in self.records)

    def sample(self, rng: random.Random, group: int = 1) -> list[Episode]:
        """`group` episodes of one prompt (a prompt's samples share its task, e.g. the length of its key chain)."""
        chosen = rng.choice(self.prompts)
        return [self._episode(rng.choice(chosen), self.median_turns) for _ in range(group)]

    def _episode(self, r: dict[str, Any], median: float) -> Episode:
        turns = max(1, int(r["turns"]))
        if self.tail_scale != 1.0 and turns > median:
            turns = max(1, round(median + (turns - median) * self.tail_scale))
        base = max(1, int(r["turns"]))
        gen = max(1, round(r["action_tokens"] / base * self.gen_scale))
        prefill = max(1, round((r["tokens"] - r["action_tokens"]) / base * self.prefill_scale))
        tools = max(base - 1, 1)
        tool = r.get("tool_s", 0.0) / tools * self.tool_scale
        return Episode(tuple(Turn(prefill, gen, tool if i < turns - 1 else 0.0) for i in range(turns)))


@dataclass(frozen=True)
class EngineModel:
    tau0: float
    """Seconds of one decode iteration that do not depend on the batch (reading the weights)."""
    tau1: float
    """Seconds per active sequence and iteration (its KV cache, its share of compute)."""
    prefill_per_token: float = 0.0
    """Decode iterations one prefilled token costs its request."""
    turn_overhead_s: float = 0.0
    """Seconds a turn spends in the serving path without engine compute (HTTP, scheduling, detokenizing)."""

    def iteration_s(self, batch: int) -> float:
        return self.tau0 + self.tau1 * batch


@dataclass(frozen=True)
class LearnerModel:
    step_s: Callable[[Arm, int, int], float]
    """(arm, trajectories, tokens) -> seconds of one learner step (sao: the critic's K updates included)."""
    push_s: float
    """Learner seconds per weight push."""
    engine_pause_s: float | None = None
    """Seconds each push stops the engines (None: the whole push)."""
    push_every: int = 1
    """Steps between pushes (weight_sync.interval; sao only: the grpo arms wait for each step's weights)."""


@dataclass(frozen=True)
class Scenario:
    arm: Arm
    engines: int
    concurrency: int
    """Episodes in flight (sao); the grpo arms launch a batch of `trajectories_per_step` at a time."""
    trajectories_per_step: int
    steps: int
    group: int = 1
    """grpo arms: samples per prompt (a batch is trajectories_per_step / group prompts)."""
    max_staleness: int = 4
    seed: int = 0


@dataclass
class Result:
    arm: Arm
    window_s: float
    trained: int
    dropped: int
    generated_tokens: int
    learner_busy_s: float
    engine_busy_s: float
    engines: int
    staleness: list[int] = field(default_factory=list)
    gen_s: list[float] = field(default_factory=list)
    """Seconds each trained episode spent in an engine (all its turns)."""

    @property
    def trajectories_per_s(self) -> float:
        return self.trained / self.window_s

    @property
    def learner_busy(self) -> float:
        return self.learner_busy_s / self.window_s

    @property
    def engine_busy(self) -> float:
        return self.engine_busy_s / (self.engines * self.window_s)

    def summary(self) -> dict[str, Any]:
        st = self.staleness or [0]
        return {"trajectories_per_s": self.trajectories_per_s, "trajectories_per_hour": self.trajectories_per_s * 3600,
                "learner_busy": self.learner_busy, "engine_busy": self.engine_busy, "window_s": self.window_s,
                "trained": self.trained, "dropped": self.dropped, "generated_tokens": self.generated_tokens,
                "staleness_mean": statistics.fmean(st), "staleness_max": max(st),
                "staleness_p90": sorted(st)[int(0.9 * (len(st) - 1))],
                "gen_s_mean": statistics.fmean(self.gen_s) if self.gen_s else 0.0,
                "staleness_histogram": {str(k): st.count(k) for k in range(max(st) + 1)}}  # fmt: skip


@dataclass
class _Request:
    episode: Episode
    engine: int
    version: int
    started: float
    turn: int = 0
    remaining: float = 0.0
    """Decode iterations left in this turn (its prefill first, then one per generated token)."""
    gen_tokens: int = 0
    gen_done: float = 0.0
    turn_started: float = 0.0
    gen_s: float = 0.0


class _Engine:
    def __init__(self, model: EngineModel) -> None:
        self.model = model
        self.active: list[_Request] = []
        self.last = 0.0
        self.paused_until = 0.0
        self.epoch = 0
        self.busy_s = 0.0
        self.assigned = 0

    def advance(self, now: float) -> float:
        """Progress every active request to `now` (nothing while paused); returns the generated tokens made."""
        dt = max(0.0, now - max(self.last, self.paused_until))
        self.last = max(self.last, now)
        if not self.active or dt <= 0:
            return 0.0
        self.busy_s += dt
        step = dt / self.model.iteration_s(len(self.active))
        made = 0.0
        for r in self.active:
            r.remaining = max(0.0, r.remaining - step)
            done = min(r.gen_tokens, max(0.0, r.gen_tokens - r.remaining))  # prefill comes first
            made += done - r.gen_done
            r.gen_done = done
        return made

    def next_finish(self, now: float) -> float | None:
        if not self.active:
            return None
        start = max(now, self.paused_until)
        return start + min(r.remaining for r in self.active) * self.model.iteration_s(len(self.active))


def simulate(sc: Scenario, engine: EngineModel, learner: LearnerModel, source: EpisodeSource) -> Result:
    """Run `sc.steps` learner steps of `sc.arm`; every time is simulated seconds from the first episode's start."""
    rng = random.Random(sc.seed)
    engines = [_Engine(engine) for _ in range(sc.engines)]
    events: list[tuple[float, int, str, Any]] = []
    seq = itertools.count()
    now = 0.0
    version = 0  # the learner's policy version (steps taken)
    engine_version = 0  # what the engines serve
    result = Result(sc.arm, 0.0, 0, 0, 0, 0.0, 0.0, sc.engines)
    finished: deque[_Request] = deque()
    learner_free = True
    generated = 0.0
    steps_done = 0
    batch_outstanding = 0  # grpo arms: episodes of the batch being generated
    batches_ready: deque[list[_Request]] = deque()
    batch_buffer: list[_Request] = []
    batches_launched = 0
    stopping = False

    def push(kind: str, at: float, payload: Any = None) -> None:
        heapq.heappush(events, (at, next(seq), kind, payload))

    def schedule(e: int) -> None:
        eng = engines[e]
        eng.epoch += 1
        t = eng.next_finish(now)
        if t is not None:
            push("engine", t, (e, eng.epoch))

    def submit_turn(r: _Request) -> None:
        r.turn_started = now
        if engine.turn_overhead_s > 0:
            push("admit", now + engine.turn_overhead_s, r)
        else:
            begin_turn(r)

    def begin_turn(r: _Request) -> None:
        nonlocal generated
        t = r.episode.turns[r.turn]
        eng = engines[r.engine]
        generated += eng.advance(now)
        r.gen_tokens, r.gen_done = t.gen_tokens, 0.0
        r.remaining = t.gen_tokens + t.prefill_tokens * engine.prefill_per_token
        eng.active.append(r)
        schedule(r.engine)

    def start_episode(episode: Episode) -> None:
        e = min(range(sc.engines), key=lambda i: (engines[i].assigned, i))
        engines[e].assigned += 1
        submit_turn(_Request(episode, e, engine_version, now))

    def launch_batch() -> None:
        nonlocal batch_outstanding, batches_launched
        batches_launched += 1
        batch_outstanding = sc.trajectories_per_step // sc.group * sc.group
        for _ in range(sc.trajectories_per_step // sc.group):
            for episode in source.sample(rng, sc.group):
                start_episode(episode)

    def try_train() -> None:
        nonlocal learner_free
        if not learner_free or stopping:
            return
        if sc.arm == "sao":
            fresh = [r for r in finished if version - r.version <= sc.max_staleness]
            result.dropped += len(finished) - len(fresh)
            finished.clear()
            finished.extend(fresh)
            if len(finished) < sc.trajectories_per_step:
                return
            batch = [finished.popleft() for _ in range(sc.trajectories_per_step)]
        else:
            if not batches_ready:
                return
            batch = batches_ready.popleft()
        learner_free = False
        result.staleness += [version - r.version for r in batch]
        result.gen_s += [r.gen_s for r in batch]
        took = learner.step_s(sc.arm, len(batch), sum(r.episode.tokens for r in batch))
        result.learner_busy_s += took
        push("trained", now + took, batch)

    def episode_done(r: _Request) -> None:
        nonlocal batch_outstanding
        engines[r.engine].assigned -= 1
        if sc.arm == "sao":
            finished.append(r)
            if not stopping:
                start_episode(source.sample(rng)[0])
            try_train()
            return
        batch_buffer.append(r)
        batch_outstanding -= 1
        if batch_outstanding == 0:
            batches_ready.append(list(batch_buffer))
            batch_buffer.clear()
            maybe_launch()
            try_train()

    def maybe_launch() -> None:
        """grpo: the next batch after the last one is trained and pushed; grpo_async: as soon as the previous batch
        is generated, with weights at most one step behind it."""
        if stopping or batch_outstanding or batches_launched >= sc.steps:
            return
        if sc.arm == "grpo" and engine_version < batches_launched:
            return
        if sc.arm == "grpo_async" and engine_version < batches_launched - 1:
            return
        launch_batch()

    if sc.arm == "sao":
        for _ in range(sc.concurrency):
            start_episode(source.sample(rng)[0])
    else:
        launch_batch()
    end = 0.0
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "engine":
            e, epoch = payload
            eng = engines[e]
            if epoch != eng.epoch:
                continue
            generated += eng.advance(now)
            done = [r for r in eng.active if r.remaining <= 1e-9]
            eng.active = [r for r in eng.active if r.remaining > 1e-9]
            for r in done:
                r.gen_s += now - r.turn_started
                tool = r.episode.turns[r.turn].tool_s
                r.turn += 1
                if r.turn < len(r.episode.turns):
                    push("tool", now + tool, r)
                else:
                    episode_done(r)
            schedule(e)
        elif kind == "tool":
            submit_turn(payload)
        elif kind == "admit":
            begin_turn(payload)
        elif kind == "trained":
            version += 1
            steps_done += 1
            result.trained += len(payload)
            end = now
            if steps_done >= sc.steps:
                stopping = True
                break
            if sc.arm == "sao" and steps_done % learner.push_every:  # the grpo arms push every step
                learner_free = True
                try_train()
                continue
            result.learner_busy_s += learner.push_s
            pause = learner.push_s if learner.engine_pause_s is None else learner.engine_pause_s
            for i, eng in enumerate(engines):
                generated += eng.advance(now)
                eng.paused_until = now + pause
                schedule(i)
            push("pushed", now + learner.push_s)
        elif kind == "pushed":
            engine_version = version
            learner_free = True
            if sc.arm != "sao":
                maybe_launch()
            try_train()
    for eng in engines:
        generated += eng.advance(end) if eng.last < end else 0.0
    result.window_s = end
    result.engine_busy_s = sum(min(e.busy_s, end) for e in engines)
    result.generated_tokens = int(generated)
    return result


def fit_engine(measure: Callable[[EngineModel], float], tau0_grid: Sequence[float], tau1_grid: Sequence[float],
               prefill_grid: Sequence[float] = (0.0,),
               overhead_grid: Sequence[float] = (0.0,)) -> tuple[EngineModel, float]:  # fmt: skip
    """The grid point with the smallest `measure` (an error to minimize)."""
    best: tuple[float, EngineModel] | None = None
    for t0, t1, pf, oh in itertools.product(tau0_grid, tau1_grid, prefill_grid, overhead_grid):
        model = EngineModel(t0, t1, pf, oh)
        err = measure(model)
        if best is None or err < best[0]:
            best = (err, model)
    assert best is not None
    return best[1], best[0]


def log_grid(lo: float, hi: float, n: int) -> list[float]:
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)] if n > 1 else [lo]


def relative_error(simulated: float, measured: float) -> float:
    return abs(simulated - measured) / measured if measured else math.inf

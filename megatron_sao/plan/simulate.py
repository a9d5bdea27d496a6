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
    ahead_step_s: Callable[[Arm, int, int], float] | None = None
    """sao with the critic on its own ranks: seconds of a step whose batch the value job took ahead (run/learn.py
    `Steps`: the next batch was already waiting when the last step's advantages came in, so the value job went from
    batch to batch). None: every step costs `step_s`."""


@dataclass(frozen=True)
class Scenario:
    arm: Arm
    engines: int
    concurrency: int
    """Episodes in flight (sao); the grpo arms launch a batch of `trajectories_per_step` at a time."""
    trajectories_per_step: int
    steps: int
    max_staleness: int
    """bus.max_staleness of the run modelled: a trajectory more versions old when its step takes it is dropped."""
    group: int = 1
    """grpo arms: samples per prompt (a batch is trajectories_per_step / group prompts)."""
    seed: int = 0
    admission: bool = False
    """sao: bus.admission, rollout admission (bus/admission.py): an episode starts only while the rule grants it, so
    none is generated to be dropped as stale; False: episodes start freely and the stale are dropped at the take."""


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
    ahead_steps: int = 0
    """Steps whose batch the value job took ahead (`LearnerModel.ahead_step_s`)."""

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
                "gen_s_mean": statistics.fmean(self.gen_s) if self.gen_s else 0.0, "ahead_steps": self.ahead_steps,
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
    return _Simulation(sc, engine, learner, source).run()


class _Simulation:
    """One run of `simulate`: the event queue and the pipeline's state, one method per event and decision."""

    def __init__(self, sc: Scenario, engine: EngineModel, learner: LearnerModel, source: EpisodeSource) -> None:
        self.sc, self.model, self.learner, self.source = sc, engine, learner, source
        self.rng = random.Random(sc.seed)
        self.engines = [_Engine(engine) for _ in range(sc.engines)]
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.version = 0  # the learner's policy version (steps taken)
        self.engine_version = 0  # what the engines serve
        self.result = Result(sc.arm, 0.0, 0, 0, 0, 0.0, 0.0, sc.engines)
        self.finished: deque[_Request] = deque()
        self.learner_free = True
        self.handed_ahead = False  # the next step's batch goes to the value job ahead (LearnerModel.ahead_step_s)
        self.generated = 0.0
        self.steps_done = 0
        self.batch_outstanding = 0  # grpo arms: episodes of the batch being generated
        self.batches_ready: deque[list[_Request]] = deque()
        self.batch_buffer: list[_Request] = []
        self.batches_launched = 0
        self.stopping = False
        self.end = 0.0
        self.open: list[int] = []  # sao: the start version of each episode started and not yet taken by a step
        self.wanting = 0  # sao with admission: starts the rollout wants (a free slot) that the rule has not granted
        self.taken_at_version = 0  # trajectories a step took at the current version (admission's c)

    def run(self) -> Result:
        if self.sc.arm == "sao":
            self.want_starts(self.sc.concurrency)
        else:
            self.launch_batch()
        handlers = {"engine": self.on_engine, "tool": self.submit_turn, "admit": self.begin_turn,
                    "trained": self.on_trained, "pushed": self.on_pushed}  # fmt: skip
        while self.events and not self.stopping:
            self.now, _, kind, payload = heapq.heappop(self.events)
            handlers[kind](payload)
        return self.close()

    def close(self) -> Result:
        for eng in self.engines:
            self.generated += eng.advance(self.end) if eng.last < self.end else 0.0
        self.result.window_s = self.end
        self.result.engine_busy_s = sum(min(e.busy_s, self.end) for e in self.engines)
        self.result.generated_tokens = int(self.generated)
        return self.result

    # the event queue

    def push(self, kind: str, at: float, payload: Any = None) -> None:
        heapq.heappush(self.events, (at, next(self.seq), kind, payload))

    def schedule(self, e: int) -> None:
        eng = self.engines[e]
        eng.epoch += 1
        t = eng.next_finish(self.now)
        if t is not None:
            self.push("engine", t, (e, eng.epoch))

    # episodes on the engines

    def submit_turn(self, r: _Request) -> None:
        r.turn_started = self.now
        if self.model.turn_overhead_s > 0:
            self.push("admit", self.now + self.model.turn_overhead_s, r)
        else:
            self.begin_turn(r)

    def begin_turn(self, r: _Request) -> None:
        t = r.episode.turns[r.turn]
        eng = self.engines[r.engine]
        self.generated += eng.advance(self.now)
        r.gen_tokens, r.gen_done = t.gen_tokens, 0.0
        r.remaining = t.gen_tokens + t.prefill_tokens * self.model.prefill_per_token
        eng.active.append(r)
        self.schedule(r.engine)

    def start_episode(self, episode: Episode) -> None:
        e = min(range(self.sc.engines), key=lambda i: (self.engines[i].assigned, i))
        self.engines[e].assigned += 1
        if self.sc.arm == "sao":
            self.open.append(self.engine_version)
        self.submit_turn(_Request(episode, e, self.engine_version, self.now))

    def want_starts(self, n: int = 0) -> None:
        """sao: `n` more slots want an episode; start every one the admission rule grants now (all without it)."""
        self.wanting += n
        while self.wanting and not self.stopping and self.admitted():
            self.wanting -= 1
            self.start_episode(self.source.sample(self.rng)[0])

    def admitted(self) -> bool:
        """bus/admission.py's rule for one more start: O + N (V - v_min) + min(c, N) < (B + 1) N, with O the episodes
        started and not yet taken, V the version the next step trains at, v_min the lowest start version among them,
        the engines' version now and V, c what a step took at V."""
        sc = self.sc
        if not sc.admission:
            return True
        from megatron_sao.bus.admission import room

        v_min = min([*self.open, self.engine_version, self.version])
        return room(sc.max_staleness, sc.trajectories_per_step, len(self.open), self.version, v_min,
                    self.taken_at_version) > 0  # fmt: skip

    def on_engine(self, payload: tuple[int, int]) -> None:
        """An engine's next turn end: finished turns go to their tool call, finished episodes to the learner."""
        e, epoch = payload
        eng = self.engines[e]
        if epoch != eng.epoch:
            return
        self.generated += eng.advance(self.now)
        done = [r for r in eng.active if r.remaining <= 1e-9]
        eng.active = [r for r in eng.active if r.remaining > 1e-9]
        for r in done:
            r.gen_s += self.now - r.turn_started
            tool = r.episode.turns[r.turn].tool_s
            r.turn += 1
            if r.turn < len(r.episode.turns):
                self.push("tool", self.now + tool, r)
            else:
                self.episode_done(r)
        self.schedule(e)

    def episode_done(self, r: _Request) -> None:
        self.engines[r.engine].assigned -= 1
        if self.sc.arm == "sao":
            self.finished.append(r)
            self.want_starts(1)
            self.try_train()
            return
        self.batch_buffer.append(r)
        self.batch_outstanding -= 1
        if self.batch_outstanding == 0:
            self.batches_ready.append(list(self.batch_buffer))
            self.batch_buffer.clear()
            self.maybe_launch()
            self.try_train()

    # the group arms' batches

    def launch_batch(self) -> None:
        sc = self.sc
        self.batches_launched += 1
        self.batch_outstanding = sc.trajectories_per_step // sc.group * sc.group
        for _ in range(sc.trajectories_per_step // sc.group):
            for episode in self.source.sample(self.rng, sc.group):
                self.start_episode(episode)

    def maybe_launch(self) -> None:
        """grpo: the next batch after the last one is trained and pushed; grpo_async: as soon as the previous batch
        is generated, with weights at most one step behind it."""
        if self.stopping or self.batch_outstanding or self.batches_launched >= self.sc.steps:
            return
        if self.sc.arm == "grpo" and self.engine_version < self.batches_launched:
            return
        if self.sc.arm == "grpo_async" and self.engine_version < self.batches_launched - 1:
            return
        self.launch_batch()

    # the learner

    def try_train(self) -> None:
        """A step when the learner is free and its batch is there (sao: the first trajectories_per_step fresh enough;
        the older are dropped)."""
        if not self.learner_free or self.stopping:
            return
        if self.sc.arm == "sao":
            fresh = [r for r in self.finished if self.version - r.version <= self.sc.max_staleness]
            kept = {id(r) for r in fresh}
            for r in self.finished:
                if id(r) not in kept:
                    self.open.remove(r.version)
            self.result.dropped += len(self.finished) - len(fresh)
            self.finished.clear()
            self.finished.extend(fresh)
            if len(self.finished) < self.sc.trajectories_per_step:
                return
            batch = [self.finished.popleft() for _ in range(self.sc.trajectories_per_step)]
            for r in batch:
                self.open.remove(r.version)
            self.taken_at_version = len(batch)
        else:
            if not self.batches_ready:
                return
            batch = self.batches_ready.popleft()
        self.learner_free = False
        self.result.staleness += [self.version - r.version for r in batch]
        self.result.gen_s += [r.gen_s for r in batch]
        step_s = self.learner.step_s
        if self.handed_ahead and self.learner.ahead_step_s is not None:
            step_s = self.learner.ahead_step_s
            self.result.ahead_steps += 1
        # the run hands the next batch over once this step's advantages are in, when a whole one is waiting and
        # this is not the last step; judged here at the step's start, which counts a few steps fewer than a run
        self.handed_ahead = (self.sc.arm == "sao" and self.learner.ahead_step_s is not None
                             and len(self.finished) >= self.sc.trajectories_per_step
                             and self.steps_done + 1 < self.sc.steps)  # fmt: skip
        took = step_s(self.sc.arm, len(batch), sum(r.episode.tokens for r in batch))
        self.result.learner_busy_s += took
        self.push("trained", self.now + took, batch)

    def on_trained(self, batch: list[_Request]) -> None:
        """A step done: the run ends after sc.steps; otherwise the push (engines paused) when one is due."""
        self.version += 1
        self.taken_at_version = 0
        self.steps_done += 1
        self.result.trained += len(batch)
        self.end = self.now
        if self.steps_done >= self.sc.steps:
            self.stopping = True
            return
        if self.sc.arm == "sao" and self.steps_done % self.learner.push_every:  # the grpo arms push every step
            self.learner_free = True
            self.want_starts()
            self.try_train()
            return
        self.result.learner_busy_s += self.learner.push_s
        pause = self.learner.push_s if self.learner.engine_pause_s is None else self.learner.engine_pause_s
        for i, eng in enumerate(self.engines):
            self.generated += eng.advance(self.now)
            eng.paused_until = self.now + pause
            self.schedule(i)
        self.push("pushed", self.now + self.learner.push_s)

    def on_pushed(self, _: Any = None) -> None:
        self.engine_version = self.version
        self.learner_free = True
        if self.sc.arm != "sao":
            self.maybe_launch()
        else:
            self.want_starts()
        self.try_train()


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

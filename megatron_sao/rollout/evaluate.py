"""Held-out evaluation pinned to one weight version (owned by rollout/; run/learn.py schedules it during training,
run/evaluate.py runs it on a checkpoint).

An evaluation runs eval.samples_per_prompt episodes of every held-out prompt on the engines, with its own sampling,
at most max(1, eval.budget x rollout.concurrency) at a time, and is never trained on. It measures exactly one weight
version: every generated token of every sample must carry it. During training the learner holds its next push until
the evaluation is done, so that is the rule; a sample that still comes back from another version (an engine
restarted on its launch weights, or weights pushed from elsewhere) is discarded, and when the engines hold another
version, the evaluation starts over on it (at most eval.max_restarts times, counted): the record names the one
version it measured.

    pass@k (unbiased, Chen et al. 2021): 1 - C(n - c, k) / C(n, k) per prompt, averaged; n samples, c solved
    avg@k: the mean share of solved samples per prompt
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from megatron_sao.config.tree import SAOConfig
from megatron_sao.engines.client import EngineRouter
from megatron_sao.rollout.agent_loop import AgentLoop, AgentLoopConfig, TokenCodec
from megatron_sao.rollout.envs import Environment
from megatron_sao.rollout.prompts import read_jsonl, training_prompts

log = logging.getLogger(__name__)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt from n samples of which c solved it (k <= n)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _content(record: dict[str, Any]) -> str:
    """A prompt record without its id: what a prompt *is* (ids differ between splits by construction)."""
    return json.dumps({k: v for k, v in record.items() if k != "id"}, sort_keys=True)


def heldout_prompts(cfg: SAOConfig, env: Environment) -> list[dict[str, Any]]:
    """eval.num_prompts held-out prompts: eval.prompts' first ones, else the environment's held-out ones (eval.seed);
    ValueError when one is a training prompt (a given file) or none is left (made ones are dropped)."""
    ev = cfg.eval
    training = {_content(r) for r in training_prompts(env, cfg.rollout.env.prompts)}
    if ev.prompts:
        records = read_jsonl(ev.prompts)[: ev.num_prompts]
        shared = [str(r["id"]) for r in records if _content(r) in training]
        if shared:
            raise ValueError(f"eval.prompts={ev.prompts}: {len(shared)} of its prompts are training prompts (e.g. "
                             f"{shared[0]!r}); held-out prompts must be ones training never draws")  # fmt: skip
        return records
    made = env.make_heldout_prompts(ev.num_prompts * 4, ev.seed)
    records = [r for r in made if _content(r) not in training][: ev.num_prompts]
    if not records:
        raise ValueError(f"environment {env.name!r} made no prompt that training does not also draw (eval.seed="
                         f"{ev.seed}): give held-out prompts in eval.prompts")  # fmt: skip
    return records


@dataclass
class Evaluation:
    """What one evaluation measured (as_record() is its record in metrics.jsonl)."""

    version: int
    k: int
    rewards: dict[str, list[float]] = field(default_factory=dict)  # prompt id -> rewards of its samples
    solved: dict[str, list[bool]] = field(default_factory=dict)
    discarded: int = 0  # samples that came back from another version and were run again
    errors: int = 0  # samples that failed (the evaluation is given up at the first)
    restarts: int = 0
    given_up: bool = False
    seconds: float = 0.0

    def as_record(self) -> dict[str, float]:
        out = {"eval/weight_version": float(self.version), "eval/time": self.seconds,
               "eval/discarded": float(self.discarded), "eval/restarts": float(self.restarts),
               "eval/given_up": float(self.given_up), "eval/errors": float(self.errors)}  # fmt: skip
        full = [p for p, s in self.solved.items() if len(s) >= self.k]
        if not full or self.given_up:  # a partial evaluation measures nothing to draw beside the others
            return out
        rewards = [r for p in full for r in self.rewards[p]]
        out["eval/reward/mean"] = sum(rewards) / len(rewards)
        out["eval/success_rate"] = sum(sum(self.solved[p]) for p in full) / sum(len(self.solved[p]) for p in full)
        out["eval/prompts"] = float(len(full))
        out["eval/samples"] = float(len(rewards))
        for k in sorted({1, self.k}):
            per_prompt = [pass_at_k(len(self.solved[p]), sum(self.solved[p]), k) for p in full]
            out[f"eval/pass@{k}"] = sum(per_prompt) / len(per_prompt)
        out[f"eval/avg@{self.k}"] = sum(sum(self.solved[p]) / len(self.solved[p]) for p in full) / len(full)
        return out


class _OutOfTime(RuntimeError):
    """An evaluation turn not sent: the evaluation was cancelled or its time is up."""


class Evaluator:
    """Runs evaluations of the engines behind `router` on the held-out prompts; one at a time."""

    def __init__(self, cfg: SAOConfig, env: Environment, codec: TokenCodec, router: EngineRouter) -> None:
        ev, r = cfg.eval, cfg.rollout
        self.cfg, self.env, self.router = cfg, env, router
        self.prompts = heldout_prompts(cfg, env)
        sampling = {"temperature": ev.sampling.temperature, "top_p": ev.sampling.top_p, "top_k": ev.sampling.top_k,
                    "max_new_tokens": ev.sampling.max_new_tokens or r.sampling.max_new_tokens}  # fmt: skip
        self.loop = AgentLoop(env, codec, self._generate,
                              AgentLoopConfig(max_turns=r.max_turns, max_total_tokens=r.max_total_tokens,
                                              sampling=sampling))  # fmt: skip
        self.concurrency = max(1, int(ev.budget * r.concurrency))
        self.k = ev.samples_per_prompt
        self.cancel = threading.Event()  # set by cancel(): in-flight turns end at once, none starts
        self._deadline = math.inf

    def cancel_now(self) -> None:
        """Give up the evaluation in flight (its record says given_up): a stop, or a push that cannot wait longer."""
        self.cancel.set()

    def _generate(self, input_ids: list[int], sampling: dict[str, Any], **kwargs: Any) -> Any:
        """router.generate with what is left of the evaluation's time as the request's timeout (the engine aborts
        the request when it passes), and nothing sent once the evaluation is cancelled or out of time."""
        left = self._deadline - time.monotonic()
        if self.cancel.is_set() or left <= 0:
            raise _OutOfTime("evaluation cancelled or out of time")
        return self.router.generate(input_ids, sampling, timeout_s=max(left, 1.0), **kwargs)

    def _sample(self, prompt: dict[str, Any], index: int) -> tuple[float, bool, set[int]]:
        traj = self.loop.run(prompt, worker_id="eval", sample_index=index)
        versions = {int(v) for v, a in zip(traj.weight_versions, traj.action_mask) if a}
        success = traj.header.metadata.get("success")
        solved = bool(success) if success is not None else traj.header.reward >= self.cfg.eval.success_reward
        return float(traj.header.reward), solved, versions

    def run(self, version: int, deadline_s: float | None = None,
            progress: Callable[[int, int], None] | None = None) -> Evaluation:  # fmt: skip
        """Evaluate the engines, which hold `version`: every sample of every prompt, each from that version alone;
        `progress(done, total)` after each sample."""
        t0 = time.monotonic()
        deadline = t0 + (deadline_s if deadline_s is not None else self.cfg.eval.timeout_s)
        self._deadline = deadline
        self.cancel.clear()
        result = Evaluation(version, self.k)
        while True:
            held = self._attempt(result, deadline, progress)
            if held is None or result.given_up:
                break
            if result.restarts >= self.cfg.eval.max_restarts:
                result.given_up = True
                break
            log.warning("evaluation of version %d: the engines now hold version %d; starting over on it",
                        result.version, held)  # fmt: skip
            result = Evaluation(held, self.k, restarts=result.restarts + 1, discarded=result.discarded)
        result.seconds = time.monotonic() - t0
        return result

    def _attempt(self, result: Evaluation, deadline: float,
                 progress: Callable[[int, int], None] | None) -> int | None:  # fmt: skip
        """One pass over every (prompt, sample); None when done on result.version, else the version the engines
        moved to (a sample run again came back from it too)."""
        jobs = [(p, i) for p in self.prompts for i in range(self.k)]
        moved: list[int] = []
        lock, done = threading.Lock(), [0]

        def one(prompt: dict[str, Any], index: int) -> None:
            for attempt in range(2):  # a stray sample is run once more before the evaluation is said to have moved
                if moved or self.cancel.is_set() or time.monotonic() > deadline:
                    return
                try:
                    reward, solved, versions = self._sample(prompt, index)
                except _OutOfTime:
                    return
                except Exception as e:  # one bad sample (engine error, a prompt too long) fails the evaluation now
                    if self.cancel.is_set() or time.monotonic() > deadline:  # its request ran out of time
                        return
                    log.error("evaluation sample of prompt %s failed: %r", prompt.get("id"), e)
                    with lock:
                        result.errors += 1
                    self.cancel.set()
                    return
                if versions <= {result.version}:
                    with lock:
                        result.rewards.setdefault(str(prompt["id"]), []).append(reward)
                        result.solved.setdefault(str(prompt["id"]), []).append(solved)
                        done[0] += 1
                        if progress is not None:
                            progress(done[0], len(jobs))
                    return
                with lock:
                    result.discarded += 1
                if attempt == 1:
                    with lock:
                        moved.append(max(versions))

        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="eval") as pool:
            for f in [pool.submit(one, p, i) for p, i in jobs]:
                f.result()
        if moved and not self.cancel.is_set():
            return moved[0]
        if done[0] < len(jobs):
            result.given_up = True
            why = "a sample failed" if result.errors else "cancelled" if self.cancel.is_set() else "eval.timeout_s"
            log.warning("evaluation of version %d given up (%s) after %d of %d samples", result.version, why,
                        done[0], len(jobs))  # fmt: skip
        return None

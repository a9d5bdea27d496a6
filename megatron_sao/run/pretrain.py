"""Value pre-training: the critic learns the initial policy's returns before the first policy update (SAO, paper:
6k samples; run/learn.py drives it, on every learner rank alike).

Each step takes a new batch of rollouts of the frozen initial policy (`algo.value.pretrain_batch` of them; the
engines keep the launch weights, nothing is pushed) and runs critic-only learner steps (K value updates each, no
policy update) over a buffer of the newest `algo.value.pretrain_buffer_batches` batches, `pretrain_passes` times:
the new batch first and whole, so the step's metrics (loss/value_first, value/explained_variance) are the critic's
error on all the trajectories it has not trained on yet, then the rest in steps of learner.trajectories_per_step.
The phase ends when the critic is ready -- over the last `pretrain_plateau_steps` steps the mean explained variance
reached `pretrain_min_explained_variance` and the mean value loss improved by less than `pretrain_plateau_tol`
(relative) on the steps before -- or when `pretrain_samples` new trajectories were used. Its progress (trajectories
used, the losses and explained variances seen, the buffer, whether it ended and why) is saved with every
checkpoint, so a run stopped mid-phase resumes there.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import Any

from megatron_sao.bus.schema import Trajectory
from megatron_sao.config.algo import AlgoConfig
from megatron_sao.config.bus import BusConfig

LOSS = "loss/value_first"
"""The first value update's loss on the new batch: the critic's error on trajectories it has not trained on yet."""
EXPLAINED = "value/explained_variance"
"""Explained variance of the values GAE used on the new batch, before the critic trained on it (honest)."""


class ValuePretraining:
    def __init__(
        self, algo: AlgoConfig, state: dict[str, Any] | None, version: int, bus: BusConfig | None = None, seed: int = 0,
        step_trajectories: int = 1,
    ) -> None:  # fmt: skip
        v = algo.value
        self.batch = v.pretrain_batch or step_trajectories  # new trajectories per step
        self.budget, self.window, self.tol = v.pretrain_samples, v.pretrain_plateau_steps, v.pretrain_plateau_tol
        self.min_ev, self.passes, self.buffer_batches = (v.pretrain_min_explained_variance, v.pretrain_passes,
                                                         v.pretrain_buffer_batches)  # fmt: skip
        self.seed = seed
        state = state or {}
        self.samples = int(state.get("samples", 0))
        self.steps = int(state.get("steps", 0))
        self.losses: list[float] = [float(x) for x in state.get("losses", [])]
        self.evs: list[float] = [float(x) for x in state.get("evs", [])]
        self.buffer: list[list[Trajectory]] = _decode(state.get("buffer", []), bus)
        # a learner past version 0 has updated its policy: pre-training is over whatever the state says
        done = bool(state.get("done")) or version > 0 or not algo.uses_critic or self.budget == 0
        self.done, self.reason = done, str(state.get("reason", "not needed" if done else ""))
        if done:
            self.buffer = []

    @property
    def active(self) -> bool:
        return not self.done

    def batches(self, fresh: Sequence[Trajectory], n: int | None = None) -> list[list[Trajectory]]:
        """The critic steps of one pre-training step on the new batch `fresh`, in order: `fresh` whole first, then
        the older buffered batches, then the further passes over the whole buffer, reshuffled (the same on every
        rank: seeded by the step), in steps of `n` trajectories (default: as many as `fresh`). The buffer keeps
        `fresh` for later steps."""
        self.buffer = [*self.buffer, list(fresh)][-self.buffer_batches :]
        older = [t for b in self.buffer[:-1] for t in b]
        rng = random.Random(self.seed * 1_000_003 + self.steps)
        n = n or len(fresh)
        out = [list(fresh), *_chunks(rng.sample(older, len(older)), n)]
        everything = [t for b in self.buffer for t in b]
        for _ in range(self.passes - 1):
            out += _chunks(rng.sample(everything, len(everything)), n)
        return out

    def record(self, trajectories: int, metrics: dict[str, float]) -> None:
        """One pre-training step on `trajectories` new ones; ends the phase when the budget is used or the critic is
        ready."""
        self.samples += trajectories
        self.steps += 1
        if LOSS in metrics:
            self.losses.append(float(metrics[LOSS]))
        if EXPLAINED in metrics:
            self.evs.append(float(metrics[EXPLAINED]))
        if self.ready():
            ev = statistics.fmean(self.evs[-self.window :])
            self.done, self.reason = True, (f"critic ready after {self.steps} steps (explained variance {ev:.3f} >= "
                                            f"{self.min_ev}, value loss settled)")  # fmt: skip
        elif self.samples >= self.budget:
            self.done, self.reason = True, f"{self.samples} trajectories (budget {self.budget})"
        if self.done:
            self.buffer = []

    def ready(self) -> bool:
        """The last `window` steps explain enough of the returns and their loss stopped improving."""
        w = self.window
        if w == 0 or len(self.losses) < 2 * w or len(self.evs) < w:
            return False
        before, last = statistics.fmean(self.losses[-2 * w : -w]), statistics.fmean(self.losses[-w:])
        settled = before - last < self.tol * abs(before)
        return settled and statistics.fmean(self.evs[-w:]) >= self.min_ev

    def metrics(self) -> dict[str, float]:
        return {"pretrain/samples": float(self.samples), "pretrain/steps": float(self.steps),
                "pretrain/done": float(self.done)}  # fmt: skip

    def progress(self, metrics: dict[str, float]) -> str:
        parts = [f"value pre-training {self.samples}/{self.budget} traj"]
        for key, label in ((LOSS, "v_loss"), (EXPLAINED, "expl_var"), ("pretrain/critic_steps", "critic steps")):
            if key in metrics:
                parts.append(f"{label} {metrics[key]:.4g}")
        if self.done:
            parts.append(f"done: {self.reason}")
        return " | ".join(parts)

    def state_dict(self) -> dict[str, Any]:
        from megatron_sao.bus.codec import encode

        buffer = [[[bytes(f) for f in encode(t)] for t in b] for b in self.buffer]
        return {"samples": self.samples, "steps": self.steps, "losses": self.losses[-200:], "evs": self.evs[-200:],
                "done": self.done, "reason": self.reason, "buffer": buffer}  # fmt: skip


def _chunks(items: list[Trajectory], n: int) -> list[list[Trajectory]]:
    return [items[i : i + n] for i in range(0, len(items), max(n, 1))]


def _decode(buffer: list[list[list[bytes]]], bus: BusConfig | None) -> list[list[Trajectory]]:
    if not buffer:
        return []
    from megatron_sao.bus.codec import Limits, decode

    if bus is None:
        raise ValueError("a pre-training buffer to restore needs the bus limits (ValuePretraining(..., bus=cfg.bus))")
    limits = Limits(bus.max_frame_bytes, bus.max_message_bytes, bus.max_header_bytes)
    return [[decode(frames, limits)[0] for frames in batch] for batch in buffer]

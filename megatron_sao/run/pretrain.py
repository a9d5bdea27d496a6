"""Value pre-training: the critic learns the initial policy's returns before the first policy update (SAO, paper:
6k samples; run/learn.py drives it, on every learner rank alike).

Each step is a critic-only learner step (K value updates, no policy update: `Learner.train_step(update_policy=
False)`) on rollouts of the frozen initial policy -- the engines keep the launch weights, nothing is pushed. The
phase ends when `algo.value.pretrain_samples` trajectories were used, or earlier when the value loss settled: the
mean of the last `pretrain_plateau_steps` steps improved by less than `pretrain_plateau_tol` (relative) on the mean
of the ones before. Its progress (trajectories used, the losses seen, whether it ended) is saved with every
checkpoint, so a run stopped mid-phase resumes there.
"""

from __future__ import annotations

import statistics
from typing import Any

from megatron_sao.config.algo import AlgoConfig

LOSS = "loss/value_first"
"""The step's first value update's loss: the critic's error on trajectories it has not trained on yet."""


class ValuePretraining:
    def __init__(self, algo: AlgoConfig, state: dict[str, Any] | None, version: int) -> None:
        v = algo.value
        self.budget, self.window, self.tol = v.pretrain_samples, v.pretrain_plateau_steps, v.pretrain_plateau_tol
        state = state or {}
        self.samples = int(state.get("samples", 0))
        self.steps = int(state.get("steps", 0))
        self.losses: list[float] = [float(x) for x in state.get("losses", [])]
        # a learner past version 0 has updated its policy: pre-training is over whatever the state says
        done = bool(state.get("done")) or version > 0 or not algo.uses_critic or self.budget == 0
        self.done, self.reason = done, str(state.get("reason", "not needed" if done else ""))

    @property
    def active(self) -> bool:
        return not self.done

    def record(self, trajectories: int, metrics: dict[str, float]) -> None:
        """One critic-only step on `trajectories`; ends the phase when the budget is used or the loss settled."""
        self.samples += trajectories
        self.steps += 1
        if LOSS in metrics:
            self.losses.append(float(metrics[LOSS]))
        if self.samples >= self.budget:
            self.done, self.reason = True, f"{self.samples} trajectories (budget {self.budget})"
        elif self.settled():
            self.done, self.reason = True, f"value loss settled after {self.steps} steps"

    def settled(self) -> bool:
        w = self.window
        if w == 0 or len(self.losses) < 2 * w:
            return False
        before, last = statistics.fmean(self.losses[-2 * w : -w]), statistics.fmean(self.losses[-w:])
        return before - last < self.tol * abs(before)

    def metrics(self) -> dict[str, float]:
        return {"pretrain/samples": float(self.samples), "pretrain/steps": float(self.steps),
                "pretrain/done": float(self.done)}  # fmt: skip

    def progress(self, metrics: dict[str, float]) -> str:
        parts = [f"value pre-training {self.samples}/{self.budget} traj"]
        for key, label in ((LOSS, "v_loss"), ("value/explained_variance", "expl_var")):
            if key in metrics:
                parts.append(f"{label} {metrics[key]:.4g}")
        if self.done:
            parts.append(f"done: {self.reason}")
        return " | ".join(parts)

    def state_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "steps": self.steps, "losses": self.losses[-200:], "done": self.done,
                "reason": self.reason}  # fmt: skip

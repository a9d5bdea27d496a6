"""`algo` section: SAO hyperparameters and the baselines kept in the same framework.

Defaults are the paper's (../docs/algorithm.md lists each with its source); `[unstated]` choices are ours.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from megatron_sao.config.base import Section


class DISConfig(Section):
    """Direct double-sided importance sampling: mask (never clip) tokens whose ratio leaves the band."""

    eps_low: float = Field(default=0.3, ge=0.0, le=1.0)
    """Lower band edge: tokens with r <= 1 - eps_low get no gradient (paper 0.3; coding 0.8)."""

    eps_high: float = Field(default=5.0, gt=0.0)
    """Upper band edge: tokens with r >= 1 + eps_high get no gradient (paper 5.0; coding 3.0)."""

    mask: bool = True
    """False: plain importance sampling, `-r * A` on every action token with no band (the ablation of DIS; an
    unbounded ratio then reaches the gradient). The band edges are ignored."""


class GAEConfig(Section):
    """Skip-observation token-level GAE (megatron_sao/algo/gae.py)."""

    gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    """Discount over action tokens [unstated; 1.0]."""

    alpha: float = Field(default=1.5, gt=0.0)
    """Length-adaptive GAE: lambda_policy = 1 - 1/(alpha * l), l = action tokens of the trajectory."""

    lambda_policy: float | None = Field(default=None, ge=0.0, le=1.0)
    """Fixed lambda for the policy advantages; None uses the length-adaptive rule."""

    lambda_critic: float = Field(default=1.0, ge=0.0, le=1.0)
    """Lambda for the critic's value targets (paper: 1)."""

    whiten_advantages: bool = False
    """Centre and scale the policy's advantages over the step's action tokens (every data-parallel rank's, as one
    batch): a lagging critic otherwise pushes every token of a step the same way (its mean advantage). The paper does
    not; verl's GAE does."""

    skip_observations: bool = True
    """True (SAO): the recursion runs over action tokens only, bootstrapping across a tool's answer from the
    next action token. False (the ablation): it runs over every token from a trajectory's first action token to
    its last, observation tokens included (reward 0 there, the critic's values at them part of the TD chain, and
    the critic trained on them too); the policy loss still covers action tokens only."""


class ValueConfig(Section):
    updates_per_policy_step: int = Field(default=2, ge=0)
    """K: value-model optimizer steps per policy step, on the same trajectories (TTUR; paper 2)."""

    clip: float | None = Field(default=0.5, gt=0.0)
    """PPO value clip around the values seen at the start of the step, in reward units [unstated]: scale it with the
    reward range (0.5 for rewards in [0, 1], verl's default; 0.2 held the critic to a fifth of that range per step);
    None disables clipping."""

    pretrain_samples: int = Field(default=0, ge=0)
    """Value pre-training before the first policy update: critic-only steps on rollouts of the frozen initial policy,
    until this many new trajectories arrived (paper: 6000), or earlier once the critic is ready (below)."""

    pretrain_batch: int = Field(default=0, ge=0)
    """New trajectories per pre-training step (0: learner.trajectories_per_step). The new batch is one critic step,
    so its explained variance -- what the stopping rule reads and the step's record shows -- is measured on all of
    it: on 16 trajectories it swings by about +-0.1 from batch to batch. The passes over the buffer go in steps of
    learner.trajectories_per_step."""

    pretrain_buffer_batches: int = Field(default=1, ge=1)
    """Pre-training keeps the newest this-many batches (of `pretrain_batch`) to train on again; 1: each batch is
    trained on when it arrives and then dropped."""

    pretrain_passes: int = Field(default=1, ge=1)
    """Passes over that buffer per pre-training step. The first pass starts with the new batch (its metrics are
    the critic's error on trajectories it has not seen: what the stopping rule reads), then the older batches; each
    further pass goes over all of it in a new shuffled order, in critic steps (K updates each) of
    learner.trajectories_per_step trajectories."""

    pretrain_plateau_steps: int = Field(default=5, ge=0)
    """Pre-training ends early once the critic is ready, judged over the last this-many steps: their mean explained
    variance (on each new batch, before training on it) is at least `pretrain_min_explained_variance` and their
    mean value loss improved by less than `pretrain_plateau_tol` (relative) on the this-many before; 0: only the
    sample budget ends it."""

    pretrain_plateau_tol: float = Field(default=0.02, ge=0.0)
    """Relative improvement below which the value loss counts as settled."""

    pretrain_min_explained_variance: float = Field(default=0.3, le=1.0)
    """The explained variance the critic must reach before a settled loss ends pre-training (VC-PPO / VAPO stop on
    a low loss and a high explained variance; a loss can settle on a critic that explains nothing)."""


class GRPOConfig(Section):
    """The group arms: `grpo` (synchronous: B prompts x G samples; the learner steps on whole groups only, and the
    next batch is generated only once the new weights reached the engines) and `grpo_async` (one-step-off: batch
    k+1 is generated while batch k trains, so every trajectory after the first batch is exactly one version old).
    B = learner.trajectories_per_step / G."""

    group_size: int = Field(default=8, ge=2)
    """G rollouts per prompt."""

    normalize_std: bool = True
    """Divide group-centred rewards by the group's std."""

    policy_loss: Literal["dis", "ppo_clip"] = "dis"
    """Policy loss of the GRPO arm."""

    clip_eps: float = Field(default=0.2, gt=0.0, lt=1.0)
    """PPO clip range when policy_loss = ppo_clip: ratios are clipped to [1 - clip_eps, 1 + clip_eps_high]."""

    clip_eps_high: float | None = Field(default=None, gt=0.0)
    """Upper clip range for clip-higher (DAPO uses 0.28 with clip_eps 0.2); None = clip_eps (symmetric PPO)."""


class RunningMeanConfig(Section):
    window: int = Field(default=8, ge=1)
    """Number of most recent rewards averaged into the single-rollout baseline (paper: 8). The baseline of a
    reward is the mean of the rewards before it (0 before the first)."""

    group_by: str | None = None
    """A key of the trajectories' metadata (e.g. `hops`, key_chain's chain length): one running mean per value of
    it. With the task's difficulty as the key this is the oracle prompt-level baseline (experiments/
    critic_matters.py); None: one stream for every prompt (the paper's)."""


class OracleValueConfig(Section):
    lambda_turn: float = Field(default=1.0, ge=0.0, le=1.0)
    """GAE's lambda over turns with the oracle's state values: 1 gives every turn R - V(s_t) (the return minus the
    value of the state it acted in), 0 turn-level TD (V(s_t+1) - V(s_t); the last turn R - V(s_t))."""

    window: int = Field(default=64, ge=1)
    """Returns averaged per state: the most recent this many seen from it (before the trajectory's own)."""


ArmName = Literal["sao", "grpo", "grpo_async", "running_mean", "oracle_value"]
GROUP_ARMS = ("grpo", "grpo_async")


class AlgoConfig(Section):
    name: ArmName = "sao"
    """sao: one rollout per prompt, streamed, critic + DIS; grpo: synchronous group batches; grpo_async: one-step-off
    group batches; running_mean: one rollout per prompt, streamed, with a running-mean baseline (window 8);
    oracle_value: one rollout per prompt, streamed, advantages from a table of values of the states the environment
    names per turn (metadata turn_states; key_chain with decoys) -- the ceiling a critic could reach on such a task
    (experiments/credit.py)."""

    dis: DISConfig = Field(default_factory=DISConfig)
    gae: GAEConfig = Field(default_factory=GAEConfig)
    value: ValueConfig = Field(default_factory=ValueConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    running_mean: RunningMeanConfig = Field(default_factory=RunningMeanConfig)
    oracle_value: OracleValueConfig = Field(default_factory=OracleValueConfig)

    @property
    def uses_critic(self) -> bool:
        return self.name == "sao"

    @property
    def grouped(self) -> bool:
        """The group arms: G samples per prompt, whole groups per step, batches generated in lockstep."""
        return self.name in GROUP_ARMS

    @property
    def rollouts_per_prompt(self) -> int:
        return self.grpo.group_size if self.grouped else 1

    @property
    def batch_lag(self) -> int | None:
        """How many versions old a batch's weights may be: 0 (grpo), 1 (grpo_async); None: streaming arms."""
        return {"grpo": 0, "grpo_async": 1}.get(self.name)

    @model_validator(mode="after")
    def _check(self) -> AlgoConfig:
        if self.name == "sao" and self.value.updates_per_policy_step == 0:
            raise ValueError(
                "algo.value.updates_per_policy_step=0 leaves the SAO critic untrained; use >= 1 (paper: 2) "
                "or pick algo.name=running_mean for a critic-free arm"
            )
        return self

"""`learner` section: optimizer roles, micro-batching, step size, checkpoints of the megatron learner."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from megatron_sao.config.base import Section
from megatron_sao.config.parallel import ParallelConfig

Recompute = Literal["none", "selective", "full"]
Routing = Literal["off", "measure", "replay"]
"""What a model does with the engine's MoE routes: nothing, count its router's disagreement, or route by them."""


class RoleOptimConfig(Section):
    """Optimizer, schedule and trainable set of one role (policy or value)."""

    lr: float = Field(gt=0.0)
    """Peak learning rate."""

    min_lr: float = Field(default=0.0, ge=0.0)
    """Final learning rate of a decaying schedule."""

    warmup_steps: int = Field(default=0, ge=0)
    """Linear warm-up, in optimizer steps of this role."""

    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Decay after warm-up, over learner.max_steps."""

    weight_decay: float = Field(default=0.0, ge=0.0)
    """Adam's decoupled weight decay (AdamW)."""

    adam_beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    """Adam's first-moment decay."""

    adam_beta2: float = Field(default=0.999, ge=0.0, lt=1.0)
    """Adam's second-moment decay."""

    adam_eps: float = Field(default=1e-8, gt=0.0)
    """Adam's epsilon (added to the second moment's root)."""

    clip_grad: float = Field(default=1.0, ge=0.0)
    """Global gradient-norm clip (0 disables)."""

    trainable: list[str] = Field(default_factory=lambda: ["*"])
    """fnmatch patterns over megatron parameter names; a parameter trains when it matches one of them..."""

    frozen: list[str] = Field(default_factory=list)
    """...and none of these."""


class PolicyOptimConfig(RoleOptimConfig):
    """The policy's optimizer (paper: LR 1e-6, everything trainable)."""

    lr: float = Field(default=1e-6, gt=0.0)
    """Peak learning rate (the paper's 1e-6)."""


class ValueOptimConfig(RoleOptimConfig):
    """The critic's optimizer. SAO freezes the critic's attention: every MLP (routed experts, shared experts and
    the dense MLPs of leading dense layers) and the value head (the value model's output_layer) train; attention,
    router, norms and embeddings stay frozen."""

    lr: float = Field(default=5e-6, gt=0.0)
    """Peak learning rate (the paper's 5e-6: five times the policy's)."""

    warmup_steps: int = Field(default=10, ge=0)
    """Steps of linear warm-up from 0 to lr."""

    trainable: list[str] = Field(
        default_factory=lambda: ["*.mlp.experts.*", "*.mlp.shared_experts.*", "*.mlp.linear_fc*", "output_layer.*"]
    )
    """What trains: every MLP and the value head (fnmatch patterns over megatron parameter names)."""

    frozen: list[str] = Field(default_factory=lambda: ["*.self_attention.*", "*.router.*", "*norm*", "embedding.*"])
    """What stays frozen even where `trainable` matches: attention, router, norms, embeddings (SAO's frozen
    attention)."""


class LearnerConfig(Section):
    trajectories_per_step: int = Field(default=128, ge=1)
    """Finished trajectories consumed by one learner step (paper 128; 1 is the pure per-rollout limit)."""

    max_tokens_per_microbatch: int = Field(default=16384, gt=0)
    """Token budget of one packed micro-batch; trajectories are packed greedily up to it."""

    max_steps: int = Field(default=1000, ge=1)
    """Policy steps to run (also the horizon of decaying LR schedules)."""

    policy: PolicyOptimConfig = Field(default_factory=PolicyOptimConfig)
    value: ValueOptimConfig = Field(default_factory=ValueOptimConfig)

    recompute: Recompute = "none"
    """Activation recomputation (megatron recompute_granularity): selective recomputes each layer's core attention
    in backward; full keeps only every layer's input and recomputes the layer (uniform, one layer per checkpoint):
    the activations of a long micro-batch drop to a layer's worth at ~1/3 more compute. `python -m megatron_sao plan`
    shows what each needs."""

    routing_replay: bool = False
    """MoE routing replay (R3): the policy routes every token of a trajectory to the experts the engine routed it to
    (rollout.return_routed_experts, set with it), in its forward and backward (megatron-core's
    moe_enable_routing_replay); the router weights still get gradients through the gathered scores. The critic
    routes by its own router unless critic_routing_replay (docs/learner.md "Routing replay")."""

    critic_routing_replay: bool = False
    """The critic routes by the engine's routes too, in its forward for GAE and its K updates (needs
    learner.routing_replay and the critic on the policy's ranks). Off by default: docs/results.md "Routing replay"
    measured the critic's explained variance both ways."""

    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (megatron DistributedOptimizer)."""

    moe_aux_loss_coeff: float = Field(default=0.0, ge=0.0)
    """Load-balancing auxiliary loss weight added to the policy loss (logged either way)."""

    value_on_separate_ranks: bool = False
    """Run the critic on its own ranks: a value job (`python -m megatron_sao critic`, its own torch.distributed
    world with the `value_parallel` layout, started by `run` on launch.value_nproc_per_node x launch.value_nnodes
    ranks) beside the policy job. A step's K critic updates then run while the policy updates and pushes, so it
    costs about max(policy, critic) instead of their sum (learner/value_job.py). Default: both models on every
    learner rank, the critic updates first (sao only). Code asks cfg.jobs (config/roles.py), not this field."""

    value_parallel: ParallelConfig | None = None
    """The value job's own TP / PP / EP layout (DP from its rank count); None: the same as `parallel`. Only with
    value_on_separate_ranks."""

    save_dir: str | None = None
    """Directory for distributed checkpoints; None: <launch.run_dir>/checkpoints. The run resumes from its latest."""

    save_interval: int = Field(default=50, ge=1)
    """Policy steps between checkpoints."""

    fallback_checkpoints: int = Field(default=1, ge=0)
    """How many checkpoints a resume can fall back over (the newer ones damaged) and still train every trajectory:
    producers keep each trajectory (in their spool, or in memory without one) until this many checkpoints after the
    one that covers it are written, so a resume from an older checkpoint gets the abandoned steps' trajectories again
    and trains them. Spools hold this many more save intervals of trajectories; 0 frees them at once."""

    keep_checkpoints: int | None = Field(default=5, ge=1)
    """Keep only the newest this many `iter_*` checkpoints of the policy (older ones are deleted after each save;
    `pretrain_*`, set-aside and the critic's own checkpoints stay). None keeps every one. At least
    fallback_checkpoints + 1: a resume may fall back over that many."""

    load: str | None = None
    """Checkpoint directory to resume from (any TP/EP/PP layout)."""

    seed: int = 1234
    """Seed for parameter init, dropout and data order."""

    max_nonfinite_updates: int = Field(default=5, ge=1)
    """An optimizer step whose gradients hold NaN/Inf is skipped (weights unchanged) and counted
    (policy/nonfinite_updates, value/nonfinite_updates); this many in a row for one model stop the run with a message
    (the checkpoints before are intact)."""

    @model_validator(mode="after")
    def _check(self) -> LearnerConfig:
        if self.value_parallel is not None and not self.value_on_separate_ranks:
            raise ValueError("learner.value_parallel is set but learner.value_on_separate_ranks=false: the critic "
                             "shares the policy's ranks and layout; set learner.value_on_separate_ranks=true or "
                             "remove learner.value_parallel")  # fmt: skip
        for role in ("policy", "value"):
            r: RoleOptimConfig = getattr(self, role)
            if r.min_lr > r.lr:
                raise ValueError(f"learner.{role}.min_lr={r.min_lr} exceeds learner.{role}.lr={r.lr}; lower min_lr")
        if self.keep_checkpoints is not None and self.keep_checkpoints < self.fallback_checkpoints + 1:
            raise ValueError(f"learner.keep_checkpoints={self.keep_checkpoints} is fewer than the "
                             f"learner.fallback_checkpoints={self.fallback_checkpoints} a resume may fall back over, "
                             f"plus the latest: keep at least {self.fallback_checkpoints + 1}")  # fmt: skip
        return self

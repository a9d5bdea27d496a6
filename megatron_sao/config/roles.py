"""Which jobs a run starts and what each holds, derived once from the config (learner, launch, rollout): the one
answer to "is the critic on ranks of its own?" that the learner, its checkpoints, the run loop, the local and Slurm
launchers and the planner ask.

    learner job    `learn`: the policy, and the critic too unless learner.value_on_separate_ranks; rank 0 drives
                   the run (bus, weight sync, checkpoints)
    value job      `critic`, only with learner.value_on_separate_ranks: the critic, its own world and layout
                   (learner.value_parallel, else parallel), bridged to the learner job (learner/value_job.py)
    engines        rollout.num_engines started by the run (none when rollout.engine_urls names running ones)
    workers        rollout workers: one under launch.mode=local, launch.workers_per_node per worker node under slurm

Built by `cfg.jobs` (SAOConfig.jobs, config/tree.py; its cross-section checks use it too); read it instead of the
config fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_sao.config.algo import AlgoConfig
from megatron_sao.config.launch import LaunchConfig
from megatron_sao.config.learner import LearnerConfig
from megatron_sao.config.parallel import ParallelConfig
from megatron_sao.config.rollout import RolloutConfig

LearnerRole = Literal["policy", "value"]
POLICY_DIR = "policy"
"""A learner job's checkpoints beside a value job: <save_dir>/policy (the two jobs save the same versions)."""
VALUE_DIR = "value"
"""The value job's checkpoints: <save_dir>/value."""


@dataclass(frozen=True)
class LearnerJob:
    """One torch.distributed world that trains: the learner job, or the value job of a critic on its own ranks."""

    name: Literal["learner", "critic"]
    """Its command (`learn` / `critic`), srun step and log name."""
    roles: frozenset[LearnerRole]
    """The models it builds and trains."""
    parallel: ParallelConfig
    """Its layout (the value job's: learner.value_parallel, else parallel)."""
    nnodes: int
    """Nodes of its own under slurm; 0: the value job shares the learner's first node."""
    nproc_per_node: int
    checkpoint_subdir: str
    """Where it saves under the run's checkpoint directory: "" (that directory) for a learner holding every role,
    else `policy` / `value`."""

    @property
    def world_size(self) -> int:
        return max(self.nnodes, 1) * self.nproc_per_node


@dataclass(frozen=True)
class Jobs:
    """Every job of a run (see the module docstring)."""

    learner: LearnerJob
    value: LearnerJob | None
    """The value job; None: the critic (if the algorithm has one) shares the learner's ranks."""
    engines: int
    """Engines the run starts (0: rollout.engine_urls names running ones)."""
    workers: int
    """Rollout workers the run starts."""

    @classmethod
    def of(
        cls, parallel: ParallelConfig, algo: AlgoConfig, learner: LearnerConfig, rollout: RolloutConfig,
        launch: LaunchConfig,
    ) -> Jobs:  # fmt: skip
        """The jobs of a config with these sections (SAOConfig.jobs passes its own)."""
        la = launch
        separate = learner.value_on_separate_ranks
        critic: frozenset[LearnerRole] = frozenset({"value"}) if algo.uses_critic else frozenset()
        policy_job = LearnerJob(
            name="learner",
            roles=frozenset({"policy"}) | (frozenset() if separate else critic),
            parallel=parallel,
            nnodes=la.nnodes,
            nproc_per_node=la.nproc_per_node,
            checkpoint_subdir=POLICY_DIR if separate else "",
        )
        value_job = None
        if separate:
            value_job = LearnerJob(name="critic", roles=frozenset({"value"}),
                                   parallel=learner.value_parallel or parallel, nnodes=la.value_nnodes,
                                   nproc_per_node=la.value_nproc_per_node, checkpoint_subdir=VALUE_DIR)  # fmt: skip
        if la.mode == "local":
            workers = 1
        else:
            workers = max(la.worker_nodes or la.rollout_nodes, 1) * la.workers_per_node
        engines = 0 if rollout.engine_urls else rollout.num_engines
        return cls(policy_job, value_job, engines, workers)

    @property
    def trained(self) -> tuple[LearnerJob, ...]:
        """The jobs that train, the learner job first."""
        return (self.learner,) if self.value is None else (self.learner, self.value)

    @property
    def roles(self) -> frozenset[LearnerRole]:
        """Every model the run trains."""
        return frozenset().union(*(job.roles for job in self.trained))

    def job_for(self, roles: frozenset[str] | set[str]) -> LearnerJob:
        """The job a learner building `roles` belongs to (the one holding them all; a test or tool may build part of
        a job's roles). ValueError naming the fix when no job holds them all (the policy and the critic of a run
        whose critic has ranks of its own)."""
        if not roles or not set(roles) <= self.roles:
            raise ValueError(f"roles={sorted(roles)} must be a non-empty subset of {sorted(self.roles)}, the models "
                             "this run trains (algo.name decides whether there is a critic)")  # fmt: skip
        for job in self.trained:
            if set(roles) <= job.roles:
                return job
        held = " and ".join(str(sorted(job.roles)) for job in self.trained)
        raise ValueError(f"learner.value_on_separate_ranks=true: a learner holds roles {held} (one per job: the "
                         f"learner job and the value job), not {sorted(roles)}; or set "
                         "learner.value_on_separate_ranks=false")  # fmt: skip

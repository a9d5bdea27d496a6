"""`launch` section: where processes run (one machine, or the nodes of a Slurm allocation) and where the run writes.

Read by run/local.py (launch.mode=local) and launch/ (launch.mode=slurm: the node map, the srun steps, sbatch)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from megatron_sao.config.base import Section


class SlurmConfig(Section):
    """What `./launch.sh submit` writes into the sbatch script (launch/sbatch.py); the node count comes from the
    roles (launch.nnodes + rollout_nodes + worker_nodes)."""

    job_name: str = "megatron-sao"
    """--job-name of the sbatch script."""

    partition: str | None = None
    """--partition (None: the cluster's default)."""

    account: str | None = None
    """--account (None: the user's default)."""

    time: str | None = None
    """--time, in Slurm's syntax (2-00:00:00); None: the partition's limit."""

    exclusive: bool = False
    """--exclusive: whole nodes (set it on GPU clusters, where nodes are not shared)."""

    signal_grace_s: int = Field(default=300, ge=0)
    """--signal=B:TERM@N: the launcher is told this long before the time limit, so the learner checkpoints in time
    (0: no early signal)."""

    sbatch_args: list[str] = Field(default_factory=list)
    """More #SBATCH options, verbatim (["--qos=high", "--constraint=h100"])."""

    srun_args: list[str] = Field(default_factory=list)
    """Appended to every srun of a role (["--mpi=pmix"], container flags ...)."""

    setup: list[str] = Field(default_factory=list)
    """Shell lines the sbatch script runs before the launcher (module load ..., source /path/venv/bin/activate)."""


class LaunchConfig(Section):
    mode: Literal["local", "slurm"] = "local"
    """local: every role on this machine (`run`); slurm: `./launch.sh run` inside an allocation places every role
    on its nodes (launch/), `./launch.sh submit` writes and submits the sbatch script."""

    nnodes: int = Field(default=1, ge=1)
    """Learner nodes (slurm: the allocation's first nnodes nodes; torchrun's rendezvous is on the first)."""

    nproc_per_node: int = Field(default=1, ge=1)
    """Learner ranks per node (GPUs per node on a cluster)."""

    rollout_nodes: int = Field(default=0, ge=0)
    """slurm: nodes of engines, after the learner's (rollout.num_engines spread evenly over them); 0: the engines
    run on the first learner node (CPU clusters). local: must be 0."""

    worker_nodes: int = Field(default=0, ge=0)
    """slurm: nodes of rollout workers only, after the engines'; 0: the workers run on the engine nodes (or the first
    learner node when rollout_nodes is 0). local: must be 0."""

    workers_per_node: int = Field(default=1, ge=1)
    """slurm: rollout workers per worker node, each with its own share of the prompts (local: one worker)."""

    value_nnodes: int = Field(default=0, ge=0)
    """slurm, learner.value_on_separate_ranks: nodes of the value job, after the learner's; 0: it shares the learner's
    first node (CPU clusters, or GPUs left free there). local: must be 0."""

    value_nproc_per_node: int = Field(default=1, ge=1)
    """learner.value_on_separate_ranks: value-job ranks per node (its world: this x max(value_nnodes, 1)). Its
    torchrun meets on rdzv_port + 1 of its first node; the bridge to the policy job is rdzv_port + 2 on the learner's
    first node."""

    gpus_per_node: int | None = Field(default=None, ge=0)
    """GPUs per node: the sbatch request (--gpus-per-node; none when 0), the SGLang engines' --base-gpu-id offsets,
    and the bound on engines per node (tp x dp each) and on nproc_per_node of a GPU learner. Unset: 8 when the config
    needs GPUs (rollout.engine=sglang, or weight_sync.backend=nccl), else 0, so a CPU config asks a cluster without
    GPU GRES for none."""

    rdzv_port: int = Field(default=29400, ge=1024, le=65535)
    """torchrun's rendezvous port on the first learner node."""

    max_restarts: int = Field(default=5, ge=0)
    """Per role (each engine, each rollout worker, the learner under slurm): restarts after it exits unexpectedly;
    one more exit stops the run (the learner checkpoints first)."""

    stop_timeout_s: float = Field(default=120.0, gt=0)
    """After SIGTERM / scancel / a role beyond its budget: how long the learner gets to checkpoint and exit before
    every step is killed."""

    run_dir: str = "runs/default"
    """Logs, metrics and checkpoints (unless learner.save_dir says otherwise); on a shared filesystem under slurm."""

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Logging level of every role (debug also shows megatron's per-bucket lines)."""

    tensorboard: bool = True
    """Write every step's metrics as TensorBoard events under <run_dir>/tensorboard (tensorboard --logdir RUN_DIR)."""

    wandb: Literal["online", "offline"] | None = None
    """Also log to Weights & Biases (wandb must be installed; offline: a local run under <run_dir>/wandb)."""

    samples_per_step: int = Field(default=2, ge=0)
    """Trajectories of each step decoded into <run_dir>/samples.jsonl, TensorBoard's text tab and wandb (prompt, what
    followed, reward, turns, versions; spread over the batch by reward, best and worst first); 0: none."""

    display: Literal["auto", "rich", "plain"] = "auto"
    """The learner's progress: a live view on an interactive terminal (auto: when stdout is a TTY outside CI and
    Slurm), else one plain line per step."""

    slurm: SlurmConfig = Field(default_factory=SlurmConfig)

    @property
    def learner_world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def total_nodes(self) -> int:
        """Nodes a slurm run needs: learner, value job, engine and worker nodes."""
        return self.nnodes + self.value_nnodes + self.rollout_nodes + self.worker_nodes

    @model_validator(mode="after")
    def _check(self) -> LaunchConfig:
        if self.mode == "local":
            for name in ("rollout_nodes", "worker_nodes", "value_nnodes"):
                if getattr(self, name):
                    raise ValueError(f"launch.{name}={getattr(self, name)} places roles on other nodes, which "
                                     "launch.mode=local never does: set launch.mode=slurm (and run inside an "
                                     f"allocation or `./launch.sh submit`), or launch.{name}=0")  # fmt: skip
            if self.workers_per_node > 1:
                raise ValueError(f"launch.workers_per_node={self.workers_per_node}: launch.mode=local runs one rollout "
                                 "worker (raise rollout.concurrency instead), or set launch.mode=slurm")  # fmt: skip
            if self.nnodes > 1:
                raise ValueError(f"launch.nnodes={self.nnodes}: launch.mode=local runs the learner on this machine; "
                                 "set launch.mode=slurm for more learner nodes, or launch.nnodes=1")  # fmt: skip
        return self

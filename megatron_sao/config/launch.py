"""`launch` section: where processes run (one machine, or Slurm) and where the run writes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron_sao.config.base import Section


class LaunchConfig(Section):
    mode: Literal["local", "slurm"] = "local"
    """local: every role on this machine; slurm: roles placed by `launch.sh` on the allocation."""

    nnodes: int = Field(default=1, ge=1)
    """Learner nodes."""

    nproc_per_node: int = Field(default=1, ge=1)
    """Learner ranks per node (GPUs per node on a cluster)."""

    rollout_nodes: int = Field(default=0, ge=0)
    """Nodes reserved for engines (0: engines share the learner's machine)."""

    run_dir: str = "runs/default"
    """Logs, metrics and checkpoints (unless learner.save_dir says otherwise)."""

    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @property
    def learner_world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

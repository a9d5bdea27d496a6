"""The one distributed bootstrap every entry point uses (learner, tools, tests, benchmarks).

Reads the rank layout from torchrun or Slurm variables, activates the platform layer (CPU patches only when
there is no CUDA), initializes torch.distributed (nccl on GPU, gloo on CPU) and megatron's parallel state
(TP, PP, virtual PP, CP, EP, expert-TP; DP derived) from `ParallelConfig`, and seeds every RNG. The layout it sets
up comes back as a `DistContext`, which callers pass to the learner, checkpointing, metrics and weight sync: the
stages (learner/, weight_sync/, convert/) never read megatron's parallel_state globals; this module does, and the
model builders (models/builder.py, smoke.py) ask megatron which pipeline stage's layers to build, the way
megatron's own model providers do. megatron-core reads them inside its schedules and layers.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_sao.config.parallel import ParallelConfig, ParallelSizes
from megatron_sao.distributed.update_group import NCCL_ERROR_HANDLING
from megatron_sao.platform_layer import activate


@dataclass(frozen=True)
class DistContext(ParallelSizes):
    """Where this process sits: the layout's sizes (config.parallel.ParallelSizes, the record the planner holds too)
    and this rank's place in it. Every rank, size and group the stages ask for comes from here."""

    rank: int
    local_rank: int
    device: torch.device
    backend: str
    tp_rank: int = 0
    pp_rank: int = 0
    cp_rank: int = 0
    dp_rank: int = 0
    dp_group: Any = field(default=None, compare=False, repr=False)
    """This rank's data-parallel group (megatron's, context parallelism excluded); None: the whole world of one."""

    def is_last_stage(self) -> bool:
        """The last pipeline stage: it holds the output layer, the value head, the loss."""
        return self.pp_rank == self.pp - 1

    @property
    def holds_outputs(self) -> bool:
        """The ranks whose loss-function metrics count once: last pipeline stage, TP rank 0, CP rank 0."""
        return self.is_last_stage() and self.tp_rank == 0 and self.cp_rank == 0

    @property
    def is_rank0(self) -> bool:
        """Rank 0 of the job's world: the one that logs, writes files and talks to the other jobs."""
        return self.rank == 0


_CURRENT: DistContext | None = None


def initialized_context() -> DistContext | None:
    """The layout init_distributed set up in this process, None before (or after destroy_distributed): for a tool
    that must know whether one exists (checkpoint conversion). Everything else is handed the DistContext
    init_distributed returned."""
    return _CURRENT


def _launch_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun, else Slurm, else a single process."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0"))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        if world > 1 and "MASTER_ADDR" not in env:
            raise RuntimeError(
                "Slurm launch without MASTER_ADDR: export MASTER_ADDR=<first node of $SLURM_JOB_NODELIST> and "
                "MASTER_PORT before srun (launch.sh does this)"
            )
        return rank, world, int(env.get("SLURM_LOCALID", "0"))
    return 0, 1, 0


def seed_everything(seed: int, pp_rank: int = 0) -> None:
    """Seed python, numpy, torch and megatron's model-parallel RNG tracker the way megatron's trainer does
    (an offset per pipeline stage; TP/EP-specific streams come from the tracker)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    stage_seed = seed + 100 * pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed % (2**32))
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed)


def init_distributed(parallel: ParallelConfig, seed: int = 1234, timeout_s: float = 600.0) -> DistContext:
    """Initialize the process group and megatron parallel state; safe to call once per process."""
    rank, world_size, local_rank = _launch_env()
    platform = activate(local_rank)
    parallel.check_world_size(world_size)
    if platform.dist_backend == "nccl":
        torch.cuda.set_device(platform.device)
        for key, value in NCCL_ERROR_HANDLING.items():  # before any NCCL group exists
            os.environ.setdefault(key, value)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        # One rank outside torchrun has nobody to meet: a free port, never one left in the environment by another
        # process. Under torchrun the rank joins its agent's store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE),
        # which must stay.
        if world_size == 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
            from megatron_sao.distributed.spawn import find_free_port

            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(find_free_port())
        elif "MASTER_PORT" not in os.environ:
            raise RuntimeError("MASTER_PORT is not set; launch with torchrun or export MASTER_ADDR/MASTER_PORT")
        dist.init_process_group(
            backend=platform.dist_backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )

    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            **parallel.megatron_sizes(), distributed_timeout_minutes=max(1, int(timeout_s // 60))
        )
    seed_everything(seed, ps.get_pipeline_model_parallel_rank())
    sizes = parallel.sizes(world_size)
    megatron = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_context_parallel_world_size(), ps.get_expert_model_parallel_world_size(),
                ps.get_expert_tensor_parallel_world_size(), ps.get_data_parallel_world_size())  # fmt: skip
    if megatron != (sizes.tp, sizes.pp, sizes.cp, sizes.ep, sizes.etp, sizes.dp):
        raise RuntimeError(f"megatron's parallel state already holds another layout (TP, PP, CP, EP, ETP, DP = "
                           f"{megatron}) than this ParallelConfig's {sizes}: call "
                           "destroy_distributed(keep_process_group=True) before switching layouts")  # fmt: skip
    global _CURRENT
    _CURRENT = DistContext(
        **{f.name: getattr(sizes, f.name) for f in fields(ParallelSizes)},
        rank=rank,
        local_rank=local_rank,
        device=platform.device,
        backend=platform.dist_backend,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_group=ps.get_data_parallel_group(),
    )
    return _CURRENT


def destroy_distributed(keep_process_group: bool = False) -> None:
    """Tear down megatron parallel state and, unless `keep_process_group`, the process group.

    Keeping the process group lets one set of ranks switch layouts (init_distributed with another
    ParallelConfig), which is how tests and tools compare TP/EP/PP layouts.
    """
    from megatron.core import parallel_state as ps

    global _CURRENT
    _CURRENT = None
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized() and not keep_process_group:
        dist.barrier()
        dist.destroy_process_group()

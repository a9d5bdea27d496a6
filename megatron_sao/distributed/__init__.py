"""torch.distributed + megatron parallel-state bootstrap (every entry point) and the local rank spawner."""

from megatron_sao.distributed.bootstrap import (
    DistContext,
    current_context,
    destroy_distributed,
    init_distributed,
    initialized_context,
    seed_everything,
)
from megatron_sao.distributed.spawn import RankFailure, find_free_port, spawn_ranks

__all__ = [
    "DistContext",
    "RankFailure",
    "current_context",
    "destroy_distributed",
    "find_free_port",
    "init_distributed",
    "initialized_context",
    "seed_everything",
    "spawn_ranks",
]

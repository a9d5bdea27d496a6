"""torch.distributed + megatron parallel-state bootstrap (every entry point), the collectives and rank questions
the stages ask (collectives.py), and the local rank spawner."""

from megatron_sao.distributed.bootstrap import (
    DistContext,
    destroy_distributed,
    init_distributed,
    initialized_context,
    seed_everything,
)
from megatron_sao.distributed.collectives import gather_to_rank0, rank_in, share, size_of, world_position
from megatron_sao.distributed.spawn import RankFailure, find_free_port, spawn_ranks

__all__ = [
    "DistContext",
    "RankFailure",
    "destroy_distributed",
    "find_free_port",
    "gather_to_rank0",
    "init_distributed",
    "initialized_context",
    "rank_in",
    "seed_everything",
    "share",
    "size_of",
    "spawn_ranks",
    "world_position",
]

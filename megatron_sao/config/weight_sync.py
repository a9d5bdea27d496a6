"""`weight_sync` section: resharding the learner's weights and broadcasting them to the engines."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron_sao.config.base import Section


class WeightSyncConfig(Section):
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """auto: nccl when CUDA is available, else gloo."""

    interval: int = Field(default=1, ge=1)
    """Push weights to the engines every `interval` policy steps."""

    bucket_mb: float = Field(default=512, gt=0)
    """Tensors are broadcast in buckets of about this size."""

    master_addr: str = "127.0.0.1"
    master_port: int = Field(default=29700, ge=1024, le=65535)
    group_name: str = "sao_weight_sync"

    flush_cache: bool = True
    """Ask engines to flush their prefix cache after each update."""

    pause_mode: Literal["in_place", "abort", "none"] = "in_place"
    """How engines pause around an update: keep requests in flight (in place), abort them, or not at all."""

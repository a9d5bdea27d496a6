"""Pieces both conversion directions share: errors, output directories, progress bars, the one-process megatron
context, and the tensors a model of a given HF config holds (read off a megatron model built on the meta device,
so the converters never disagree with what `builder.build_model` creates)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_sao.config.parallel import ParallelConfig
from megatron_sao.models.builder import ModelSpec, build_model, transformer_config
from megatron_sao.models.checkpoint import POLICY_PREFIX, model_sharded_state_dict
from megatron_sao.models.mapping import canonical_from_checkpoint_key

SUPPORTED_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class OutputDirectoryError(ValueError):
    """The output directory exists and is not empty (and --force was not given), or is not a directory."""


def check_output_dir(out: Path, force: bool) -> None:
    """Refuse a non-empty output directory unless `force` (checked before any work; nothing is deleted here)."""
    if out.exists() and not out.is_dir():
        raise OutputDirectoryError(f"output {out} exists and is not a directory; choose another --out")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise OutputDirectoryError(f"output directory {out} is not empty; pass --force to replace its contents")


def reset_output_dir(out: Path) -> None:
    """Empty (or create) the output directory; call after the inputs were validated."""
    if out.is_dir():
        shutil.rmtree(out)
    out.mkdir(parents=True)


@contextlib.contextmanager
def one_process_megatron() -> Iterator[None]:
    """torch.distributed with world size 1 and megatron TP=PP=EP=1 for the duration (reused if already set up;
    torn down afterwards only if created here). Both converters run on one process."""
    import torch.distributed as dist

    from megatron_sao.distributed import destroy_distributed, init_distributed, initialized_context, world_position

    if world_position()[1] != 1:
        raise ValueError("checkpoint conversion runs on one process; call it outside multi-rank jobs")
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise ValueError("checkpoint conversion runs on one process; run it with plain python, not torchrun / srun")
    layout = initialized_context()
    if layout is not None:
        sizes = (layout.tp, layout.pp, layout.ep)
        if sizes != (1, 1, 1):
            raise ValueError(f"conversion needs TP=PP=EP=1 parallel state, found TP/PP/EP={sizes}; destroy it first")
        yield
        return
    owned = not dist.is_initialized()
    init_distributed(ParallelConfig())
    try:
        yield
    finally:
        destroy_distributed(keep_process_group=not owned)


def meta_sharded_state_dict(spec: ModelSpec, prefix: str = POLICY_PREFIX) -> dict[str, Any]:
    """The canonical-keyed sharded weights of a world-size-1 model of `spec`, built on the meta device (no
    memory). Factories (GLU gate/up halves) are applied, so every value is a ShardedTensor (or a dict of them).
    Needs `one_process_megatron()`."""
    from megatron.core.dist_checkpointing.mapping import apply_factories

    config = transformer_config(
        spec, ParallelConfig(), use_te=False, perform_initialization=False, use_cpu_initialization=True
    )
    with torch.device("meta"):
        model = build_model(spec, config, use_te=False)
    sharded = model_sharded_state_dict(model, prefix)
    apply_factories(sharded)
    return sharded


@dataclass(frozen=True)
class TensorInfo:
    """One dist-checkpoint tensor of the model: its full (global) shape and dtype, the number of leading
    stacked axes (1 for experts), and the canonical megatron names it holds (one per expert)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    stacked: int
    names: tuple[str, ...]


def model_tensors(sharded: dict[str, Any], prefix: str = POLICY_PREFIX) -> dict[str, TensorInfo]:
    """checkpoint key -> TensorInfo for every sharded tensor of `sharded` (from `meta_sharded_state_dict`)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    names: dict[str, list[str]] = {}
    first: dict[str, Any] = {}
    for sh in nested_values(sharded):
        key = sh.key
        local = key.removeprefix(prefix)
        name = canonical_from_checkpoint_key(local, tuple(sh.global_offset[: sh.prepend_axis_num]))
        first.setdefault(key, sh)
        if name not in names.setdefault(key, []):
            names[key].append(name)
    return {
        k: TensorInfo(tuple(sh.global_shape), sh.data.dtype, sh.prepend_axis_num, tuple(names[k]))
        for k, sh in first.items()
    }


def progress_bar(enabled: bool) -> Any:
    """A rich progress bar on stderr (a do-nothing stand-in when disabled)."""
    if not enabled:
        return _NoProgress()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    )


class _NoProgress:
    def __enter__(self) -> _NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, description: str, total: float | None = None) -> int:
        return 0

    def advance(self, task: int, advance: float = 1) -> None:
        return None

    def update(self, task: int, **kwargs: Any) -> None:
        return None


def spec_dtype(dtype: torch.dtype) -> str:
    """ModelSpec dtype for a checkpoint's main dtype: bf16 stays bf16, fp32 and fp16 load as fp32 (lossless)."""
    return "bf16" if dtype == torch.bfloat16 else "fp32"

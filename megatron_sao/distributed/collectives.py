"""Small collectives over a job's world, and the rank questions code outside distributed/ may ask of a group it was
handed. Code with a DistContext asks it (`layout.rank`, `layout.world_size`); these are for what it does not cover:

    share(obj)              rank 0's object on every rank (a world of one: itself)
    gather_to_rank0(part)   every rank's dict merged on rank 0 (None elsewhere)
    all_gather_object(x)    every rank's object, in rank order, on every rank
    world_position()        (rank, world size) of the default group, (0, 1) with none: for collectives that also run
                            in one process with no distributed setup (checkpoint verification, tools)
    rank_in(group)          this process's rank in `group` (an engine's TP group, a control group)
    size_of(group)          the ranks of `group`

Called by the learner (checkpoint integrity, the critic's first values), the run loop and the value job's bridge.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def world_position() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) when there is none."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def rank_in(group: Any = None) -> int:
    """This process's rank in `group` (None: the default group)."""
    return dist.get_rank(group)


def size_of(group: Any = None) -> int:
    """How many ranks `group` holds (None: the default group)."""
    return dist.get_world_size(group)


def share(obj: T) -> T:
    """Collective: rank 0's `obj` on every rank of the default group (itself on a world of one, or with none)."""
    if world_position()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(value: T) -> list[T]:
    """Collective: every rank's `value`, in rank order, on every rank ([value] on a world of one, or with none)."""
    world = world_position()[1]
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value)
    return out


def gather_to_rank0(local: dict[str, T]) -> dict[str, T] | None:
    """Collective: every rank's entries merged on rank 0 (None on the others; `local` itself on a world of one)."""
    rank, world = world_position()
    if world == 1:
        return dict(local)
    parts: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(local, parts, dst=0)
    if parts is None:
        return None
    merged: dict[str, T] = {}
    for part in parts:
        merged.update(part or {})
    return merged

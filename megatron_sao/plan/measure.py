"""What a built learner role really holds on this rank, to check the planner against: parameter, gradient-buffer and
optimizer-state bytes (every tensor counted once by its storage), and the bytes autograd keeps for backward during
one micro-batch's forward (saved tensors that are not parameters). Used by tests/plan and benchmarks/plan_check.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from megatron_sao.learner.roles import RoleModel


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def static_bytes(role: RoleModel) -> dict[str, int]:
    """{'weights', 'grads', 'optimizer'}: parameter storages, DDP gradient buffers, optimizer state and fp32 main
    parameter shards (storages shared with the parameters -- fp32 models -- are not counted again)."""
    params = {_storage(p.data) for p in role.model.parameters()}
    grads = set()
    for buffer in [*role.ddp.buffers, *role.ddp.expert_parallel_buffers]:
        grads.add(_storage(buffer.grad_data))
    opt: set[tuple[int, int]] = set()
    for inner in getattr(role.optimizer, "chained_optimizers", [role.optimizer]):
        for state in inner.optimizer.state.values():
            opt |= {_storage(v) for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step"}
        for groups in getattr(inner, "shard_fp32_from_float16_groups", None) or []:
            opt |= {_storage(p) for p in groups}
    opt -= params
    return {
        "weights": sum(n for _, n in params),
        "grads": sum(n for _, n in grads),
        "optimizer": sum(n for _, n in opt),
    }


@contextmanager
def saved_activations(exclude: set[tuple[int, int]]) -> Iterator[Callable[[], int]]:
    """Inside: every tensor autograd saves for backward is recorded; the yielded function returns their bytes
    (unique storages, `exclude` -- the parameters -- left out)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> Any:
        ptr, n = _storage(t)
        if (ptr, n) not in exclude and ptr:
            seen[ptr] = max(seen.get(ptr, 0), n)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield lambda: sum(seen.values())


def parameter_storages(role: RoleModel) -> set[tuple[int, int]]:
    return {_storage(p.data) for p in role.model.parameters()}

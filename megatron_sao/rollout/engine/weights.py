"""In-place weight updates of the embedded engine: the update process group, receiving tensors broadcast by the
trainer, validating them against the model and copying them in (owned by engine/; called by engine/server.py for the
HTTP endpoints and by engine/scheduler.py, which applies a received update between two decode steps).

Protocol (SGLang's, see protocol.py): `/init_weights_update_group` makes this engine rank `rank_offset` of a
`world_size` group whose rank 0 is the trainer; `/update_weights_from_distributed` lists `names`, `dtypes`, `shapes`
and the trainer then broadcasts each tensor from rank 0, in that order. The engine validates every (name, dtype,
shape) against its model first; on any mismatch it still receives (drains) every tensor so the group stays in step
with the trainer, then rejects the whole update without touching the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_sao.rollout.engine.hf_names import Target, resolve
from megatron_sao.weight_sync.group import destroy_update_group, init_update_group

GROUP_TIMEOUT_S = 300.0
"""Joining the group and each broadcast give up after this long (the trainer must join / send within it)."""


class WeightUpdateError(ValueError):
    """A weight update the engine refused; the message says what to fix on the trainer side."""


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightUpdateError(f"unknown dtype {name!r}; send torch dtype names such as 'bfloat16' or 'float32'")
    return dtype


@dataclass
class ReceivedUpdate:
    """Tensors received from the trainer, validated, waiting to be copied in at a token boundary."""

    targets: list[Target]
    tensors: list[torch.Tensor]
    weight_version: str | None


class WeightUpdater:
    def __init__(self, model: torch.nn.Module) -> None:
        self.tensors: dict[str, torch.Tensor] = dict(model.state_dict())  # share storage with the model
        self.group_name: str | None = None
        self.group: Any = None  # the update process group (weight_sync/group.py), beside nothing else here

    # ---- process group ------------------------------------------------------------------------------------------
    def init_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> str:
        """Join the update group as rank `rank_offset` (blocks until every rank has joined)."""
        if backend != "gloo":
            raise WeightUpdateError(f"backend={backend!r}: the embedded engine runs on CPU; use backend 'gloo'")
        if self.group_name is not None:
            raise WeightUpdateError(
                f"this engine is already in update group {self.group_name!r}; call /destroy_weights_update_group first"
            )
        if not 0 < rank_offset < world_size:
            raise WeightUpdateError(
                f"rank_offset={rank_offset} must be in [1, world_size={world_size}) (rank 0 is the trainer)"
            )
        try:
            self.group = init_update_group(
                "gloo", master_address, master_port, world_size, rank_offset, group_name, GROUP_TIMEOUT_S
            )
        except (RuntimeError, ValueError) as e:  # the trainer never came, or the store refused us
            raise WeightUpdateError(
                f"could not join update group {group_name!r} at {master_address}:{master_port}: {e}"
            ) from e
        self.group_name = group_name
        return f"joined update group {group_name!r} as rank {rank_offset} of {world_size}"

    def destroy_group(self, group_name: str) -> str:
        if self.group_name != group_name:
            raise WeightUpdateError(f"no update group named {group_name!r} (current: {self.group_name!r})")
        destroy_update_group(self.group)
        self.group, self.group_name = None, None
        return f"destroyed update group {group_name!r}"

    # ---- receiving ----------------------------------------------------------------------------------------------
    def receive(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, weight_version: str | None
    ) -> ReceivedUpdate:
        """Receive every broadcast tensor; raise WeightUpdateError (after draining) when any does not fit the model."""
        if self.group_name is None or group_name != self.group_name:
            raise WeightUpdateError(
                f"group {group_name!r} is not initialized here (current: {self.group_name!r}); "
                f"call /init_weights_update_group first"
            )
        if not len(names) == len(dtypes) == len(shapes):
            raise WeightUpdateError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
        parsed = [parse_dtype(d) for d in dtypes]  # unknown dtypes cannot even be drained: fail before receiving
        problems: list[str] = []
        targets: list[Target] = []
        for name, dtype, shape in zip(names, parsed, shapes):
            problem, target = self._check(name, dtype, tuple(shape))
            if problem:
                problems.append(problem)
            targets.append(target)
        received = []
        for dtype, shape in zip(parsed, shapes):
            buf = torch.empty(shape, dtype=dtype)
            dist.broadcast(buf, src=0, group=self.group)
            received.append(buf)
        if problems:
            shown = "; ".join(problems[:8]) + (f"; ... {len(problems) - 8} more" if len(problems) > 8 else "")
            raise WeightUpdateError(f"update rejected, model unchanged: {shown}")
        return ReceivedUpdate(targets, received, weight_version)

    def _check(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[str | None, Target]:
        try:
            target = resolve(name, self.tensors)
        except KeyError:
            return f"{name}: no such weight in the model (send HF on-disk names)", Target(name)
        view = target.view(self.tensors)
        if tuple(view.shape) != shape:
            return f"{name}: shape {list(shape)} != model {list(view.shape)}", target
        if view.dtype != dtype:
            return f"{name}: dtype {dtype} != model {view.dtype} (cast on the trainer side)", target
        return None, target

    def get(self, name: str, truncate_size: int) -> list:
        """The first `truncate_size` rows of weight `name` (HF name) as float lists (SGLang's /get_weights_by_name)."""
        try:
            target = resolve(name, self.tensors)
        except KeyError:
            raise WeightUpdateError(f"{name}: no such weight in the model (HF on-disk names)") from None
        return target.view(self.tensors)[:truncate_size].float().tolist()

    def apply(self, update: ReceivedUpdate) -> None:
        """Copy a validated update into the model (called by the scheduler between forward passes)."""
        with torch.no_grad():
            for target, tensor in zip(update.targets, update.tensors):
                target.view(self.tensors).copy_(tensor)

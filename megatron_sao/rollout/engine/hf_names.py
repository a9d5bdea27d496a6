"""HF on-disk weight names -> the engine's in-memory tensors (owned by engine/; used by engine/weights.py).

HF checkpoints store MoE experts one by one (`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`, gate/up
[I, H], down [H, I]). transformers 5 fuses them in memory: `...mlp.experts.gate_up_proj` [num_experts, 2I, H]
(gate rows first, then up) and `...mlp.experts.down_proj` [num_experts, H, I]. Every other name is the same on disk
and in memory. `resolve()` maps one on-disk name to the in-memory tensor and the slice of it the name covers; the
trainer keeps sending on-disk names, whatever the engine's layout.

TODO(unify): one HF<->Megatron<->engine mapping for the whole project (a later session merges this one into it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class Target:
    """Where an on-disk tensor lives in memory: `tensors[key]`, optionally one expert and a row range of it."""

    key: str
    expert: int | None = None
    rows: tuple[int, int] | None = None  # [start, end) along dim 0 of the expert's matrix (gate/up halves)

    def view(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        t = tensors[self.key]
        if self.expert is not None:
            t = t[self.expert]
        if self.rows is not None:
            t = t[self.rows[0] : self.rows[1]]
        return t


def resolve(name: str, tensors: dict[str, torch.Tensor]) -> Target:
    """The in-memory Target of on-disk `name`; KeyError (with the name) when the model has no such weight."""
    if name in tensors:
        return Target(name)
    m = _EXPERT.match(name)
    if m is None:
        raise KeyError(name)
    prefix, expert, proj = m["prefix"], int(m["expert"]), m["proj"]
    if proj == "down_proj":
        key = f"{prefix}.down_proj"
        if key not in tensors or expert >= tensors[key].shape[0]:
            raise KeyError(name)
        return Target(key, expert)
    key = f"{prefix}.gate_up_proj"
    if key not in tensors or expert >= tensors[key].shape[0] or tensors[key].shape[1] % 2:
        raise KeyError(name)
    inter = tensors[key].shape[1] // 2
    rows = (0, inter) if proj == "gate_proj" else (inter, 2 * inter)
    return Target(key, expert, rows)


def on_disk_names(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every on-disk name the in-memory tensors cover, with its shape and dtype (the inverse of resolve)."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for key, t in tensors.items():
        if key.endswith(".experts.gate_up_proj") and t.ndim == 3:
            prefix, inter = key[: -len(".gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                for proj in ("gate_proj", "up_proj"):
                    out[f"{prefix}.{e}.{proj}.weight"] = ((inter, t.shape[2]), t.dtype)
        elif key.endswith(".experts.down_proj") and t.ndim == 3:
            prefix = key[: -len(".down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = (tuple(t.shape[1:]), t.dtype)
        else:
            out[key] = (tuple(t.shape), t.dtype)
    return out

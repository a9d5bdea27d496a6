"""HF on-disk names <-> the engine's in-memory (fused-expert) tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_sao.engines.embedded.model_runner import load_hf_model
from megatron_sao.models.mapping import on_disk_names, resolve_in_memory


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "glm_moe_dsa"])
def test_every_on_disk_tensor_resolves_to_its_in_memory_slice(family: str, tiny_dirs: dict[str, Path]) -> None:
    disk = load_file(str(tiny_dirs[family] / "model.safetensors"))
    tensors = dict(load_hf_model(tiny_dirs[family]).state_dict())
    assert any(k.endswith("experts.gate_up_proj") for k in tensors), "transformers no longer fuses experts?"
    for name, value in disk.items():
        view = resolve_in_memory(name, tensors).view(tensors)
        assert torch.equal(view, value), name
    listed = on_disk_names(tensors)
    assert set(listed) == set(disk)
    assert all(listed[n] == (tuple(v.shape), v.dtype) for n, v in disk.items())


def test_resolve_rejects_unknown_names_and_experts(tiny_dirs: dict[str, Path]) -> None:
    tensors = dict(load_hf_model(tiny_dirs["qwen3_moe"]).state_dict())
    for bad in ("model.layers.0.mlp.experts.99.gate_proj.weight", "model.layers.0.nope.weight", "lm_head.bias"):
        with pytest.raises(KeyError):
            resolve_in_memory(bad, tensors)


def test_gate_and_up_halves_are_disjoint_rows() -> None:
    tensors = {
        "m.experts.gate_up_proj": torch.arange(2 * 6 * 3.0).view(2, 6, 3),
        "m.experts.down_proj": torch.zeros(2, 3, 3),
    }
    gate = resolve_in_memory("m.experts.1.gate_proj.weight", tensors).view(tensors)
    up = resolve_in_memory("m.experts.1.up_proj.weight", tensors).view(tensors)
    assert torch.equal(torch.cat([gate, up]), tensors["m.experts.gate_up_proj"][1])
    gate.fill_(-1)  # views write through: this is how updates land in the fused tensor
    assert (tensors["m.experts.gate_up_proj"][1, :3] == -1).all() and (
        tensors["m.experts.gate_up_proj"][1, 3:] >= 0
    ).all()

"""The planner's tensor table against real models: the HF checkpoints' parameter counts (Qwen3-30B-A3B, GLM-5 on
the meta device), every canonical name and full shape of tiny megatron models of each family, and every rank's
element count at TP=2, EP=2 and an uneven PP=2 for the policy and the critic (trainable and frozen)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_sao.distributed import spawn_ranks
from megatron_sao.models.builder import ModelSpec
from megatron_sao.models.families import detect_family
from megatron_sao.plan.memory import Layout, local_numel, stage_tensors
from megatron_sao.plan.tensors import Architecture, hf_counts, model_tensors
from tests.plan.conftest import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = {"tp2": {"tensor": 2}, "ep2": {"expert": 2}, "pp2": {"pipeline": 2}}


def _arch(hf: dict[str, Any]) -> Architecture:
    return Architecture.from_spec(ModelSpec(family=detect_family(hf, None), hf=hf, dtype="bf16"))


@pytest.mark.parametrize("example", ["qwen3_30b", "glm_750b"])
def test_counts_match_transformers(example: str) -> None:
    """The HF model built on the meta device has exactly the planner's parameters (GLM's expert-score bias is a
    buffer in transformers, a tensor in the checkpoint), and the model cards' totals hold."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = json.loads((ROOT / "examples" / example / "hf_config.json").read_text())
    counts = hf_counts(_arch(hf))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf))
    expected = sum(p.numel() for p in model.parameters())
    expected += sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert counts.total == expected
    if example == "qwen3_30b":  # 30.5B total, 3.3B active
        assert round(counts.total / 1e9, 1) == 30.5 and round(counts.active / 1e9, 1) == 3.4
    else:  # 744B total, 40B active (without the embeddings, as GLM-5's card counts)
        assert round(counts.total / 1e9) == 744 and round(counts.active_without_embeddings / 1e9) == 40


def _built(hf_dir: str, layouts: dict[str, dict[str, int]]) -> dict[str, Any]:
    """On each rank, per layout and role: {canonical name: (full shape, local elements, trainable)}."""
    from megatron_sao.config import load_config
    from megatron_sao.distributed import destroy_distributed, init_distributed
    from megatron_sao.learner.roles import build_role
    from megatron_sao.models.shards import local_shards

    out: dict[str, Any] = {}
    for name, layout in layouts.items():
        overrides = ["--model.hf_path", hf_dir, "--model.dtype", "fp32",
                     "--launch.nproc_per_node", os.environ["WORLD_SIZE"]]  # fmt: skip
        for key, value in layout.items():
            overrides += [f"--parallel.{key}", str(value)]
        cfg = load_config(None, overrides)
        ctx = init_distributed(cfg.parallel)
        spec = ModelSpec.from_config(cfg.model)
        from megatron.core import parallel_state as ps

        for role, optim in (("policy", cfg.learner.policy), ("value", cfg.learner.value)):
            rm = build_role(
                spec, cfg.parallel, role, optim, tp_rank=ctx.tp_rank, total_steps=1, use_distributed_optimizer=True
            )
            shards = local_shards(rm.model, skip_replicas=False, copy=False)
            out[f"{name}/{role}"] = {s.name: (s.full_shape, s.tensor.numel()) for s in shards}
            out[f"{name}/{role}/numel"] = (
                rm.report.trainable_numel + rm.report.frozen_numel,
                rm.report.trainable_numel,
            )
            out[f"{name}/{role}/ranks"] = (ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank())
        destroy_distributed(keep_process_group=True)
    destroy_distributed()
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("family", [f if f == "glm_moe_dsa" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])  # fmt: skip
def test_names_shapes_and_shards_match_megatron(tiny: dict[str, Path], family: str) -> None:
    hf_dir = str(tiny[family])
    hf = json.loads((tiny[family] / "config.json").read_text())
    arch = _arch(hf)
    (single,) = spawn_ranks(_built, 1, hf_dir, {"one": {}})
    for role in ("policy", "value"):
        table = {t.name: t for t in model_tensors(arch, role, tensor_parallel=1, te_layout=False)}
        built = single[f"one/{role}"]
        assert sorted(table) == sorted(built), role
        for name, (shape, _) in built.items():
            assert table[name].shape == shape, name
    ranks = spawn_ranks(_built, 2, hf_dir, LAYOUTS)
    for layout_name, layout in LAYOUTS.items():
        from megatron_sao.config.parallel import ParallelConfig

        plan = Layout.of(ParallelConfig(**layout), 2, arch.num_layers)
        for rank, got in enumerate(ranks):
            for role in ("policy", "value"):
                pp_rank, ep_rank = got[f"{layout_name}/{role}/ranks"]
                tensors = model_tensors(arch, role, tensor_parallel=plan.tp, te_layout=False)
                held = stage_tensors(tensors, plan, pp_rank, tied_policy=arch.tied and role == "policy")
                predicted = sum(local_numel(t, plan, ep_rank, arch.experts) for t in held if not t.buffer)
                trainable = sum(local_numel(t, plan, ep_rank, arch.experts) for t in held if t.trainable(role))
                assert (predicted, trainable) == got[f"{layout_name}/{role}/numel"], (layout_name, rank, role)

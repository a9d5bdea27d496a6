"""The per-stage gathers reproduce the HF checkpoint exactly at every layout, each stage source holding only its
stage's tensors, with the extra memory of every rank within the plan's bound (two buckets + the largest tensor)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_sao.distributed import spawn_ranks
from tests.learner.test_learner_step import learner_config

BUCKET = 48_000  # bytes: small enough that every stage is cut into several buckets of several tensors


def _gather(hf_dir: str, layout: dict[str, int], bucket: int) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from megatron_sao.distributed import init_distributed
    from megatron_sao.learner.learner import Learner
    from megatron_sao.weight_sync import gather_hf_tensors, hf_dtype_of

    cfg = learner_config(hf_dir, layout, int(os.environ["WORLD_SIZE"]))
    ctx = init_distributed(cfg.parallel, seed=3)
    learner = Learner(cfg, roles={"policy"}, layout=ctx)
    learner.load_hf(hf_dir)
    dtype_of = hf_dtype_of(learner.hf_source, torch.float32)
    tensors, plan, peak = gather_hf_tensors(learner.policy.model, learner.spec, dtype_of, bucket, layout=ctx)
    stage = plan.stage_of(torch.distributed.get_rank())
    return {
        "tensors": tensors, "peak": peak, "bound": plan.memory_bound(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "source": stage.source, "stage_names": stage.hf_names, "buckets": [len(b.names) for b in stage.buckets],
        "groups": plan.gather_groups, "stage_ranks": {s.stage: s.ranks for s in plan.stages},
        "largest": plan.largest_tensor_bytes,
    }  # fmt: skip


LAYOUTS = [
    ("qwen3_moe", {"tensor": 2, "pipeline": 2}),
    ("glm4_moe", {"expert": 2, "pipeline": 2}),
    ("glm_moe_dsa", {"tensor": 2, "expert": 2}),
]


@pytest.mark.multiproc
@pytest.mark.parametrize(("family", "layout"), [
    pytest.param(f, lay, id=f"{f}-{'-'.join(map(str, lay.items()))}",
                 marks=[pytest.mark.slow] if f == "glm4_moe" else [])  # default tier: TP2xPP2 and TP2xEP2
    for f, lay in LAYOUTS])  # fmt: skip
def test_stage_gathers_reproduce_the_hf_checkpoint_within_the_memory_bound(
    tiny_hf_dir: Any, family: str, layout: dict[str, int]
) -> None:
    from megatron_sao.models.builder import ModelSpec
    from megatron_sao.models.weights import TIED_LM_HEAD, HFCheckpoint, is_passthrough

    hf_dir = str(tiny_hf_dir(family))
    per_rank = spawn_ranks(_gather, 4, hf_dir, layout, BUCKET, timeout_s=400)
    hf, spec = HFCheckpoint(hf_dir), ModelSpec.from_hf_dir(hf_dir)
    want = {n for n in hf.names() if not is_passthrough(spec, n)} - ({TIED_LM_HEAD} if spec.tie_embeddings else set())
    got: dict[str, torch.Tensor] = {}
    sources = {r["source"] for r in per_rank}
    for rank, r in enumerate(per_rank):
        if rank not in sources:
            assert r["tensors"] == {}, "only stage sources end up with tensors"
            continue
        assert set(r["tensors"]) == set(r["stage_names"]), "a source sends exactly its own stage's tensors"
        assert not set(r["tensors"]) & set(got), "two stages sent the same tensor"
        got.update(r["tensors"])
    assert set(got) == want
    for name, tensor in got.items():
        ref = hf.get(name)
        assert tensor.dtype == ref.dtype and tensor.shape == ref.shape and torch.equal(tensor, ref), name
    stage_ranks = per_rank[0]["stage_ranks"]
    assert len(sources) == len(stage_ranks) == layout.get("pipeline", 1)
    for members in per_rank[0]["groups"]:  # no gather reaches outside its stage
        assert any(set(members) <= set(ranks) for ranks in stage_ranks.values()), members
    for r in per_rank:
        assert r["peak"] <= r["bound"], (r["peak"], r["bound"])
    src = per_rank[min(sources)]
    assert max(src["buckets"]) > 1 and len(src["buckets"]) > 3, src["buckets"]  # several buckets of several tensors
    assert src["peak"] > BUCKET, "the source held at least one bucket (the meter counts)"


def _mixed_dtypes(hf_dir: str) -> dict[str, Any]:
    """Two ranks of one stage hold pieces of a bf16 norm (rank 0 an odd 3 elements) and of an fp32 expert bias: the
    source receives rank 1's contribution right after rank 0's padded one."""
    import json

    import torch.distributed as dist

    from megatron_sao.models.builder import ModelSpec
    from megatron_sao.models.weights import weight_mapping
    from megatron_sao.weight_sync.gather import StageGather, collect
    from megatron_sao.weight_sync.plan import Piece, RankInfo, build_plan

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    hf = json.loads((Path(hf_dir) / "config.json").read_text())
    hidden, experts = int(hf["hidden_size"]), int(hf["n_routed_experts"])
    norm = torch.randn(hidden, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    bias = torch.randn(experts, generator=torch.Generator().manual_seed(2))
    cut = {"decoder.final_layernorm.weight": (norm, 3), "decoder.layers.1.mlp.router.expert_bias": (bias, 1)}
    pieces = []
    for name, (full, at) in cut.items():
        lo, hi = (0, at) if rank == 0 else (at, full.shape[0])
        dtype = str(full.dtype).removeprefix("torch.")
        pieces.append((Piece(rank, name, tuple(full.shape), (lo,), (hi - lo,), dtype), full[lo:hi].clone()))
    infos: list[Any] = [None, None]
    dist.all_gather_object(infos, RankInfo(rank, 0, "h", tuple(p for p, _ in pieces)))
    mapping = weight_mapping(ModelSpec.from_hf_dir(hf_dir))
    hf_dtype = {"model.norm.weight": torch.bfloat16}
    plan = build_plan(infos, mapping, lambda n: hf_dtype.get(n, torch.float32), 1 << 20)
    groups = {m: dist.new_group(list(m)) for m in plan.gather_groups}
    gather = StageGather(plan.stage_of(rank), rank, pieces, groups, mapping, torch.device("cpu"))
    got = collect(gather)
    bucket = plan.stages[0].buckets[0]
    return {"got": got, "norm": norm, "bias": bias, "offsets": bucket.receive_offsets}


@pytest.mark.multiproc
def test_a_float32_piece_after_an_odd_bf16_contribution_is_gathered_aligned(tiny_hf_dir: Any) -> None:
    source, _ = spawn_ranks(_mixed_dtypes, 2, str(tiny_hf_dir("glm4_moe")), timeout_s=200)
    assert all(at % 4 == 0 for at in source["offsets"].values())
    assert torch.equal(source["got"]["model.norm.weight"], source["norm"])
    assert torch.equal(source["got"]["model.layers.1.mlp.gate.e_score_correction_bias"], source["bias"])

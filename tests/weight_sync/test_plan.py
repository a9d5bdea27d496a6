"""The transfer plan's buckets (weight_sync/plan.py), from made-up shard metadata: expert buckets fill to the budget
when the stage source holds none of them (no padded row for the source), and every
contribution lands at an aligned offset of the source's receive area."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from megatron_sao.models.builder import ModelSpec
from megatron_sao.models.weights import weight_mapping
from megatron_sao.weight_sync.plan import Piece, RankInfo, build_plan


def test_expert_buckets_are_full_when_the_source_holds_no_expert(tiny_hf_dir: Any) -> None:
    hf_dir = tiny_hf_dir("glm4_moe")
    hf = json.loads((Path(hf_dir) / "config.json").read_text())
    experts, hidden, ffn = int(hf["n_routed_experts"]), int(hf["hidden_size"]), int(hf["moe_intermediate_size"])
    mapping = weight_mapping(ModelSpec.from_hf_dir(hf_dir))
    shapes = {"linear_fc1": (2 * ffn, hidden), "linear_fc2": (hidden, ffn)}
    pieces: dict[int, list[Piece]] = {0: [], 1: [], 2: []}
    for e in range(experts):  # ranks 1 and 2 hold half the experts each (EP=2); the source, rank 0, none
        for fc, shape in shapes.items():
            name = f"decoder.layers.1.mlp.experts.local_experts.{e}.{fc}.weight"
            pieces[1 + e % 2].append(Piece(1 + e % 2, name, shape, (0, 0), shape, "bfloat16"))
    one = sum(math.prod(s) * 2 for s in shapes.values())  # one expert's bytes
    budget = 2 * one
    infos = [RankInfo(r, 0, "h", tuple(ps)) for r, ps in pieces.items()]
    plan = build_plan(infos, mapping, lambda n: torch.bfloat16, budget)
    buckets = plan.stages[0].buckets
    # each expert lives on one EP rank: one gather group per holder with the source, (0, 1) and (0, 2)
    assert {b.members for b in buckets} == {(0, 1), (0, 2)}
    for members in ((0, 1), (0, 2)):
        held = sum(1 for e in range(experts) if 1 + e % 2 == members[1])
        mine = [b for b in buckets if b.members == members]
        assert len(mine) == math.ceil(held * one / budget), [len(b.names) for b in mine]  # full, not half empty
    for b in buckets:
        assert b.received_bytes <= budget and b.send_bytes <= budget
        assert all(at % 16 == 0 for at in b.receive_offsets.values())
        assert 0 not in b.receive_offsets, "the source receives nothing from itself"

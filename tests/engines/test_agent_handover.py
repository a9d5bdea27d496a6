"""What a push agent hands each engine rank (engines/agent/handover.py): SGLang's expert placement under --ep-size,
the blocks of an embedded engine's /weight_shards, EPLB refused, and handover calls that keep a module together."""

from __future__ import annotations

import pytest
import torch

from megatron_sao.engines.agent.handover import HandoverError, expert_ranks, parts, plan_handover


def _table(experts: int = 8) -> dict[str, torch.Tensor]:
    meta = {"model.embed_tokens.weight": (64, 16), "model.layers.0.self_attn.q_proj.weight": (16, 16),
            "model.layers.0.mlp.gate.weight": (experts, 16)}  # fmt: skip
    for e in range(experts):
        for proj in ("gate_proj", "up_proj"):
            meta[f"model.layers.0.mlp.experts.{e}.{proj}.weight"] = (8, 16)
            meta[f"model.layers.0.mlp.experts.{e}.{proj}.weight_scale_inv"] = (1, 1)
        meta[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = (16, 8)
    return {n: torch.empty(s, device="meta") for n, s in meta.items()}


def test_sglang_ranks_store_contiguous_experts_by_their_expert_parallel_rank() -> None:
    # SGLang's parallel state: moe_tp_size = tp / ep, moe_ep_rank = tp_rank // moe_tp_size
    assert expert_ranks({"tp_size": 4, "ep_size": 4}, 8) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert expert_ranks({"tp_size": 4, "ep_size": 2}, 8) == [range(0, 4), range(0, 4), range(4, 8), range(4, 8)]
    assert expert_ranks({"tp_size": 4}, 8) == [range(0, 8)] * 4
    with pytest.raises(HandoverError, match="EPLB"):
        expert_ranks({"tp_size": 4, "ep_size": 4, "ep_num_redundant_experts": 4}, 8)
    with pytest.raises(HandoverError, match="EPLB"):
        expert_ranks({"tp_size": 4, "ep_size": 4, "init_expert_location": "/x.json"}, 8)
    with pytest.raises(HandoverError, match="divides"):
        expert_ranks({"tp_size": 4, "ep_size": 4}, 6)


def test_hf_handover_sends_dense_tensors_whole_and_each_rank_only_its_experts() -> None:
    table = _table()
    h = plan_handover("auto", {"tp_size": 4, "ep_size": 4}, table, None, 8)
    assert h.mode == "hf" and h.load_format is None
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.gate.weight",
    ):
        assert all(h.box(name, r) is None for r in range(4)), name  # whole: SGLang's loader slices dense tensors
    for e in range(8):
        for suffix in ("gate_proj.weight", "gate_proj.weight_scale_inv", "down_proj.weight"):
            name = f"model.layers.0.mlp.experts.{e}.{suffix}"
            held = [r for r in range(4) if h.box(name, r) is None]
            assert held == [e // 2], (name, held)  # the rest get a block of zero elements
            assert all(torch.Size(h.box(name, r)[1]).numel() == 0 for r in range(4) if r != e // 2)
    shards = h.weight_shards()
    assert shards["tp_size"] == 4 and len(shards["shards"]) == 8 * 5
    # without expert parallelism every rank takes every tensor whole
    assert plan_handover("hf", {"tp_size": 4}, table, None, 8).boxes == {}


def test_direct_handover_takes_the_engines_own_blocks_and_needs_them() -> None:
    shards = {"tp_size": 2, "shards": {"model.layers.0.self_attn.q_proj.weight": [[[0, 0], [8, 16]], [[8, 0], [8, 16]]],
                                       "model.embed_tokens.weight": [None, None]}}  # fmt: skip
    h = plan_handover("auto", {"tp_size": 2}, _table(), shards, 8)
    assert h.mode == "direct" and h.load_format == "direct"
    assert h.box("model.layers.0.self_attn.q_proj.weight", 1) == ((8, 0), (8, 16))
    assert h.box("model.embed_tokens.weight", 0) is None and h.box("model.norm.weight", 0) is None
    with pytest.raises(HandoverError, match="no /weight_shards"):
        plan_handover("direct", {"tp_size": 2}, _table(), None, 8)
    with pytest.raises(HandoverError, match="tp_size 2"):
        plan_handover("direct", {"tp_size": 4}, _table(), shards, 8)


def test_handover_calls_are_as_many_for_every_rank_and_keep_a_weight_with_its_scale() -> None:
    rank0 = [(f"l.{i}.w.weight", 100) for i in range(10)] + [(f"l.{i}.w.weight_scale_inv", 1) for i in range(10)]
    rank1 = [("l.0.w.weight", 100)]
    calls = parts([rank0, rank1], limit_bytes=250)
    assert len(calls) == 5  # rank 0's 1010 bytes over 250 a call
    assert all(len(call) == 2 for call in calls)
    flat0 = [n for call in calls for n in call[0]]
    assert sorted(flat0) == sorted(n for n, _ in rank0) and [n for c in calls for n in c[1]] == ["l.0.w.weight"]
    for call in calls:
        for name in call[0]:
            if name.endswith(".weight"):
                assert name + "_scale_inv" in call[0], (name, call[0])
    assert parts([[], []], 10) == [[[], []]]

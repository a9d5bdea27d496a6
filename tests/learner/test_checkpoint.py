"""Learner checkpoints: bit-exact resume at the same layout; save at one layout, load at another, continue
with the same losses and parameters as an uninterrupted run."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_sao.distributed import spawn_ranks
from megatron_sao.learner.synthetic import make_batch
from tests.learner.test_learner_step import learner_config, on_policy

KEYS = ("loss/value_first", "loss/value", "value/grad_norm", "loss/policy", "policy/grad_norm")


def _continue(learner, batches) -> list[dict[str, float]]:
    return [{k: m[k] for k in KEYS} for m in (learner.train_step(b) for b in batches)]


def _save_then_resume(hf_dir: str, batches, ckpt: str, layouts: dict, dtype: str, extra: tuple = ()) -> dict:
    from megatron_sao.distributed import destroy_distributed, init_distributed
    from megatron_sao.learner.checkpoint import load_checkpoint, save_checkpoint
    from megatron_sao.learner.learner import Learner
    from megatron_sao.models.shards import local_shards

    world = int(os.environ["WORLD_SIZE"])
    cfg = learner_config(hf_dir, {}, world, dtype, extra=extra)
    ctx = init_distributed(cfg.parallel, seed=5)
    learner = Learner(cfg, layout=ctx)
    learner.load_hf(hf_dir)
    start = {"policy": local_shards(learner.policy.model), "value": local_shards(learner.value.model)}
    learner.train_step(batches[0])
    save_checkpoint(learner, ckpt, extra={"bus": {"watermark": 7}, "cursor": 3})
    out = {"uninterrupted": _continue(learner, batches[1:]), "shards": {}}
    out["roles"] = {"start": start, "end": {"policy": local_shards(learner.policy.model),
                                            "value": local_shards(learner.value.model)}}  # fmt: skip
    out["shards"]["uninterrupted"] = local_shards(learner.policy.model) + local_shards(learner.value.model)
    destroy_distributed(keep_process_group=True)
    for name, layout in layouts.items():
        cfg = learner_config(hf_dir, layout, world, dtype, extra=extra)
        ctx = init_distributed(cfg.parallel, seed=99)  # another seed: everything must come from the checkpoint
        learner = Learner(cfg, layout=ctx)
        saved_extra = load_checkpoint(learner, ckpt)
        out[name] = {"extra": saved_extra, "version": learner.version, "metrics": _continue(learner, batches[1:])}
        out["shards"][name] = local_shards(learner.policy.model) + local_shards(learner.value.model)
        destroy_distributed(keep_process_group=True)
    return out


def _full(per_rank: list[dict], name: str) -> dict[str, torch.Tensor]:
    from megatron_sao.models.shards import assemble

    policy_value = []
    for r in per_rank:
        policy_value += r["shards"][name]
    return assemble(policy_value)


@pytest.mark.multiproc
def test_resume_is_bit_exact_at_the_same_layout_and_close_at_others(tiny_hf_dir, tmp_path):
    hf_dir = str(tiny_hf_dir("qwen3_moe"))
    batches = [on_policy(make_batch(6, seed=s), hf_dir, seed=s) for s in (11, 12, 13)]
    layouts = {"same": {}, "tp2_sp": {"tensor": 2}, "ep2": {"expert": 2}, "pp2": {"pipeline": 2}}
    per_rank = spawn_ranks(_save_then_resume, 2, hf_dir, batches, str(tmp_path / "ckpt"), layouts, "fp32",
                           timeout_s=600)  # fmt: skip
    ref = per_rank[0]["uninterrupted"]
    for rank in per_rank:
        assert rank["same"]["metrics"] == ref  # bitwise
        assert rank["same"]["extra"] == {"bus": {"watermark": 7}, "cursor": 3}
        assert rank["same"]["version"] == 1
    uninterrupted = _full(per_rank, "uninterrupted")
    same = _full(per_rank, "same")
    assert all(torch.equal(uninterrupted[n], same[n]) for n in uninterrupted)
    for layout in ("tp2_sp", "ep2", "pp2"):
        for step, (got, want) in enumerate(zip(per_rank[1][layout]["metrics"], ref)):
            for key in KEYS:
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (layout, step, key)
        full = _full(per_rank, layout)
        worst = max(float((full[n] - uninterrupted[n]).abs().max()) for n in uninterrupted)
        assert worst < 1e-6, (layout, worst)


@pytest.mark.multiproc
def test_a_policy_that_trains_its_top_layer_only_saves_and_resumes_at_another_pipeline_split(tiny_hf_dir, tmp_path):
    """Trainable patterns name layers globally (`decoder.layers.1.*` is the top layer whatever the pipeline split);
    the optimizer state of a role that trains some layers' attention and not others' covers part of each
    layer-stacked tensor and is checkpointed per layer, so the save is accepted and a PP=2 resume continues the run
    (examples/smollm2_tools trains its top layers only)."""
    hf_dir = str(tiny_hf_dir("qwen3"))
    batches = [on_policy(make_batch(6, seed=s), hf_dir, seed=s) for s in (11, 12)]
    top = ("--learner.policy.trainable", '["decoder.layers.1.*", "decoder.layers.0.mlp.*"]',
           "--learner.value.trainable",
           '["decoder.layers.1.mlp.*", "decoder.layers.0.mlp.linear_fc2.*", "output_layer.*"]')  # fmt: skip
    per_rank = spawn_ranks(_save_then_resume, 2, hf_dir, batches, str(tmp_path / "ckpt"), {"pp2": {"pipeline": 2}},
                           "fp32", top, timeout_s=600)  # fmt: skip
    ref = per_rank[0]["uninterrupted"]
    for step, (got, want) in enumerate(zip(per_rank[1]["pp2"]["metrics"], ref)):
        for key in KEYS:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (step, key)
    uninterrupted, pp2 = _full(per_rank, "uninterrupted"), _full(per_rank, "pp2")
    assert max(float((pp2[n] - uninterrupted[n]).abs().max()) for n in uninterrupted) < 1e-6
    from megatron_sao.models.shards import assemble

    for role, trained in (("policy", ("layers.1.", "layers.0.mlp.")),
                          ("value", ("layers.1.mlp.", "layers.0.mlp.linear_fc2", "output_layer."))):  # fmt: skip
        start, end = (assemble([s for r in per_rank for s in r["roles"][when][role]]) for when in ("start", "end"))
        moved = {n for n in end if not torch.equal(end[n], start[n])}
        expected = {n for n in end if any(t in n for t in trained) and (role == "policy" or "norm" not in n)}
        assert moved == expected, (role, sorted(moved))  # the value role's norms stay frozen by default


def test_loading_a_checkpoint_of_another_model_is_refused(tmp_path):
    from megatron_sao.learner.checkpoint import CheckpointError, resolve_checkpoint

    with pytest.raises(CheckpointError, match="not a megatron dist checkpoint"):
        resolve_checkpoint(tmp_path)


def _hf_source_through_loads(hf_dir: str, root: str) -> dict:
    from megatron_sao.distributed import destroy_distributed, init_distributed
    from megatron_sao.learner.checkpoint import CheckpointError, load_checkpoint, load_pretrained, save_checkpoint
    from megatron_sao.learner.learner import Learner
    from megatron_sao.models.checkpoint import read_hf_source

    cfg = learner_config(hf_dir, {}, int(os.environ["WORLD_SIZE"]), "bf16")
    out = {}
    for how in ("load_hf", "load_checkpoint", "load_pretrained"):
        ctx = init_distributed(cfg.parallel, seed=5)
        learner = Learner(cfg, layout=ctx)
        if how == "load_hf":
            learner.load_hf(hf_dir)
        elif how == "load_checkpoint":
            load_checkpoint(learner, f"{root}/load_hf")
        else:
            load_pretrained(learner, f"{root}/load_hf")
        path = save_checkpoint(learner, f"{root}/{how}")
        out[how] = read_hf_source(path)
        if how == "load_hf":
            try:  # rank 0 refuses; every rank must raise instead of waiting in a barrier
                save_checkpoint(learner, f"{root}/{how}")
            except CheckpointError as e:
                out["refused"] = str(e)
        destroy_distributed(keep_process_group=True)
    return out


@pytest.mark.multiproc
def test_hf_origin_survives_every_load_and_a_refused_save_raises_on_every_rank(tmp_path):
    from megatron_sao.models.tiny import make_tiny_model

    hf_dir = str(make_tiny_model("glm4_moe", tmp_path / "hf", dtype="bf16", seed=2))
    per_rank = spawn_ranks(_hf_source_through_loads, 2, hf_dir, str(tmp_path / "ckpt"), timeout_s=300)
    record = per_rank[0]["load_hf"]
    assert record["hf_dtype"] == "bfloat16" and record["hf_dtype_exceptions"]  # the fp32 router and its bias
    for rank in per_rank:
        assert rank["load_checkpoint"] == record
        assert rank["load_pretrained"] == record
        assert "already holds a checkpoint" in rank["refused"]


def test_a_checkpoint_of_other_experts_is_refused_by_name_and_another_algorithm_is_said(caplog) -> None:
    """_check_compatible: every weight-shaping config key (experts included) must match, named in one line; a
    checkpoint trained with another algo.name resumes with a warning saying so."""
    import logging
    from pathlib import Path
    from types import SimpleNamespace

    from megatron_sao.learner.checkpoint import CheckpointError, _check_compatible

    hf = {"num_hidden_layers": 2, "hidden_size": 64, "num_experts": 8}
    learner = SimpleNamespace(spec=SimpleNamespace(family=SimpleNamespace(name="qwen3_moe"), hf=hf),
                              cfg=SimpleNamespace(algo=SimpleNamespace(name="grpo")))  # fmt: skip
    saved = {"model": {"family": "qwen3_moe", "hf_config": {**hf, "num_experts": 4}}, "algo": "grpo"}
    with pytest.raises(CheckpointError, match=r"num_experts 4 \(saved\) != 8 \(this model\)"):
        _check_compatible(learner, saved, Path("/ckpt"))
    with caplog.at_level(logging.WARNING, logger="megatron_sao.learner.checkpoint"):
        _check_compatible(learner, {"model": {"family": "qwen3_moe", "hf_config": hf}, "algo": "sao"}, Path("/c"))
    assert "trained with algo.name=sao; resuming it as grpo" in caplog.text


def test_pruning_keeps_the_newest_checkpoints_and_never_latest(tmp_path) -> None:
    from megatron_sao.config import ConfigError, load_config
    from megatron_sao.learner.checkpoint import LATEST, prune_checkpoints

    for v in (2, 4, 6, 8):
        (tmp_path / f"iter_{v:07d}").mkdir()
    (tmp_path / "pretrain_0000003").mkdir()
    (tmp_path / "iter_0000008.partial").mkdir()
    (tmp_path / LATEST).write_text("iter_0000004\n")  # a resume went back to 4: latest is kept whatever its age
    gone = prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in gone) == ["iter_0000002"]
    left = ["iter_0000004", "iter_0000006", "iter_0000008", "iter_0000008.partial", "latest", "pretrain_0000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == left
    with pytest.raises(ConfigError, match="learner.keep_checkpoints=1 is fewer than"):
        load_config(None, ["--learner.keep_checkpoints", "1", "--learner.fallback_checkpoints", "1"])

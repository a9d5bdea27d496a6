"""Start from an HF model converted with tools/convert_hf_to_megatron.py, train, and ship HF weights back with
tools/convert_megatron_to_hf.py: the learner's checkpoints are the converters' format."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_sao.distributed import spawn_ranks
from megatron_sao.learner.synthetic import make_batch
from tests.learner.test_learner_step import learner_config, on_policy


def _pretrained_train_save(hf_dir: str, converted: str, save_dir: str, trajectories) -> dict:
    from megatron_sao.distributed import init_distributed
    from megatron_sao.learner.batch import make_step_batch
    from megatron_sao.learner.checkpoint import load_pretrained, save_checkpoint
    from megatron_sao.learner.forward import collect_logprobs
    from megatron_sao.learner.learner import Learner
    from megatron_sao.learner.packing import pack_microbatches
    from megatron_sao.models.shards import local_shards

    cfg = learner_config(hf_dir, {"tensor": 2}, int(os.environ["WORLD_SIZE"]))
    ctx = init_distributed(cfg.parallel, seed=2)
    learner = Learner(cfg, layout=ctx)
    load_pretrained(learner, converted)
    batch = make_step_batch(trajectories, 4096)
    mbs = pack_microbatches(batch, 64, pad_multiple=2, use_thd=False)
    logp = torch.zeros_like(batch.rollout_logprobs)
    with torch.no_grad():
        collect_logprobs(
            learner.policy.ddp, mbs, logp, temperature=1.0, vocab_size=learner.spec.vocab_size, tp_rank=ctx.tp_rank
        )
    value_embedding = local_shards(learner.value.model)
    learner.train_step(trajectories)
    path = save_checkpoint(learner, save_dir)
    return {"logp": logp, "value_start": value_embedding, "policy_end": local_shards(learner.policy.model),
            "path": str(path)}  # fmt: skip


@pytest.mark.multiproc
def test_converted_hf_weights_train_and_convert_back(tiny_hf_dir, tmp_path):
    from safetensors.torch import load_file

    from megatron_sao.convert.hf_to_megatron import convert_hf_to_megatron
    from megatron_sao.convert.megatron_to_hf import convert_megatron_to_hf
    from megatron_sao.models.shards import assemble
    from megatron_sao.models.weights import HFCheckpoint

    hf_dir = str(tiny_hf_dir("qwen3_moe"))
    converted = convert_hf_to_megatron(hf_dir, tmp_path / "converted", dtype="fp32", progress=False)
    trajectories = on_policy(make_batch(4, seed=21), hf_dir, noise=0.0)
    per_rank = spawn_ranks(_pretrained_train_save, 2, hf_dir, str(converted), str(tmp_path / "run"), trajectories,
                           timeout_s=400)  # fmt: skip
    # TP=2 policy loaded from the converted checkpoint reproduces transformers' log-probs (on_policy, no noise).
    want = torch.zeros_like(per_rank[0]["logp"])
    for i, t in enumerate(trajectories):
        n = t.header.num_tokens - 1
        want[i, :n] = torch.from_numpy(t.rollout_logprobs[1:]) * torch.from_numpy(t.action_mask[1:])
    mask = torch.zeros_like(want, dtype=torch.bool)
    for i, t in enumerate(trajectories):
        mask[i, : t.header.num_tokens - 1] = torch.from_numpy(t.action_mask[1:])
    assert torch.allclose(per_rank[0]["logp"][mask], want[mask], atol=1e-5)
    # The critic's backbone started from the policy's weights; its head is its own.
    value_start = assemble([s for r in per_rank for s in r["value_start"]])
    hf = HFCheckpoint(hf_dir)
    assert torch.equal(value_start["embedding.word_embeddings.weight"][:512], hf.get("model.embed_tokens.weight"))
    assert value_start["output_layer.weight"].shape[0] == 1
    # The trained policy converts back to HF: the tensors equal the learner's parameters after the step.
    out = convert_megatron_to_hf(per_rank[0]["path"], tmp_path / "hf_out", hf_dir, progress=False)
    shipped = load_file(str(next(out.glob("*.safetensors"))))
    trained = assemble([s for r in per_rank for s in r["policy_end"]])
    assert torch.equal(shipped["model.norm.weight"], trained["decoder.final_layernorm.weight"])
    assert torch.equal(shipped["lm_head.weight"], trained["output_layer.weight"][:512])
    assert not torch.equal(shipped["lm_head.weight"], hf.get("lm_head.weight"))  # it did train
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()


@pytest.mark.multiproc
def test_a_checkpoint_of_another_family_is_refused(tiny_hf_dir, tmp_path):
    from megatron_sao.convert.hf_to_megatron import convert_hf_to_megatron

    converted = convert_hf_to_megatron(str(tiny_hf_dir("glm4_moe")), tmp_path / "glm", dtype="fp32", progress=False)
    out = spawn_ranks(_load_foreign, 1, str(tiny_hf_dir("qwen3_moe")), str(converted), timeout_s=200)
    assert "glm4_moe" in out[0] and "qwen3_moe" in out[0]


def _load_foreign(hf_dir: str, converted: str) -> str:
    from megatron_sao.distributed import init_distributed
    from megatron_sao.learner.checkpoint import CheckpointError, load_pretrained
    from megatron_sao.learner.learner import Learner

    cfg = learner_config(hf_dir, {}, 1)
    ctx = init_distributed(cfg.parallel)
    learner = Learner(cfg, layout=ctx)
    try:
        load_pretrained(learner, converted)
    except CheckpointError as e:
        return str(e)
    return "loaded"

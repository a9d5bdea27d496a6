"""The four ablation switches of experiments/ablations.py act on the learner step, each on its own mechanism only:
plain IS (algo.dis.mask=false), K=1, a trainable critic attention (learner.value.frozen), GAE through observation
tokens (algo.gae.skip_observations=false)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_sao.algo import gae_span
from megatron_sao.distributed import spawn_ranks
from megatron_sao.learner.synthetic import make_batch

from .test_learner_step import learner_config, on_policy

VARIANTS = {
    "sao": [],
    "plain_is": ["--algo.dis.mask", "false"],
    "k1": ["--algo.value.updates_per_policy_step", "1"],
    "critic_attention": [
        "--learner.value.trainable",
        '["*.mlp.experts.*", "*.mlp.shared_experts.*", "*.mlp.linear_fc*", "*.self_attention.*", "output_layer.*"]',
        "--learner.value.frozen",
        '["*.router.*", "*norm*", "embedding.*"]',
    ],
    "gae_through_observations": ["--algo.gae.skip_observations", "false"],
}


def _one_step_per_variant(hf_dir: str, trajectories, variants: dict[str, list[str]]) -> dict:
    from megatron_sao.config import load_config
    from megatron_sao.distributed import destroy_distributed, init_distributed
    from megatron_sao.learner.learner import Learner

    base = learner_config(hf_dir, {}, 1)
    out = {}
    for name, extra in variants.items():
        cfg = load_config(None, [*_as_overrides(base), *extra])
        ctx = init_distributed(cfg.parallel, seed=5)
        learner = Learner(cfg, layout=ctx)
        learner.load_hf(hf_dir)
        value_before = {n: p.detach().clone() for n, p in learner.value.model.named_parameters()}
        metrics = learner.train_step(trajectories)
        out[name] = {
            "metrics": metrics,
            "policy": {n: p.detach().clone() for n, p in learner.policy.model.named_parameters()},
            "value": {n: p.detach().clone() for n, p in learner.value.model.named_parameters()},
            "attention_moved": max(
                float((value_before[n] - p).abs().max())
                for n, p in learner.value.model.named_parameters()
                if ".self_attention." in n
            ),
            "value_optimizer_steps": learner.value.optimizer_steps,
        }
        destroy_distributed(keep_process_group=True)
    return out


def _as_overrides(cfg) -> list[str]:
    """The fields the shared test config sets, as command-line overrides (so each variant adds its own)."""
    return [
        "--model.hf_path", cfg.model.hf_path, "--launch.nproc_per_node", "1",
        "--learner.max_tokens_per_microbatch", str(cfg.learner.max_tokens_per_microbatch),
        "--learner.policy.lr", str(cfg.learner.policy.lr), "--learner.policy.adam_eps", "1.0",
        "--learner.value.lr", str(cfg.learner.value.lr), "--learner.value.adam_eps", "1.0",
        "--learner.value.warmup_steps", "0",
    ]  # fmt: skip


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.multiproc
def test_each_ablation_switch_changes_its_own_mechanism_only(tiny_hf_dir):
    hf_dir = str(tiny_hf_dir("qwen3_moe"))
    # noisy rollout log-probs: a good share of the tokens leave the DIS band on the low side
    trajectories = on_policy(make_batch(4, seed=11), hf_dir, noise=0.6, seed=2)
    masks = [torch.from_numpy(t.action_mask)[None] for t in trajectories]
    assert any(gae_span(m).sum() > m.sum() for m in masks), "no observation tokens between turns"
    r = spawn_ranks(_one_step_per_variant, 1, hf_dir, trajectories, VARIANTS, timeout_s=400)[0]
    sao = r["sao"]
    assert sao["metrics"]["dis/masked_frac"] > 0.05, "the batch leaves too few tokens out of the band to test DIS"
    assert sao["value_optimizer_steps"] == 2 and sao["attention_moved"] == 0.0

    # plain IS: nothing masked, another policy update; the critic (updated before the policy) is untouched
    plain = r["plain_is"]
    assert plain["metrics"]["dis/masked_frac"] == 0.0
    assert not _same(plain["policy"], sao["policy"]) and _same(plain["value"], sao["value"])
    assert plain["metrics"]["dis/logprob_abs_diff"] == pytest.approx(sao["metrics"]["dis/logprob_abs_diff"])

    # K = 1: one critic step; the policy's advantages come from the values before the critic steps, so it agrees
    k1 = r["k1"]
    assert k1["value_optimizer_steps"] == 1 and k1["metrics"]["value/updates"] == 1.0
    assert not _same(k1["value"], sao["value"]) and _same(k1["policy"], sao["policy"])

    # a trainable critic attention moves
    assert r["critic_attention"]["attention_moved"] > 0.0
    assert _same(r["critic_attention"]["policy"], sao["policy"])

    # GAE through the observations: other advantages and other critic targets
    through = r["gae_through_observations"]
    assert not _same(through["policy"], sao["policy"]) and not _same(through["value"], sao["value"])
    assert math.isfinite(through["metrics"]["loss/value"])

"""The critic's start and its honest figures: a zero head whose bias becomes the first batch's mean return, a
warm-up whose first step already moves the weights (and the lr logged is the one applied), the explained variance
of the values GAE used (before the batch's first critic update), and whitening over the whole step."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from megatron_sao.distributed import spawn_ranks
from megatron_sao.learner.synthetic import make_batch
from tests.learner.test_learner_step import _assembled, _compare, learner_config, on_policy


def test_a_zero_head_returns_its_bias() -> None:
    from megatron_sao.models.value_head import ValueHead

    head = ValueHead(SimpleNamespace(sequence_parallel=False, hidden_size=16, params_dtype=torch.float32))
    assert torch.count_nonzero(head.weight) == 0 and torch.count_nonzero(head.bias) == 0
    with torch.no_grad():
        head.bias.fill_(0.37)
    values, _ = head(torch.randn(5, 2, 16))
    assert values.shape == (5, 2, 1)
    torch.testing.assert_close(values, torch.full((5, 2, 1), 0.37))


@pytest.mark.parametrize("warmup", [0, 1, 2, 10])
def test_warm_up_starts_at_lr_over_warmup_steps_and_reaches_the_peak(warmup: int) -> None:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_sao.config.learner import RoleOptimConfig
    from megatron_sao.learner.roles import warmup as warmup_of

    optim = RoleOptimConfig(lr=0.5, warmup_steps=warmup)
    init_lr, ramp = warmup_of(optim)
    holder = SimpleNamespace(param_groups=[{"lr": 0.0}])
    scheduler = OptimizerParamScheduler(holder, init_lr=init_lr, max_lr=0.5, min_lr=0.0, lr_warmup_steps=ramp,
                                        lr_decay_steps=100, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=100, wd_incr_style="constant")  # fmt: skip
    seen = []
    for _ in range(max(warmup, 1) + 2):
        seen.append(holder.param_groups[0]["lr"])
        scheduler.step(1)
    w = max(warmup, 1)
    expected = [0.5 * min(k + 1, w) / w for k in range(w + 2)]
    assert seen == pytest.approx(expected)
    assert seen[0] > 0


def _critic_steps(hf_dir: str, first, second) -> dict[str, Any]:
    from megatron_sao.algo import compute_step_targets, explained_variance, token_rewards
    from megatron_sao.distributed import init_distributed
    from megatron_sao.learner.forward import collect_values
    from megatron_sao.learner.learner import Learner
    from megatron_sao.learner.step import first_action_tokens

    cfg = learner_config(hf_dir, {}, int(os.environ["WORLD_SIZE"]))
    cfg.learner.policy.warmup_steps, cfg.learner.value.warmup_steps = 3, 4
    ctx = init_distributed(cfg.parallel, seed=5)
    learner = Learner(cfg, layout=ctx)
    learner.load_hf(hf_dir)
    assert not learner.value_head_fitted
    fit, fitted_bias = learner._fit_value_bias, []

    def fit_and_note(*args):
        out = fit(*args)
        fitted_bias.append(float(learner.value.model.output_layer.bias))
        return out

    learner._fit_value_bias = fit_and_note
    policy_before = {n: p.detach().clone() for n, p in learner.policy.model.named_parameters()}
    m1 = learner.train_step(first)
    moved = max(float((policy_before[n] - p).abs().max()) for n, p in learner.policy.model.named_parameters())
    (bias,) = fitted_bias  # once, on the first batch
    # the values GAE will use for `second`, computed here by hand through the same micro-batches
    plan = learner._plan(second)
    old = torch.zeros_like(plan.batch.rollout_logprobs)
    with torch.no_grad():
        collect_values(learner.value.ddp, plan.mbs, old)
    b = plan.batch
    returns = compute_step_targets(token_rewards(b.action_mask, b.rewards), old, b.action_mask, cfg.algo).returns
    hand = float(explained_variance(old, returns, b.action_mask))
    hand_first = float(explained_variance(old, returns, first_action_tokens(b.action_mask)))
    m2 = learner.train_step(second)
    return {"m1": m1, "m2": m2, "bias": bias, "moved": moved, "hand": hand, "hand_first": hand_first,
            "fitted": learner.value_head_fitted}  # fmt: skip


@pytest.mark.multiproc
def test_the_critic_starts_at_the_mean_return_and_its_explained_variance_is_measured_before_it_trains(tiny_hf_dir):
    hf_dir = str(tiny_hf_dir("qwen3_moe"))
    first, second = on_policy(make_batch(5, seed=11), hf_dir), on_policy(make_batch(6, seed=12), hf_dir)
    for i, t in enumerate(first + second):  # rewards that vary, so returns have a variance to explain
        t.header = type(t.header)(**{**_fields(t.header), "reward": [0.0, 1.0, 0.25, 0.5, 1.0, 0.0][i % 6]})
    (out,) = spawn_ranks(_critic_steps, 1, hf_dir, first, second, timeout_s=300)
    # gamma = lambda_critic = 1: every action token's return is its trajectory's reward
    counts = [int(t.action_mask[1:].sum()) for t in first]
    mean_return = sum(n * t.header.reward for n, t in zip(counts, first)) / sum(counts)
    assert out["fitted"] and out["bias"] == pytest.approx(mean_return, abs=1e-6)
    m1, m2 = out["m1"], out["m2"]
    assert m1["value/explained_variance"] == pytest.approx(0.0, abs=1e-6)  # a constant at the mean explains 0
    assert m1["value/explained_variance_first_token"] == pytest.approx(0.0, abs=1e-6)
    # warm-up: the first update runs at lr / W (policy W = 3, value W = 4; the value's second update at 2 lr / W)
    assert m1["policy/lr"] == pytest.approx(1e-2 / 3) and m1["value/lr"] == pytest.approx(2 * 1e-2 / 4)
    assert out["moved"] > 0, "the first warm-up step left the policy unchanged"
    assert m2["policy/lr"] == pytest.approx(2 * 1e-2 / 3)
    assert m2["value/explained_variance"] == pytest.approx(out["hand"], abs=1e-6)
    assert m2["value/explained_variance_first_token"] == pytest.approx(out["hand_first"], abs=1e-6)
    assert m2["value/explained_variance_post"] != pytest.approx(m2["value/explained_variance"], abs=1e-9)


def _fields(header: Any) -> dict[str, Any]:
    import msgspec

    return msgspec.structs.asdict(header)


def _whitened_step(hf_dir: str, trajectories, whiten: bool) -> dict[str, Any]:
    from megatron_sao.distributed import init_distributed
    from megatron_sao.learner.learner import Learner
    from megatron_sao.models.shards import local_shards

    cfg = learner_config(hf_dir, {}, int(os.environ["WORLD_SIZE"]))
    cfg.algo.gae.whiten_advantages = whiten
    ctx = init_distributed(cfg.parallel, seed=5)
    learner = Learner(cfg, layout=ctx)
    learner.load_hf(hf_dir)
    learner.value_head_fitted = True  # keep the zero head: values 0, so the advantages keep the rewards' spread
    metrics = learner.train_step(trajectories)
    return {"x": {"policy": local_shards(learner.policy.model)}, "metrics": metrics}


@pytest.mark.slow  # default tier: tests/algo/test_advantages.py's whitening over every shard's moments
@pytest.mark.multiproc
def test_whitening_normalizes_the_whole_step_across_data_parallel_ranks(tiny_hf_dir):
    hf_dir = str(tiny_hf_dir("qwen3_moe"))
    trajectories = on_policy(make_batch(6, seed=13), hf_dir)
    for i, t in enumerate(trajectories):
        t.header = type(t.header)(**{**_fields(t.header), "reward": [2.0, 3.0, 2.5, 4.0, 2.0, 3.5][i]})
    plain = spawn_ranks(_whitened_step, 1, hf_dir, trajectories, False, timeout_s=300)
    single = spawn_ranks(_whitened_step, 1, hf_dir, trajectories, True, timeout_s=300)
    dp2 = spawn_ranks(_whitened_step, 2, hf_dir, trajectories, True, timeout_s=300)
    ref = _assembled(single, "x", "policy")
    _compare(ref, _assembled(dp2, "x", "policy"), 1e-6)  # per-rank whitening would differ (each shard its own mean)
    diff = max(float((ref[n] - p).abs().max()) for n, p in _assembled(plain, "x", "policy").items())
    assert diff > 1e-4, "whitening changed nothing: all-positive advantages push every token alike without it"


def _critic_params_after_one_step(hf_dir: str, trajectories, fused: bool) -> dict[str, Any]:
    from megatron_sao.distributed import init_distributed
    from megatron_sao.learner.learner import Learner

    cfg = learner_config(hf_dir, {}, int(os.environ["WORLD_SIZE"]), k=1)
    ctx = init_distributed(cfg.parallel, seed=5)
    learner = Learner(cfg, layout=ctx)
    learner.load_hf(hf_dir)
    published: list[dict] = []
    # K = 1 with a policy job waiting on the advantages takes the separate forward; without one, the fused path
    metrics = learner.critic_step(trajectories, None if fused else published.append)
    params = {n: p.detach().clone() for n, p in learner.value.model.named_parameters()}
    return {"params": params, "metrics": metrics, "published": len(published)}


@pytest.mark.multiproc
def test_values_from_the_first_updates_forward_equal_a_separate_forward(tiny_hf_dir):
    hf_dir = str(tiny_hf_dir("qwen3_moe"))
    trajectories = on_policy(make_batch(5, seed=14), hf_dir)
    for i, t in enumerate(trajectories):
        t.header = type(t.header)(**{**_fields(t.header), "reward": [1.0, 0.0, 0.5, 0.25, 1.0][i]})
    (fused,) = spawn_ranks(_critic_params_after_one_step, 1, hf_dir, trajectories, True, timeout_s=300)
    (separate,) = spawn_ranks(_critic_params_after_one_step, 1, hf_dir, trajectories, False, timeout_s=300)
    assert separate["published"] == 1 and fused["published"] == 0
    for name, p in fused["params"].items():
        torch.testing.assert_close(p, separate["params"][name], atol=1e-6, rtol=0)
    for key in ("loss/value_first", "value/explained_variance", "gae/advantages_mean", "value/grad_norm"):
        assert fused["metrics"][key] == pytest.approx(separate["metrics"][key], abs=1e-6), key

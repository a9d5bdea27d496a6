"""The SAO learner step on megatron-core: same parameter updates at every parallel layout, a frozen critic
attention, K value steps per policy step, and checkpoints that resume bit-exactly (same layout) or continue
identically (another layout)."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_sao.distributed import spawn_ranks
from megatron_sao.learner.synthetic import make_batch

LAYOUTS = {
    "dp2": {},
    "tp2_sp": {"tensor": 2},
    "ep2": {"expert": 2},
    "pp2": {"pipeline": 2},
}


def learner_config(hf_dir: str, layout: dict, world: int, dtype: str = "fp32", k: int = 2, extra: tuple = ()):
    from megatron_sao.config import load_config

    lr = "1e-2" if dtype == "fp32" else "1.0"  # bf16: updates far above the bf16 rounding of the weights
    overrides = [
        "--model.hf_path", hf_dir, "--model.dtype", dtype, "--launch.nproc_per_node", str(world),
        "--learner.max_tokens_per_microbatch", "40", "--algo.value.updates_per_policy_step", str(k),
        # adam_eps = 1 keeps Adam's first update linear in the gradient (no sign flips on ~0 gradients)
        "--learner.policy.lr", lr, "--learner.policy.adam_eps", "1.0",
        "--learner.value.lr", lr, "--learner.value.adam_eps", "1.0", "--learner.value.warmup_steps", "0",
    ]  # fmt: skip
    for key, value in layout.items():
        overrides += [f"--parallel.{key}", str(value)]
    return load_config(None, [*overrides, *extra])


def on_policy(trajectories, hf_dir: str, noise: float = 0.05, seed: int = 0):
    """Rollout log-probs from the model itself (plus noise), so DIS ratios sit inside the band."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in trajectories:
            toks = torch.from_numpy(t.tokens.astype("int64")).view(1, -1)
            logp = torch.log_softmax(model(toks).logits[0, :-1], -1).gather(1, toks[0, 1:].view(-1, 1)).view(-1)
            logp = logp + noise * torch.randn(logp.shape, generator=g)
            t.rollout_logprobs[1:] = (logp.numpy() * t.action_mask[1:]).astype("float32")
    return trajectories


def _one_step_per_layout(hf_dir: str, trajectories, layouts: dict, dtype: str) -> dict:
    from megatron_sao.distributed import destroy_distributed, init_distributed
    from megatron_sao.learner.learner import Learner
    from megatron_sao.models.shards import local_shards

    out = {}
    for name, layout in layouts.items():
        cfg = learner_config(hf_dir, layout, int(os.environ["WORLD_SIZE"]), dtype)
        ctx = init_distributed(cfg.parallel, seed=5)
        learner = Learner(cfg, layout=ctx)
        learner.load_hf(hf_dir)
        frozen = {n: p.detach().clone() for n, p in learner.value.model.named_parameters() if not p.requires_grad}
        before = {n: p.detach().clone() for n, p in learner.policy.model.named_parameters()}
        metrics = learner.train_step(trajectories)
        moved = max(float((before[n] - p).abs().max()) for n, p in learner.policy.model.named_parameters())
        frozen_same = all(torch.equal(frozen[n], p) for n, p in learner.value.model.named_parameters() if n in frozen)
        adam_steps = {
            float(s["step"]) for o in learner.value.optimizer.chained_optimizers for s in o.optimizer.state.values()
        }
        out[name] = {
            "policy": local_shards(learner.policy.model),
            "value": local_shards(learner.value.model),
            "metrics": metrics,
            "frozen_same": frozen_same,
            "num_frozen": len(frozen),
            "value_optimizer_steps": learner.value.optimizer_steps,
            "value_adam_steps": adam_steps,
            "policy_version": learner.version,
            "policy_moved": moved,
        }
        destroy_distributed(keep_process_group=True)
    return out


def _assembled(per_rank: list[dict], layout: str, role: str) -> dict[str, torch.Tensor]:
    from megatron_sao.models.shards import assemble

    return assemble([s for r in per_rank for s in r[layout][role]])


def _compare(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], atol: float) -> float:
    assert set(ref) == set(got)
    worst = 0.0
    for name in ref:
        diff = float((ref[name].float() - got[name].float()).abs().max())
        worst = max(worst, diff)
        assert diff <= atol, f"{name}: max diff {diff:.3g} > {atol}"
    return worst


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "family,dtype,atol",
    [
        ("qwen3_moe", "fp32", 1e-6),
        pytest.param("qwen3_moe", "bf16", 5e-3, marks=pytest.mark.slow),
        pytest.param("glm4_moe", "fp32", 1e-6, marks=pytest.mark.slow),
        pytest.param("glm_moe_dsa", "fp32", 1e-5, marks=pytest.mark.slow),
    ],
)
def test_learner_step_updates_parameters_the_same_at_every_layout(tiny_hf_dir, family, dtype, atol):
    hf_dir = str(tiny_hf_dir(family))
    trajectories = on_policy(make_batch(6, seed=3), hf_dir)
    ref = spawn_ranks(_one_step_per_layout, 1, hf_dir, trajectories, {"single": {}}, dtype, timeout_s=300)
    per_rank = spawn_ranks(_one_step_per_layout, 2, hf_dir, trajectories, LAYOUTS, dtype, timeout_s=600)
    ref_policy, ref_value = _assembled(ref, "single", "policy"), _assembled(ref, "single", "value")
    assert ref[0]["single"]["metrics"]["dis/masked_frac"] < 0.5, "the test batch is not on-policy enough"
    assert ref[0]["single"]["policy_moved"] > 5 * atol  # the update is far larger than the tolerance
    for layout in LAYOUTS:
        _compare(ref_policy, _assembled(per_rank, layout, "policy"), atol)
        _compare(ref_value, _assembled(per_rank, layout, "value"), atol)
        for rank in per_rank:
            r = rank[layout]
            assert r["frozen_same"] and r["num_frozen"] > 0
            assert r["value_optimizer_steps"] == 2 and r["value_adam_steps"] == {2.0}
            assert r["policy_version"] == 1


@pytest.mark.multiproc
@pytest.mark.slow  # the tier's budget; default-tier cover: the dense push test (a TP=2 learner step, then the
@pytest.mark.parametrize("family", ["llama", "qwen3"])  # engines serve its log-probs) and the TP=2/PP=2 logit parity
def test_a_dense_learner_step_is_the_same_at_tp2_and_pp2(family, tmp_path):
    """The dense families (issue 49; llama with tied embeddings, SmolLM2's layout): one SAO step (K=2 critic updates,
    the critic's attention frozen, its MLPs and head trained) moves the policy and the critic the same at TP=2 (with
    sequence parallelism) and PP=2 (the tied output layer on the last stage) as on one rank."""
    from megatron_sao.models.tiny import make_tiny_model

    hf_dir = str(make_tiny_model(family, tmp_path / family, seed=1, tie_embeddings=family == "llama"))
    trajectories = on_policy(make_batch(6, seed=3), hf_dir)
    layouts = {k: v for k, v in LAYOUTS.items() if k in ("tp2_sp", "pp2")}
    ref = spawn_ranks(_one_step_per_layout, 1, hf_dir, trajectories, {"single": {}}, "fp32", timeout_s=300)
    per_rank = spawn_ranks(_one_step_per_layout, 2, hf_dir, trajectories, layouts, "fp32", timeout_s=600)
    ref_policy, ref_value = _assembled(ref, "single", "policy"), _assembled(ref, "single", "value")
    assert ref[0]["single"]["policy_moved"] > 5e-6
    for layout in layouts:
        _compare(ref_policy, _assembled(per_rank, layout, "policy"), 1e-6)
        _compare(ref_value, _assembled(per_rank, layout, "value"), 1e-6)
        assert all(r[layout]["frozen_same"] and r[layout]["num_frozen"] > 0 for r in per_rank)


def _step_with_bad_trajectories(hf_dir: str, trajectories) -> dict:
    from megatron_sao.distributed import init_distributed
    from megatron_sao.learner.learner import Learner

    cfg = learner_config(hf_dir, {}, 1)
    ctx = init_distributed(cfg.parallel)
    learner = Learner(cfg, layout=ctx)
    learner.load_hf(hf_dir)
    return learner.train_step(trajectories)


@pytest.mark.multiproc
def test_untrainable_trajectories_are_dropped_and_counted_not_fatal(tiny_hf_dir):
    import numpy as np

    hf_dir = str(tiny_hf_dir("qwen3_moe"))
    good, out_of_vocab, nan_logprob = on_policy(make_batch(3, seed=9), hf_dir)
    out_of_vocab.tokens[3] = 100_000  # beyond the model's 512-token vocabulary
    nan_logprob.rollout_logprobs[np.flatnonzero(nan_logprob.action_mask)[0]] = np.nan
    metrics = spawn_ranks(_step_with_bad_trajectories, 1, hf_dir, [good, out_of_vocab, nan_logprob], timeout_s=200)[0]
    assert metrics["step/invalid_trajectories"] == 2.0
    assert metrics["step/trajectories"] == 1.0 and metrics["step/version"] == 1.0


def _router_after_one_step(hf_dir: str, trajectories, coeff: float) -> dict:
    from megatron_sao.distributed import init_distributed
    from megatron_sao.learner.learner import Learner

    cfg = learner_config(hf_dir, {}, 1)
    cfg.learner.moe_aux_loss_coeff = coeff
    ctx = init_distributed(cfg.parallel)
    learner = Learner(cfg, layout=ctx)
    learner.load_hf(hf_dir)
    metrics = learner.train_step(trajectories)
    routers = {n: p.detach().clone() for n, p in learner.policy.model.named_parameters() if ".router." in n}
    return {"metrics": metrics, "routers": routers}


@pytest.mark.multiproc
def test_moe_auxiliary_loss_enters_the_policy_gradient_and_is_logged(tiny_hf_dir):
    hf_dir = str(tiny_hf_dir("qwen3_moe"))
    trajectories = on_policy(make_batch(4, seed=21), hf_dir)
    off = spawn_ranks(_router_after_one_step, 1, hf_dir, trajectories, 0.0, timeout_s=200)[0]
    on = spawn_ranks(_router_after_one_step, 1, hf_dir, trajectories, 1.0, timeout_s=200)[0]
    assert not any(k.startswith("moe/") for k in off["metrics"])
    assert on["metrics"]["moe/load_balancing_loss"] > 0.0
    moved = max(float((on["routers"][n] - off["routers"][n]).abs().max()) for n in off["routers"])
    assert moved > 1e-6, "the auxiliary loss did not change the router update"


@pytest.mark.slow  # default tier: the layout test's even PP=2 split steps like one rank
@pytest.mark.multiproc
def test_uneven_pipeline_split_steps_like_one_rank(tmp_path):
    """3 layers on PP=2 (1 + 2, megatron's uneven split chosen by parallel.stage_layers); glm4_moe's first layer
    is dense, so a wrong layer offset on the second stage would build or load the wrong layers."""
    from megatron_sao.models.tiny import make_tiny_model

    hf_dir = str(make_tiny_model("glm4_moe", tmp_path / "hf", layers=3, seed=4))
    trajectories = on_policy(make_batch(4, seed=5), hf_dir)
    ref = spawn_ranks(_one_step_per_layout, 1, hf_dir, trajectories, {"single": {}}, "fp32", timeout_s=300)
    per_rank = spawn_ranks(_one_step_per_layout, 2, hf_dir, trajectories, {"pp2": {"pipeline": 2}}, "fp32",
                           timeout_s=300)  # fmt: skip
    assert ref[0]["single"]["policy_moved"] > 5e-6
    _compare(_assembled(ref, "single", "policy"), _assembled(per_rank, "pp2", "policy"), 1e-6)
    _compare(_assembled(ref, "single", "value"), _assembled(per_rank, "pp2", "value"), 1e-6)

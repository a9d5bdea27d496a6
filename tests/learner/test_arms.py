"""Each arm's learner step: sao on one trajectory (the per-rollout limit), the group arms' baseline from whole groups
(a group whose rewards are all equal moves nothing), running_mean's window carried across steps, and critic-only
pre-training steps that leave the policy and its version untouched."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from megatron_sao.distributed import spawn_ranks
from megatron_sao.learner.synthetic import make_batch
from tests.learner.test_learner_step import learner_config, on_policy


def _learner(hf_dir: str, arm: str, **extra: Any) -> Any:
    from megatron_sao.distributed import init_distributed
    from megatron_sao.learner.learner import Learner

    cfg = learner_config(hf_dir, {}, int(os.environ["WORLD_SIZE"]))
    cfg.algo.name = arm
    cfg.algo.grpo.group_size = 3
    for key, value in extra.items():
        setattr(cfg.learner, key, value)
    ctx = init_distributed(cfg.parallel, seed=3)
    learner = Learner(cfg, layout=ctx)
    learner.load_hf(hf_dir)
    return learner


def _params(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _moved(before: dict[str, torch.Tensor], model: Any) -> float:
    return max(float((before[n] - p).abs().max()) for n, p in model.named_parameters())


def _sao_one_trajectory(hf_dir: str) -> dict[str, Any]:
    learner = _learner(hf_dir, "sao")
    first, second = on_policy(make_batch(2, seed=4), hf_dir)
    second.header = type(second.header)(**{**_fields(second.header), "reward": first.header.reward + 1.0})
    before = _params(learner.policy.model)
    # the new critic's bias becomes this trajectory's return: its advantages are 0, the policy keeps its weights
    learner.train_step([first])
    still = _moved(before, learner.policy.model)
    metrics = learner.train_step([second])
    return {"metrics": metrics, "version": learner.version, "still": still,
            "moved": _moved(before, learner.policy.model), "value_steps": learner.value.optimizer_steps}  # fmt: skip


def _group_arm(hf_dir: str, arm: str) -> dict[str, Any]:
    learner = _learner(hf_dir, arm)
    trajectories = on_policy(make_batch(6, seed=5), hf_dir)
    for i, t in enumerate(trajectories):  # two prompts x three samples
        t.header = type(t.header)(**{**_fields(t.header), "prompt_id": f"p{i // 3}", "sample_index": i % 3,
                                     "reward": 0.5})  # fmt: skip
    before = _params(learner.policy.model)
    flat = learner.train_step(trajectories)  # every group's rewards equal: zero advantages, nothing moves
    flat_moved = _moved(before, learner.policy.model)
    for i, t in enumerate(trajectories):
        t.header = type(t.header)(**{**_fields(t.header), "reward": float(i % 3)})
    before = _params(learner.policy.model)
    varied = learner.train_step(trajectories)
    return {"flat": flat, "flat_moved": flat_moved, "varied": varied, "moved": _moved(before, learner.policy.model),
            "has_value": learner.value is not None, "version": learner.version}  # fmt: skip


def _fields(header: Any) -> dict[str, Any]:
    import msgspec

    return msgspec.structs.asdict(header)


def _running_mean(hf_dir: str) -> dict[str, Any]:
    learner = _learner(hf_dir, "running_mean")
    batch = on_policy(make_batch(2, seed=6), hf_dir)
    for t, r in zip(batch, (1.0, 0.0)):
        t.header = type(t.header)(**{**_fields(t.header), "reward": r})
    learner.train_step(batch)
    after_one = learner.running_mean.state_dict()
    learner.train_step(batch)
    return {"after_one": after_one, "after_two": learner.running_mean.state_dict(), "version": learner.version}


def _critic_only(hf_dir: str) -> dict[str, Any]:
    learner = _learner(hf_dir, "sao")
    policy, value = _params(learner.policy.model), _params(learner.value.model)
    metrics = learner.train_step(on_policy(make_batch(3, seed=7), hf_dir), update_policy=False)
    return {"metrics": metrics, "version": learner.version, "policy_moved": _moved(policy, learner.policy.model),
            "value_moved": _moved(value, learner.value.model)}  # fmt: skip


@pytest.mark.multiproc
def test_sao_steps_on_a_single_trajectory(tiny_hf_dir: Any) -> None:
    (out,) = spawn_ranks(_sao_one_trajectory, 1, str(tiny_hf_dir("qwen3_moe")), timeout_s=300)
    assert out["version"] == 2 and out["still"] == 0.0 and out["moved"] > 0 and out["value_steps"] == 4
    assert out["metrics"]["step/trajectories"] == 1 and "loss/policy" in out["metrics"]


@pytest.mark.multiproc
@pytest.mark.parametrize("arm", ["grpo", "grpo_async"])
def test_group_arms_use_the_group_baseline_of_whole_groups(tiny_hf_dir: Any, arm: str) -> None:
    (out,) = spawn_ranks(_group_arm, 1, str(tiny_hf_dir("qwen3_moe")), arm, timeout_s=300)
    assert not out["has_value"], "the group arms train no critic"
    assert out["flat"]["step/groups"] == 2 and out["flat"]["step/partial_groups"] == 0
    assert out["flat_moved"] == 0.0, "equal rewards in every group must give zero advantages"
    assert out["moved"] > 0 and out["version"] == 2


@pytest.mark.multiproc
def test_running_mean_carries_its_window_across_steps(tiny_hf_dir: Any) -> None:
    (out,) = spawn_ranks(_running_mean, 1, str(tiny_hf_dir("qwen3_moe")), timeout_s=300)
    assert list(out["after_one"]["history"]) == [1.0, 0.0]
    assert list(out["after_two"]["history"]) == [1.0, 0.0, 1.0, 0.0] and out["version"] == 2


@pytest.mark.multiproc
def test_value_pretraining_steps_train_the_critic_only(tiny_hf_dir: Any) -> None:
    (out,) = spawn_ranks(_critic_only, 1, str(tiny_hf_dir("qwen3_moe")), timeout_s=300)
    assert out["version"] == 0 and out["policy_moved"] == 0.0 and out["value_moved"] > 0
    assert "loss/value_first" in out["metrics"] and "loss/policy" not in out["metrics"]


def _oracle_value(hf_dir: str) -> dict[str, Any]:
    learner = _learner(hf_dir, "oracle_value")
    batch = on_policy(make_batch(2, seed=8), hf_dir)
    for t in batch:  # reward 0 from states of value 0: every turn's advantage is 0, nothing moves
        states = ",".join(f"{len(t.header.turns) - j}c" for j in range(len(t.header.turns)))
        t.header = type(t.header)(**{**_fields(t.header), "reward": 0.0,
                                     "metadata": {**t.header.metadata, "turn_states": states}})  # fmt: skip
    before = _params(learner.policy.model)
    learner.train_step(batch)
    still = _moved(before, learner.policy.model)
    for t in batch:
        t.header = type(t.header)(**{**_fields(t.header), "reward": 1.0})
    learner.train_step(batch)
    bare = on_policy(make_batch(1, seed=9), hf_dir)
    try:
        learner.train_step(bare)
        error = ""
    except ValueError as e:
        error = str(e)
    return {"still": still, "moved": _moved(before, learner.policy.model), "has_value": learner.value is not None,
            "table": learner.state_values.state_dict(), "error": error}  # fmt: skip


@pytest.mark.multiproc
def test_the_oracle_arm_trains_on_its_state_values_turn_by_turn(tiny_hf_dir: Any) -> None:
    (out,) = spawn_ranks(_oracle_value, 1, str(tiny_hf_dir("qwen3_moe")), timeout_s=300)
    assert not out["has_value"] and out["still"] == 0.0 and out["moved"] > 0
    # every trajectory's last turn acts in "1c": two steps of two trajectories, returns 0 then 1
    assert out["table"]["by_state"]["1c"]["history"] == [0.0, 0.0, 1.0, 1.0]
    assert "turn_states" in out["error"] and "decoys" in out["error"]

"""A critic on its own ranks (learner.value_on_separate_ranks): a value job and a policy job exchanging advantages
over the advantage channel update every parameter exactly as one learner holding both models."""

from __future__ import annotations

import os
import threading

import pytest

from megatron_sao.distributed import find_free_port, spawn_ranks
from megatron_sao.learner.synthetic import make_batch
from tests.learner.test_learner_step import _assembled, _compare, _one_step_per_layout, learner_config, on_policy


def _saved_and_reloaded(learner, save_dir: str | None) -> str | None:
    """Each job saves under the shared save_dir (into its own role directory) and loads its checkpoint back."""
    from megatron_sao.learner.checkpoint import load_checkpoint, save_checkpoint

    if save_dir is None:
        return None
    path = save_checkpoint(learner, save_dir, extra={"job": learner.policy is not None})
    learner.version = 0
    assert load_checkpoint(learner, save_dir) == {"job": learner.policy is not None}
    assert learner.version == 1
    return str(path)


def _job(role: str, hf_dir: str, trajectories, address: str, layout: dict, save_dir: str | None = None) -> dict:
    import torch.distributed as dist

    from megatron_sao.distributed import init_distributed
    from megatron_sao.learner.advantage_channel import (
        AdvantageReceiver,
        AdvantageSender,
        broadcast_from_rank0,
        gather_to_rank0,
    )
    from megatron_sao.learner.learner import Learner
    from megatron_sao.models.shards import local_shards

    cfg = learner_config(hf_dir, layout, int(os.environ["WORLD_SIZE"]))
    cfg.learner.value_on_separate_ranks = True
    init_distributed(cfg.parallel, seed=5)
    learner = Learner(cfg, roles={role})
    learner.load_hf(hf_dir)
    rank0 = dist.get_rank() == 0
    if role == "value":
        sender = AdvantageSender(address) if rank0 else None

        def publish(local):
            merged = gather_to_rank0(local)
            if sender is not None:
                sender.send(1, merged)

        metrics = learner.critic_step(trajectories, publish)
        if sender is not None:
            sender.close()
        saved = _saved_and_reloaded(learner, save_dir)
        return {"value": local_shards(learner.value.model), "metrics": metrics, "saved": saved}
    receiver = AdvantageReceiver(address) if rank0 else None
    advantages = broadcast_from_rank0(receiver.recv(1, timeout_s=240) if receiver else None)
    metrics = learner.policy_step(trajectories, advantages)
    if receiver is not None:
        receiver.close()
    saved = _saved_and_reloaded(learner, save_dir)
    return {"policy": local_shards(learner.policy.model), "metrics": metrics, "saved": saved}


def _run_jobs(
    hf_dir: str, trajectories, ranks: int, layout: dict, save_dir: str | None = None
) -> tuple[list[dict], list[dict]]:
    address = f"tcp://127.0.0.1:{find_free_port()}"
    out: dict[str, list[dict]] = {}

    def run(role: str) -> None:
        out[role] = spawn_ranks(_job, ranks, role, hf_dir, trajectories, address, layout, save_dir, timeout_s=400)

    threads = [threading.Thread(target=run, args=(role,)) for role in ("policy", "value")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(out) == {"policy", "value"}, "a job failed (see the RankFailure above)"
    return out["policy"], out["value"]


@pytest.mark.multiproc
def test_value_job_and_policy_job_update_like_one_learner(tiny_hf_dir, tmp_path):
    hf_dir = str(tiny_hf_dir("qwen3_moe"))
    trajectories = on_policy(make_batch(6, seed=3), hf_dir)
    ref = spawn_ranks(_one_step_per_layout, 1, hf_dir, trajectories, {"single": {}}, "fp32", timeout_s=300)
    policy, value = _run_jobs(hf_dir, trajectories, 1, {}, str(tmp_path / "ckpt"))
    # both jobs are at version 1 and share learner.save_dir: each saves into its own role directory
    assert policy[0]["saved"] == str(tmp_path / "ckpt" / "policy" / "iter_0000001")
    assert value[0]["saved"] == str(tmp_path / "ckpt" / "value" / "iter_0000001")
    _compare(_assembled(ref, "single", "policy"), _assembled([{"x": p} for p in policy], "x", "policy"), 1e-6)
    _compare(_assembled(ref, "single", "value"), _assembled([{"x": v} for v in value], "x", "value"), 1e-6)
    assert value[0]["metrics"]["value/updates"] == 2.0
    assert policy[0]["metrics"]["dis/masked_frac"] == pytest.approx(ref[0]["single"]["metrics"]["dis/masked_frac"])


@pytest.mark.multiproc
@pytest.mark.slow
def test_separate_jobs_at_two_ranks_each(tiny_hf_dir):
    hf_dir = str(tiny_hf_dir("qwen3_moe"))
    trajectories = on_policy(make_batch(6, seed=4), hf_dir)
    ref = spawn_ranks(_one_step_per_layout, 1, hf_dir, trajectories, {"single": {}}, "fp32", timeout_s=300)
    policy, value = _run_jobs(hf_dir, trajectories, 2, {"tensor": 2})
    _compare(_assembled(ref, "single", "policy"), _assembled([{"x": p} for p in policy], "x", "policy"), 1e-6)
    _compare(_assembled(ref, "single", "value"), _assembled([{"x": v} for v in value], "x", "value"), 1e-6)


def test_separate_ranks_need_an_explicit_role(tiny_hf_dir):
    from megatron_sao.learner.learner import Learner

    cfg = learner_config(str(tiny_hf_dir("qwen3_moe")), {}, 1)
    cfg.learner.value_on_separate_ranks = True
    with pytest.raises(ValueError, match="needs roles="):
        Learner._roles(cfg, None)
    with pytest.raises(ValueError, match="subset"):
        Learner._roles(cfg, {"critic"})
    assert Learner._roles(cfg, {"value"}) == {"value"}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("context", 2, "parallel.context = 2"), ("virtual_pipeline", 2, "parallel.virtual_pipeline = 2")],
)
def test_layouts_the_learner_does_not_implement_are_refused(tiny_hf_dir, field: str, value: int, message: str):
    from megatron_sao.learner.learner import Learner

    cfg = learner_config(str(tiny_hf_dir("qwen3_moe")), {}, 1)
    setattr(cfg.parallel, field, value)
    with pytest.raises(ValueError, match=message):  # before anything distributed is touched
        Learner(cfg)

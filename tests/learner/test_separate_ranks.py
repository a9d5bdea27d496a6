"""A critic on its own ranks (learner.value_on_separate_ranks): a value job (run/critic.py, learner/value_job.py; its
own world and layout)
and a policy job bridged over torch.distributed update every parameter as one learner holding both models, report
the same losses, and checkpoint each its own half of the same step."""

from __future__ import annotations

import threading

import pytest

from megatron_sao.distributed import find_free_port, spawn_ranks
from megatron_sao.learner.synthetic import make_batch
from tests.learner.test_learner_step import _assembled, _compare, _one_step_per_layout, learner_config, on_policy

TOLERANCE = 1e-6
"""fp32: the separate jobs run the same arithmetic as one learner; only the reduction order over ranks differs."""


def _cfg(hf_dir: str, policy_layout: dict, value_layout: dict, policy_ranks: int, value_ranks: int, save_dir=None):
    from megatron_sao.config.parallel import ParallelConfig

    cfg = learner_config(hf_dir, policy_layout, policy_ranks)
    cfg.learner.value_on_separate_ranks = True
    cfg.learner.value_parallel = ParallelConfig(**value_layout)
    cfg.launch.value_nproc_per_node = value_ranks
    cfg.learner.save_dir = save_dir
    return cfg


def _policy_job(hf_dir, batches, address, layouts, ranks, save_dir, ahead=False):
    import torch.distributed as dist

    from megatron_sao.distributed import init_distributed
    from megatron_sao.learner.checkpoint import save_checkpoint
    from megatron_sao.learner.learner import Learner
    from megatron_sao.learner.value_job import RemoteCritic
    from megatron_sao.models.shards import local_shards
    from megatron_sao.run.learn import Steps

    cfg = _cfg(hf_dir, *layouts, *ranks, save_dir)
    ctx = init_distributed(cfg.parallel, seed=5)
    learner = Learner(cfg, roles={"policy"}, layout=ctx)
    learner.load_hf(hf_dir)
    critic = RemoteCritic(cfg, address, ctx)
    assert critic.begin(None) == 0
    steps = Steps(learner, critic)
    records = []
    for i, batch in enumerate(batches):  # ahead: each next batch goes to the value job before this policy update
        following = batches[i + 1] if ahead and i + 1 < len(batches) else None
        metrics = steps.train(steps.ahead or batch, (lambda b=following: b) if following is not None else None)
        records.append({**steps.finish(), **metrics})
    metrics = records[-1]
    saved = None
    if save_dir is not None:
        value_path = critic.save("iter_0000001")
        saved = (value_path, str(save_checkpoint(learner, save_dir, tag="iter_0000001")))
    critic.close()
    return {"x": {"policy": local_shards(learner.policy.model)}, "metrics": metrics, "records": records,
            "saved": saved, "world": dist.get_world_size()}  # fmt: skip


def _value_job(hf_dir, address, layouts, ranks, save_dir):
    import torch.distributed as dist

    from megatron_sao.models.shards import local_shards
    from megatron_sao.run.critic import start_value_job, stop_value_job

    job = start_value_job(_cfg(hf_dir, *layouts, *ranks, save_dir), address)
    try:
        job.serve()
        from megatron.core import parallel_state as ps

        return {"x": {"value": local_shards(job.learner.value.model)}, "world": dist.get_world_size(),
                "tp": ps.get_tensor_model_parallel_world_size()}  # fmt: skip
    finally:
        stop_value_job(job)


def _both_jobs(policy: tuple, value: tuple, ranks=(1, 1), timeout_s: float = 400):
    """The policy job `(fn, *args)` and the value job `(fn, *args)` at once, each on its own spawned ranks."""
    out: dict[str, list[dict]] = {}

    def run(role: str, n: int, fn, *args) -> None:
        out[role] = spawn_ranks(fn, n, *args, timeout_s=timeout_s)

    threads = [threading.Thread(target=run, args=(role, n, *job)) for role, n, job in (("policy", ranks[0], policy),
               ("value", ranks[1], value))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(out) == {"policy", "value"}, "a job failed (see the RankFailure above)"
    return out["policy"], out["value"]


def _run_jobs(hf_dir, batches, layouts, ranks, save_dir=None, ahead=False):
    address = f"tcp://127.0.0.1:{find_free_port()}"
    return _both_jobs((_policy_job, hf_dir, batches, address, layouts, ranks, save_dir, ahead),
                      (_value_job, hf_dir, address, layouts, ranks, save_dir), ranks)  # fmt: skip


@pytest.mark.multiproc
def test_a_critic_on_its_own_ranks_updates_like_one_learner_holding_both(tiny_hf_dir, tmp_path):
    """3 ranks: a policy job at TP=2 and a value job of one rank (its own layout) match one serial learner."""
    hf_dir = str(tiny_hf_dir("qwen3_moe"))
    trajectories = on_policy(make_batch(6, seed=3), hf_dir)
    for i, t in enumerate(trajectories):  # varied rewards: the critic's bias and the advantages carry information
        t.header = type(t.header)(**{**_fields(t.header), "reward": [0.0, 1.0, 0.5, 1.0, 0.0, 0.25][i]})
    ref = spawn_ranks(_one_step_per_layout, 1, hf_dir, trajectories, {"single": {}}, "fp32", timeout_s=300)
    save_dir = str(tmp_path / "ckpt")
    policy, value = _run_jobs(hf_dir, [trajectories], ({"tensor": 2}, {}), (2, 1), save_dir)
    assert policy[0]["world"] == 2 and value[0]["world"] == 1 and value[0]["tp"] == 1
    _compare(_assembled(ref, "single", "policy"), _assembled(policy, "x", "policy"), TOLERANCE)
    _compare(_assembled(ref, "single", "value"), _assembled(value, "x", "value"), TOLERANCE)
    serial, separate = ref[0]["single"]["metrics"], policy[0]["metrics"]
    for key in ("loss/policy", "loss/value", "loss/value_first", "value/explained_variance", "dis/masked_frac",
                "gae/advantages_mean", "policy/grad_norm", "value/grad_norm"):  # fmt: skip
        assert separate[key] == pytest.approx(serial[key], abs=TOLERANCE, rel=1e-5), key
    assert separate["value/updates"] == 2.0 and separate["step/version"] == 1.0
    assert separate["time/critic_wait"] > 0 and "time/critic_tail" in separate
    # each job checkpoints its own half of the step under the shared save_dir
    value_path, policy_path = policy[0]["saved"]
    assert value_path == str(tmp_path / "ckpt" / "value" / "iter_0000001")
    assert policy_path == str(tmp_path / "ckpt" / "policy" / "iter_0000001")


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_value_job_at_tensor_parallel_two_beside_a_one_rank_policy(tiny_hf_dir):
    hf_dir = str(tiny_hf_dir("qwen3_moe"))
    trajectories = on_policy(make_batch(6, seed=4), hf_dir)
    ref = spawn_ranks(_one_step_per_layout, 1, hf_dir, trajectories, {"single": {}}, "fp32", timeout_s=300)
    policy, value = _run_jobs(hf_dir, [trajectories], ({}, {"tensor": 2}), (1, 2))
    assert value[0]["tp"] == 2
    _compare(_assembled(ref, "single", "policy"), _assembled(policy, "x", "policy"), TOLERANCE)
    _compare(_assembled(ref, "single", "value"), _assembled(value, "x", "value"), TOLERANCE)


def _serial_steps(hf_dir: str, batches) -> dict:
    """One learner holding both models trains on `batches`, a step each (the reference)."""
    from megatron_sao.distributed import init_distributed
    from megatron_sao.learner.learner import Learner
    from megatron_sao.models.shards import local_shards

    cfg = learner_config(hf_dir, {}, 1)
    ctx = init_distributed(cfg.parallel, seed=5)
    learner = Learner(cfg, layout=ctx)
    learner.load_hf(hf_dir)
    records = [learner.train_step(b) for b in batches]
    return {"single": {"policy": local_shards(learner.policy.model), "value": local_shards(learner.value.model)},
            "records": records}  # fmt: skip


@pytest.mark.multiproc
@pytest.mark.slow  # tier budget; default cover: test_a_critic_on_its_own_ranks_updates_like_one_learner_holding_both
def test_batches_handed_to_the_value_job_ahead_train_as_one_learner_holding_both(tiny_hf_dir):
    """Look-ahead (the value job gets step 2's batch before step 1's policy update, as a run does when the next
    batch is waiting): two steps update every parameter and report the losses of two serial steps."""
    hf_dir = str(tiny_hf_dir("qwen3_moe"))
    batches = [on_policy(make_batch(6, seed=s), hf_dir) for s in (3, 7)]
    for b, rewards in zip(batches, ([0.0, 1.0, 0.5, 1.0, 0.0, 0.25], [1.0, 0.0, 0.0, 0.75, 1.0, 0.5])):
        for t, r in zip(b, rewards):
            t.header = type(t.header)(**{**_fields(t.header), "reward": r})
    for i, t in enumerate(batches[1]):  # ids of their own
        t.header = type(t.header)(**{**_fields(t.header), "trajectory_id": f"second-{i}"})
    ref = spawn_ranks(_serial_steps, 1, hf_dir, batches, timeout_s=300)
    policy, value = _run_jobs(hf_dir, batches, ({}, {}), (1, 1), ahead=True)
    _compare(_assembled(ref, "single", "policy"), _assembled(policy, "x", "policy"), TOLERANCE)
    _compare(_assembled(ref, "single", "value"), _assembled(value, "x", "value"), TOLERANCE)
    got = policy[0]["records"]
    assert [r["step/critic_ahead"] for r in got] == [0.0, 1.0]
    for serial, separate in zip(ref[0]["records"], got):
        for key in ("loss/policy", "loss/value", "loss/value_first", "value/explained_variance", "gae/advantages_mean",
                    "step/version"):  # fmt: skip
            assert separate[key] == pytest.approx(serial[key], abs=TOLERANCE, rel=1e-5), key


def _stop_before_collecting(hf_dir, batches, address):
    """The policy job hands step 2's batch over and then sends Stop, a send that returns only once the value job
    took it, before collecting anything of step 1 but its advantages."""
    from megatron_sao.distributed import init_distributed
    from megatron_sao.learner.value_job import RemoteCritic, Stop

    cfg = _cfg(hf_dir, {}, {}, 1, 1)
    ctx = init_distributed(cfg.parallel, seed=5)
    critic = RemoteCritic(cfg, address, ctx)
    critic.begin(None)
    critic.submit(batches[0], 0)
    first = critic.advantages()
    critic.submit(batches[1], 1)
    critic._send(Stop())  # the value job takes it only after training batch 2, with step 1's metrics not collected
    done = [critic.metrics(), critic.advantages(), critic.metrics()]
    critic.bridge.close()
    return {"first": sorted(first), "second": sorted(done[1]), "updates": [done[0]["value/updates"],
            done[2]["value/updates"]]}  # fmt: skip


@pytest.mark.multiproc
def test_the_value_job_trains_a_batch_handed_over_ahead_before_its_last_replies_are_collected(tiny_hf_dir):
    """The value job posts its replies: it goes from step 1's updates to step 2's batch while the policy job is still
    in its own policy update and has not come for step 1's metrics. A reply that waited to be received would hang
    both jobs here (the value job on step 1's metrics, the policy job on the Stop) until the spawn timeout."""
    hf_dir = str(tiny_hf_dir("qwen3_moe"))
    batches = [make_batch(4, seed=s) for s in (3, 7)]
    for i, t in enumerate(batches[1]):
        t.header = type(t.header)(**{**_fields(t.header), "trajectory_id": f"second-{i}"})
    address = f"tcp://127.0.0.1:{find_free_port()}"
    (got,), _ = _both_jobs((_stop_before_collecting, hf_dir, batches, address),
                           (_value_job, hf_dir, address, ({}, {}), (1, 1), None), timeout_s=240)  # fmt: skip
    assert got["first"] == sorted(t.trajectory_id for t in batches[0])
    assert got["second"] == sorted(t.trajectory_id for t in batches[1])
    assert got["updates"] == [2.0, 2.0]


def _fields(header):
    import msgspec

    return msgspec.structs.asdict(header)


def test_separate_ranks_need_an_explicit_role(tiny_hf_dir):
    from megatron_sao.learner.learner import Learner

    cfg = learner_config(str(tiny_hf_dir("qwen3_moe")), {}, 1)
    cfg.learner.value_on_separate_ranks = True
    with pytest.raises(ValueError, match="needs roles="):
        Learner(cfg, layout=None)  # refused before the layout is looked at
    jobs = cfg.jobs
    with pytest.raises(ValueError, match="subset"):
        jobs.job_for({"critic"})
    with pytest.raises(ValueError, match="one per job"):
        jobs.job_for({"policy", "value"})
    assert jobs.job_for({"value"}) is jobs.value and jobs.value.checkpoint_subdir == "value"
    assert jobs.job_for({"policy"}) is jobs.learner and jobs.learner.roles == {"policy"}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--learner.value_parallel.tensor", "2"], "learner.value_on_separate_ranks=false"),
        (
            [
                "--learner.value_on_separate_ranks",
                "true",
                "--algo.name",
                "grpo",
                "--learner.trajectories_per_step",
                "16",
            ],
            "has no critic",
        ),
        (["--learner.value_on_separate_ranks", "true", "--learner.value_parallel.tensor", "2"], "the value job"),
        (["--learner.value_on_separate_ranks", "true", "--launch.value_nnodes", "1"], "launch.value_nnodes"),
    ],
)
def test_separate_critic_configs_that_cannot_work_are_refused(overrides, message):
    from megatron_sao.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("context", 2, "parallel.context = 2"), ("virtual_pipeline", 2, "parallel.virtual_pipeline = 2")],
)
def test_layouts_the_learner_does_not_implement_are_refused(tiny_hf_dir, field: str, value: int, message: str):
    from megatron_sao.learner.learner import Learner

    cfg = learner_config(str(tiny_hf_dir("qwen3_moe")), {}, 1)
    setattr(cfg.parallel, field, value)
    with pytest.raises(ValueError, match=message):  # before anything distributed is touched
        Learner(cfg, layout=None)

"""NaN/Inf gradients: megatron skips the optimizer step (weights unchanged); the learner counts each skip per model
(policy/nonfinite_updates, value/nonfinite_updates) and stops with a message after learner.max_nonfinite_updates in
a row. The fault is injected where it would show: megatron's optimizer reporting a step it had to skip."""

from __future__ import annotations

import pytest

from megatron_sao.distributed import spawn_ranks
from megatron_sao.learner.synthetic import make_batch
from tests.learner.test_arms import _learner, _moved, _params
from tests.learner.test_learner_step import on_policy


def _scenario(hf_dir: str, batches: list) -> dict:
    from megatron_sao.distributed import destroy_distributed
    from megatron_sao.learner.errors import NonFiniteTraining

    learner = _learner(hf_dir, "sao", max_nonfinite_updates=3)
    out: dict = {"metrics": []}
    learner.train_step(batches[0])  # a good step first
    before = _params(learner.policy.model)
    real_step = learner.policy.optimizer.step
    learner.policy.optimizer.step = lambda: (False, float("inf"), None)  # megatron found inf in the gradients
    try:
        for batch in batches[1:]:
            out["metrics"].append(learner.train_step(batch))
    except NonFiniteTraining as e:
        out["error"] = str(e)
    out["moved"] = _moved(before, learner.policy.model)
    learner.policy.optimizer.step = real_step
    ok = learner.train_step(batches[0])  # a finite step resets the run of skips
    out["after"] = (ok["policy/update_ok"], ok["policy/nonfinite_updates"], learner.nonfinite_in_a_row["policy"])
    destroy_distributed()
    return out


@pytest.mark.multiproc
def test_nonfinite_updates_are_skipped_counted_and_stop_the_run(tiny_hf_dir) -> None:
    hf_dir = str(tiny_hf_dir("qwen3_moe"))
    batches = [on_policy(make_batch(3, seed=s), hf_dir, seed=s) for s in range(5)]
    (out,) = spawn_ranks(_scenario, 1, hf_dir, batches, timeout_s=300)
    counts = [m["policy/nonfinite_updates"] for m in out["metrics"]]
    assert counts == [1.0, 2.0] and all(m["policy/update_ok"] == 0.0 for m in out["metrics"])
    assert "3 policy updates in a row had NaN/Inf gradients (learner.max_nonfinite_updates=3)" in out["error"]
    assert out["moved"] == 0.0  # skipped steps leave the weights as they were
    assert out["after"] == (1.0, 3.0, 0)

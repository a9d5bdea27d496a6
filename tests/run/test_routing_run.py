"""A local run with --learner.routing_replay true: the embedded engines are started with
--enable-return-routed-experts, every trajectory crosses the bus with its routes, and every policy step logs
routing/mismatch_frac with routing/replayed = 1; nothing is lost (the ledger)."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from tests.run.test_arms import REPO, _cmd, _env, _records, assert_ledger_ok


@pytest.mark.multiproc
def test_a_local_run_with_routing_replay_logs_the_mismatch_on_every_policy_step(tiny_hf_dir: Any, tmp_path) -> None:
    run_dir = tmp_path / "run"
    cmd = _cmd(tiny_hf_dir("qwen3_moe"), run_dir, "--learner.routing_replay", "true", "--learner.max_steps", "3",
               "--algo.value.pretrain_samples", "4", "--learner.trajectories_per_step", "4")  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    policy = [r for r in _records(run_dir) if "loss/policy" in r]
    assert len(policy) == 3
    for r in policy:
        assert r["routing/replayed"] == 1.0 and 0.0 <= r["routing/mismatch_frac"] < 0.05, r
        assert r["bus/rejected"] == 0
    assert_ledger_ok(run_dir)

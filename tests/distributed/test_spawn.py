"""The rank spawner used by tests, tools and benchmarks: results in rank order, failures and hangs reported."""

from __future__ import annotations

import os

import pytest

from megatron_sao.distributed import RankFailure, spawn_ranks


def _all_reduce_rank() -> tuple[int, int, int]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(t)
    threads = torch.get_num_threads()
    dist.destroy_process_group()
    return dist_rank_from_env(), int(t.item()), threads


def dist_rank_from_env() -> int:
    return int(os.environ["RANK"])


def _fail_on_rank_one() -> None:
    print("hello from", os.environ["RANK"], flush=True)
    if os.environ["RANK"] == "1":
        raise ValueError("boom on purpose")


def _hang_on_rank_zero() -> None:
    import time

    if os.environ["RANK"] == "0":
        time.sleep(60)


@pytest.fixture
def rank_logs_under(tmp_path, monkeypatch):
    """The spawner's per-rank log directories go under tmp_path (tempfile's default dir), to see them removed."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


@pytest.mark.multiproc
def test_spawned_ranks_form_a_gloo_group_with_one_thread_each(rank_logs_under):
    assert spawn_ranks(_all_reduce_rank, 2, timeout_s=60) == [(0, 3, 1), (1, 3, 1)]
    assert not list(rank_logs_under.glob("sao_ranks_*"))


@pytest.mark.multiproc
def test_a_failing_rank_is_reported_with_its_traceback_and_output(rank_logs_under):
    with pytest.raises(RankFailure) as e:
        spawn_ranks(_fail_on_rank_one, 2, timeout_s=60)
    msg = str(e.value)
    assert "rank 1 of 2 failed" in msg and "ValueError: boom on purpose" in msg and "hello from 1" in msg
    assert not list(rank_logs_under.glob("sao_ranks_*"))  # the message carries the output; no files are left


@pytest.mark.multiproc
def test_a_hanging_rank_times_out_with_its_stack():
    with pytest.raises(RankFailure) as e:
        spawn_ranks(_hang_on_rank_zero, 2, timeout_s=8)
    msg = str(e.value)
    assert "ranks [0] of 2 did not finish within 8s" in msg and "_hang_on_rank_zero" in msg


@pytest.mark.multiproc
def test_a_child_whose_run_died_while_it_started_exits_at_once() -> None:
    """The run's pid is in the child's environment: a child whose parent is not (or no longer) that pid -- the run
    was SIGKILLed while the child was still importing -- exits instead of outliving the run."""
    import os
    import subprocess
    import sys

    from megatron_sao.distributed.spawn import DIE_WITH_PARENT, child_env

    code = "from megatron_sao.distributed.spawn import die_with_parent_if_asked as d; d(); print('alive')"
    ours = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=60)
    assert ours.returncode == 0 and ours.stdout.strip() == "alive"
    orphan_env = {**os.environ, DIE_WITH_PARENT: str(os.getpid() + 999_999)}  # a run that is not its parent
    orphan = subprocess.run([sys.executable, "-c", code], env=orphan_env, capture_output=True, text=True, timeout=60)
    assert orphan.returncode == 1 and "alive" not in orphan.stdout

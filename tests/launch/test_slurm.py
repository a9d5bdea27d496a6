"""The Slurm path for real, on a local cluster of three slurmd nodes (tests/launch/slurm_cluster.py):
`./launch.sh submit` of the tiny example puts the learner (torchrun, 2 ranks) on n1, the engine on n2 and the rollout
worker on n3; the job completes, the learner reaches its steps and pushed its weights to the engine on the other
node. Then `scancel` mid-run: the learner checkpoints on the way out and a resubmission resumes from it. And an
engine that dies beyond launch.max_restarts stops the run, after the learner checkpointed.

The default tier runs the last one (a real submission, every role on its own node, pushes verified, the launcher's
restart budget) and the dry-run ones; the whole-job variants (a job to its end, scancel and resubmission, the value
job, an engine over two nodes, the CPU example as a new user submits it) are in the slow tier."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from megatron_sao.models.tiny import make_tiny_model
from tests.launch.slurm_cluster import SlurmUnavailable, _free_ports, local_cluster
from tests.run.test_arms import assert_ledger_ok

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    try:
        with local_cluster(tmp_path_factory.mktemp("slurm")) as env:
            yield env
    except SlurmUnavailable as e:
        pytest.skip(f"no local Slurm cluster: {e}")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("model"), seed=1))


def _args(model: Path, run_dir: Path, max_steps: int) -> list[str]:
    bus, sync, engine, rdzv = _free_ports(4)
    return ["--launch.mode", "slurm", "--launch.nproc_per_node", "2", "--launch.rollout_nodes", "1",
            "--launch.worker_nodes", "1", "--launch.gpus_per_node", "0", "--model.hf_path", str(model),
            "--launch.run_dir", str(run_dir), "--learner.max_steps", str(max_steps), "--learner.save_interval", "1000",
            "--rollout.embedded.threads", "1", "--bus.bind", f"tcp://127.0.0.1:{bus}", "--weight_sync.master_port",
            str(sync), "--rollout.base_port", str(engine), "--launch.rdzv_port", str(rdzv)]  # fmt: skip


def _submit(env: dict[str, str], args: list[str], wait: bool) -> tuple[int, int, str]:
    cmd = ["./launch.sh", "submit", "examples/tiny_cpu/config.yaml", *args, *(["--wait"] if wait else [])]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    match = re.search(r"\[submit\] job (\d+)", done.stdout)
    assert match, done.stdout + done.stderr
    return int(match.group(1)), done.returncode, done.stdout + done.stderr


def _output(run_dir: Path, job: int) -> str:
    return (run_dir / "logs" / f"slurm-{job}.out").read_text(errors="replace")


def _wait_for_steps(run_dir: Path, job: int, n: int, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while len(_steps(run_dir)) < n:
        assert time.monotonic() < deadline, _output(run_dir, job)[-4000:]
        time.sleep(0.5)


def _wait_until_gone(cluster: dict[str, str], job: int, why: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while subprocess.run(["squeue", "-h", "-j", str(job)], env=cluster, capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < deadline, f"the job did not end after {why}"
        time.sleep(0.5)


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [r for r in records if "step/trajectories" in r]


@pytest.mark.slow
def test_submit_runs_every_role_on_its_own_node(cluster: dict[str, str], model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job, code, said = _submit(cluster, _args(model, run_dir, 3), wait=True)
    out = _output(run_dir, job)
    assert code == 0, said + out[-4000:]
    assert re.search(r"n1 +127\.0\.0\.1 +learner\n +n2 +127\.0\.0\.1 +engine-0\n +n3 +127\.0\.0\.1 +rollout-0", out)
    assert "learner on 1 node(s) x 2 rank(s)" in out and "[launch] the learner finished" in out
    steps = _steps(run_dir)
    assert [r["weight_version"] for r in steps] == [1, 2, 3]
    for r in steps:  # every step's weights reached the engine on n2, checksums verified
        assert r["sync/version"] == r["weight_version"] and r["sync/failed"] == 0 and r["sync/engines"] == 1
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000003"
    ledger = [t for t in map(json.loads, (run_dir / "trajectories.jsonl").read_text().splitlines()) if "id" in t]
    assert {t["worker"] for t in ledger} == {"rollout-0"} and len(ledger) == 3 * 8
    for name in ("engine-0", "learner", "rollout-0"):
        assert (run_dir / "logs" / f"{name}.log").stat().st_size > 0
    assert_ledger_ok(run_dir)


@pytest.mark.slow
def test_a_critic_on_its_own_ranks_trains_beside_the_learner(
    cluster: dict[str, str], model: Path, tmp_path: Path
) -> None:
    """learner.value_on_separate_ranks: the value job is a step of its own (here on the learner's node), bridged to
    the learner; pre-training and the policy steps go through it, each job checkpoints its half."""
    run_dir = tmp_path / "run"
    args = [*_args(model, run_dir, 3), "--learner.value_on_separate_ranks", "true", "--algo.value.pretrain_samples",
            "8", "--algo.value.pretrain_plateau_steps", "0"]  # fmt: skip
    job, code, said = _submit(cluster, args, wait=True)
    out = _output(run_dir, job)
    assert code == 0, said + out[-4000:]
    assert re.search(r"n1 +127\.0\.0\.1 +learner, value job\n", out), out[-4000:]
    assert "[launch] the learner finished" in out and "[critic]" in out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["weight_version"] for r in _steps(run_dir)] == [0, 1, 2, 3]  # a pre-training step, then three
    for r in _steps(run_dir)[1:]:
        assert {"loss/policy", "loss/value", "time/critic", "time/critic_wait"} <= set(r) and r["sync/failed"] == 0
    assert sum("pretrain/samples" in r for r in records) == 1
    for job_dir in ("policy", "value"):
        assert (run_dir / "checkpoints" / job_dir / "latest").read_text().strip() == "iter_0000003"
    assert (run_dir / "logs" / "critic.log").stat().st_size > 0
    assert_ledger_ok(run_dir)


@pytest.mark.slow
def test_scancel_checkpoints_and_a_resubmission_resumes(cluster: dict[str, str], model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = _args(model, run_dir, 400)
    job, code, said = _submit(cluster, args, wait=False)
    assert code == 0, said
    _wait_for_steps(run_dir, job, 3)
    subprocess.run(["scancel", str(job)], env=cluster, check=True)
    _wait_until_gone(cluster, job, "scancel")
    out = _output(run_dir, job)
    last = _steps(run_dir)[-1]["weight_version"]
    assert "stopped by SIGTERM" in out, out[-4000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"iter_{last:07d}"  # saved on the way out
    assert last < 400
    resumed_to = last + 2
    args[args.index("--learner.max_steps") + 1] = str(resumed_to)
    job2, code, said = _submit(cluster, args, wait=True)
    out2 = _output(run_dir, job2)
    assert code == 0, said + out2[-4000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'iter_{last:07d}'} at version {last}" in out2
    assert f"waiting for the learner to push version {last}" in out2
    assert [r["weight_version"] for r in _steps(run_dir)][-3:] == [last, last + 1, last + 2]
    assert_ledger_ok(run_dir)  # across scancel and the resubmission


def test_a_step_beyond_its_restart_budget_stops_the_run_after_a_checkpoint(
    cluster: dict[str, str], model: Path, tmp_path: Path
) -> None:
    import psutil

    run_dir = tmp_path / "run"
    args = [*_args(model, run_dir, 400), "--launch.max_restarts", "0"]
    port = args[args.index("--rollout.base_port") + 1]
    job, code, said = _submit(cluster, args, wait=False)
    assert code == 0, said
    _wait_for_steps(run_dir, job, 2)
    for r in _steps(run_dir):  # every step's weights reached the engine on n2, checksums verified
        assert r["sync/version"] == r["weight_version"] and r["sync/failed"] == 0 and r["sync/engines"] == 1
    cmds = [(p, p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])]
    (engine,) = [p for p, c in cmds if c and "srun" not in c[0] and "engine" in c and port in c]  # not its srun
    engine.kill()  # the engine on n2 dies; launch.max_restarts=0: no restart
    _wait_until_gone(cluster, job, "its engine died")
    out = _output(run_dir, job)
    assert re.search(r"n1 +127\.0\.0\.1 +learner\n +n2 +127\.0\.0\.1 +engine-0\n +n3 +127\.0\.0\.1 +rollout-0", out)
    assert "learner on 1 node(s) x 2 rank(s)" in out
    assert "engine-0 exited with" in out and "after 0 restart(s) (launch.max_restarts); stopping the run" in out, out
    assert "stop requested" in out and "stopped by SIGTERM" in out  # the learner checkpointed on the way out
    last = _steps(run_dir)[-1]["weight_version"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"iter_{last:07d}"


@pytest.mark.slow
def test_an_engine_spanning_two_nodes_takes_pushes_from_a_tp2_pp2_learner(
    cluster: dict[str, str], model: Path, tmp_path: Path
) -> None:
    """Issue 25 item 8 on the local cluster: the learner (TP=2 x PP=2, 4 ranks) on n1, one embedded engine at TP=2
    over n2 and n3 (--nnodes 2 --node-rank --dist-init-addr, as an SGLang engine over two nodes), the worker beside
    it. Every push lands on both engine ranks (verified per rank), and with only fresh trajectories trained
    (bus.max_staleness 0) the learner's log-probs equal the engine's at every step."""
    run_dir = tmp_path / "run"
    (dist_port,) = _free_ports(1)
    args = _args(model, run_dir, 3)
    args[args.index("--launch.nproc_per_node") + 1] = "4"
    args[args.index("--launch.rollout_nodes") + 1] = "2"
    args[args.index("--launch.worker_nodes") + 1] = "0"  # the worker runs on the engine's first node
    args += ["--parallel.tensor", "2", "--parallel.pipeline", "2", "--rollout.embedded.tp", "2",
             "--rollout.embedded.nnodes", "2", "--rollout.embedded.dist_init_port", str(dist_port),
             "--bus.max_staleness", "0"]  # fmt: skip
    job, code, said = _submit(cluster, args, wait=True)
    out = _output(run_dir, job)
    assert code == 0, said + out[-4000:]
    assert re.search(r"n2 +127\.0\.0\.1 +engine-0", out) and re.search(r"n3 +127\.0\.0\.1 +engine-0", out), out[-4000:]
    assert "engine TP rank 1 serving rank 0's commands" in (run_dir / "logs" / "engine-0-node1.log").read_text()
    steps = _steps(run_dir)
    assert [r["weight_version"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["sync/version"] == r["weight_version"] and r["sync/failed"] == 0 and r["sync/engines"] == 1
        assert r["staleness/max"] == 0
        assert r["dis/logprob_abs_diff"] < 1e-4, r  # fp32 learner and engine on the same weights
    assert_ledger_ok(run_dir)


@pytest.mark.slow
def test_the_cpu_example_runs_on_one_node_of_a_cluster_without_gpus(cluster: dict[str, str], tmp_path: Path) -> None:
    """`./launch.sh submit examples/tiny_cpu/config.yaml --wait --learner.max_steps 6` as a new user types it, on a
    cluster without GPU GRES: the example is launch.mode=local (submit runs it as slurm), asks for no GPU, makes its
    tiny model in the job (model.make_tiny), and runs every role on one node, the one-rank learner under torchrun.
    Only the run dir, the model dir and the ports are moved out of the way of the other tests."""
    run_dir, model = tmp_path / "run", tmp_path / "model"
    bus, sync, engine, rdzv = _free_ports(4)
    args = ["--learner.max_steps", "6", "--launch.run_dir", str(run_dir), "--model.hf_path", str(model),
            "--bus.bind", f"tcp://127.0.0.1:{bus}", "--weight_sync.master_port", str(sync), "--rollout.base_port",
            str(engine), "--launch.rdzv_port", str(rdzv)]  # fmt: skip
    job, code, said = _submit(cluster, args, wait=True)
    out = _output(run_dir, job)
    assert code == 0, said + out[-4000:]
    assert "runs it with --launch.mode slurm" in said and "policy steps in" in said
    script = (run_dir / "slurm.sbatch").read_text()
    assert "--gpus" not in script and "--nodes=1" in script, script
    assert (model / "config.json").is_file() and "making a tiny random qwen3_moe" in out
    assert re.search(r"n1 +127\.0\.0\.1 +learner, engine-0, rollout-0", out), out[-4000:]
    assert "learner on 1 node(s) x 1 rank(s)" in out, out[-4000:]
    assert [r["weight_version"] for r in _steps(run_dir) if r["weight_version"] > 0] == [1, 2, 3, 4, 5, 6]
    assert_ledger_ok(run_dir)


def test_submit_wait_fails_a_job_that_trained_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job that exits 0 without a single policy step (e.g. a learner that never got trajectories) is a failure."""
    from megatron_sao import cli
    from megatron_sao.launch import sbatch

    script = tmp_path / "run" / "slurm.sbatch"
    script.parent.mkdir()
    monkeypatch.setattr(sbatch, "submit", lambda *a, **k: (script, 42, 0))
    config = ["examples/tiny_cpu/config.yaml", "--launch.run_dir", str(tmp_path / "run"), "--wait"]
    assert cli.main(["submit", *config]) == 1
    (script.parent / "metrics.jsonl").write_text(json.dumps({"weight_version": 1, "step/trajectories": 8,
                                                             "reward/mean": 0.5, "time": 1.0}) + "\n")  # fmt: skip
    assert cli.main(["submit", *config]) == 0

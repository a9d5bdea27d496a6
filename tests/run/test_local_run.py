"""`python -m megatron_sao run` end to end on this machine: an embedded engine, a rollout worker and the learner
train the tiny example; every step's trajectories come over the bus, the engine ends on the learner's last version,
and a second run on the same run_dir resumes (learner checkpoint with the bus state, prompt cursor)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from megatron_sao.distributed.spawn import find_free_port
from tests.run.test_arms import assert_ledger_ok

REPO = Path(__file__).resolve().parents[2]


STYLE_SCHEDULE = {"styles": ["cute", "chuunibyou", "classical"], "period": 2}  # versions 0-1 cute, 2-3 chuunibyou, ...


def _run(
    hf_dir: Path, run_dir: Path, ports: dict[str, int], max_steps: int, extra: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "megatron_sao", "run", str(REPO / "examples" / "tiny_cpu" / "config.yaml"),
        "--model.hf_path", str(hf_dir), "--launch.run_dir", str(run_dir),
        "--learner.save_dir", str(run_dir / "checkpoints"), "--learner.max_steps", str(max_steps),
        "--learner.save_interval", "2", "--learner.trajectories_per_step", "4",
        "--rollout.concurrency", "4", "--rollout.sampling.max_new_tokens", "12", "--rollout.max_turns", "2",
        "--rollout.base_port", str(ports["engine"]), "--bus.bind", f"tcp://127.0.0.1:{ports['bus']}",
        "--weight_sync.master_port", str(ports["sync"]), "--rollout.env.options", json.dumps(STYLE_SCHEDULE),
        *extra,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.multiproc
def test_run_trains_syncs_and_resumes(tiny_hf_dir: Any, tmp_path: Path) -> None:
    hf_dir = tiny_hf_dir("qwen3_moe")
    run_dir = tmp_path / "run"
    ports = {"engine": find_free_port(), "bus": find_free_port(), "sync": find_free_port()}
    first = _run(hf_dir, run_dir, ports, max_steps=2)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "[learner] step 2/2" in first.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["weight_version"] for r in records] == [1, 2]
    for r in records:
        assert r["step/trajectories"] == 4 and r["bus/accepted"] >= 4 * r["weight_version"]
        assert r["sync/version"] == r["weight_version"]  # weight_sync.interval=1: pushed after every step
    # the engine generated with the weights it was sent: the DIS ratio of the first step's on-policy tokens is 1
    assert abs(records[0]["dis/ratio_mean"] - 1.0) < 1e-4 and records[0]["dis/mismatch_kl"] < 1e-6
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000002"
    assert (run_dir / "rollout_cursor.json").is_file()

    ports = {"engine": find_free_port(), "bus": find_free_port(), "sync": find_free_port()}
    resumed_at = time.time()
    # the first run left ~60 trajectories in its spool: they come first (exactly once), so train past them
    second = _run(hf_dir, run_dir, ports, max_steps=24, extra=("--learner.keep_checkpoints", "3"))
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "[learner] step 24/24" in second.stdout and "step 1/" not in second.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (resume,) = [r for r in records if r.get("sync/reason") == "resume"]  # the checkpoint's weights, before any step
    assert resume["weight_version"] == 2 and resume["sync/failed"] == 0 and "step/trajectories" not in resume
    records = [r for r in records if "step/trajectories" in r]
    assert [r["weight_version"] for r in records] == list(range(1, 25))
    # what the model wrote, decoded: two samples of every step, once each across the resume (launch.samples_per_step)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [step for step in range(1, 25) for _ in range(2)]
    assert all(s["prompt"].strip() and s["response"].strip() and s["versions"] for s in samples), samples[:2]
    # resumed engines were given version 2 before the worker started: every token the second run generated is
    # version >= 2 (what the first run left uncommitted in the spool comes again too, older: exactly once)
    produced = [e for e in map(json.loads, (run_dir / "ledger" / "rollout-0.jsonl").read_text().splitlines())
                if e["event"] == "produced" and e["time"] > resumed_at]  # fmt: skip
    assert produced and all(e["versions"][0] >= 2 for e in produced), [e["versions"] for e in produced]
    # ... so the style reward's schedule (by weight version) goes on where it was: no episode after the resume is
    # scored for the first run's style, and every one for the style of the version that generated it
    styles = STYLE_SCHEDULE["styles"]
    for e in produced:
        assert e["metadata"]["style"] == styles[(e["versions"][1] // STYLE_SCHEDULE["period"]) % 3], e
    assert {e["metadata"]["style"] for e in produced} == set(styles)  # 22 versions: every style came round
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000024"
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("iter_*")) == [
        "iter_0000020", "iter_0000022", "iter_0000024"]  # learner.keep_checkpoints  # fmt: skip
    assert_ledger_ok(run_dir)


def _port_pair() -> tuple[int, int]:
    """A free port whose next one is free too (an engine and its push agent at offset 1)."""
    import socket

    while True:
        port = find_free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port, port + 1


@pytest.mark.multiproc
def test_run_pushes_through_a_push_agent(tiny_hf_dir: Any, tmp_path: Path) -> None:
    """weight_sync.agent: the run starts an agent beside the engine; every push goes through it (the learner never
    pauses the engine) and lands: the engine generates with the weights it was handed."""
    hf_dir = tiny_hf_dir("qwen3_moe")
    run_dir = tmp_path / "run"
    engine, agent = _port_pair()
    ports = {"engine": engine, "bus": find_free_port(), "sync": find_free_port()}
    extra = ("--weight_sync.agent", "true", "--weight_sync.agent_port_offset", str(agent - engine))
    out = _run(hf_dir, run_dir, ports, max_steps=2, extra=extra)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"starting 1 push agent(s): http://127.0.0.1:{agent}" in out.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["sync/version"] for r in records] == [1, 2] and all(r["sync/failed"] == 0 for r in records)
    assert abs(records[0]["dis/ratio_mean"] - 1.0) < 1e-4 and records[0]["dis/mismatch_kl"] < 1e-6
    log = (run_dir / "logs" / "agent_0.log").read_text()
    assert "push agent for" in log and "Traceback" not in log, log[-3000:]


@pytest.mark.multiproc
@pytest.mark.slow
def test_run_with_the_critic_on_its_own_ranks_pretrains_trains_and_resumes(tiny_hf_dir: Any, tmp_path: Path) -> None:
    hf_dir = tiny_hf_dir("qwen3_moe")
    run_dir = tmp_path / "run"
    separate = ("--learner.value_on_separate_ranks", "true", "--algo.value.pretrain_samples", "4",
                "--algo.value.pretrain_plateau_steps", "0")  # fmt: skip
    ports = {"engine": find_free_port(), "bus": find_free_port(), "sync": find_free_port()}
    first = _run(hf_dir, run_dir, ports, max_steps=2, extra=separate)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "value job: 1 rank(s)" in first.stdout and "[learner] step 2/2" in first.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    pretrain, *steps = [r for r in records if "step/trajectories" in r]
    assert pretrain["pretrain/done"] == 1.0 and pretrain["weight_version"] == 0 and "loss/policy" not in pretrain
    assert [r["weight_version"] for r in steps] == [1, 2]
    for r in steps:  # the policy's and the value job's halves of each step in one record
        assert {"loss/policy", "loss/value", "value/explained_variance", "time/critic", "time/critic_wait"} <= set(r)
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "policy" / "latest").read_text().strip() == "iter_0000002"
    assert (checkpoints / "value" / "iter_0000002" / "metadata.json").is_file()
    assert (checkpoints / "value" / "pretrain_0000001" / "metadata.json").is_file()

    ports = {"engine": find_free_port(), "bus": find_free_port(), "sync": find_free_port()}
    second = _run(hf_dir, run_dir, ports, max_steps=4, extra=separate)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "[learner] step 4/4" in second.stdout and "[learner] value pre-training" not in second.stdout
    log = (run_dir / "logs" / "critic.log").read_text()
    assert log.count("bridge sao_critic_bridge") == 2  # a value job per run
    assert log.count("bias set to") == 1, "the resumed value job set its head again instead of loading it"
    assert (checkpoints / "value" / "latest").read_text().strip() == "iter_0000004"
    assert_ledger_ok(run_dir)


@pytest.mark.slow
@pytest.mark.multiproc
def test_run_survives_an_engine_killed_mid_run(tiny_hf_dir: Any, tmp_path: Path) -> None:
    """SIGKILL the engine after two steps: the run restarts it, the next weight push forms the group again with it,
    and training reaches max_steps on its trajectories, the engine holding the last version."""
    import signal
    import time

    hf_dir = tiny_hf_dir("qwen3_moe")
    run_dir = tmp_path / "run"
    ports = {"engine": find_free_port(), "bus": find_free_port(), "sync": find_free_port()}
    cmd = [
        sys.executable, "-m", "megatron_sao", "run", str(REPO / "examples" / "tiny_cpu" / "config.yaml"),
        "--model.hf_path", str(hf_dir), "--launch.run_dir", str(run_dir), "--learner.max_steps", "8",
        "--learner.save_dir", str(run_dir / "checkpoints"), "--learner.trajectories_per_step", "4",
        "--rollout.concurrency", "4", "--rollout.sampling.max_new_tokens", "12", "--rollout.max_turns", "2",
        "--rollout.base_port", str(ports["engine"]), "--bus.bind", f"tcp://127.0.0.1:{ports['bus']}",
        "--weight_sync.master_port", str(ports["sync"]), "--rollout.request_timeout_s", "20",
        "--bus.max_inflight", "4", "--bus.recv_queue_size", "4",  # few queued: later steps need the new engine
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.5)
    engine = subprocess.run(["pgrep", "-f", f"megatron_sao engine .*--port {ports['engine']}"], capture_output=True,
                            text=True).stdout.split()  # fmt: skip
    assert len(engine) == 1, engine
    os.kill(int(engine[0]), signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert "engine exited with" not in out or "restarted" in out
    assert "restarted (1/5)" in out, out[-4000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records[-1]["weight_version"] == 8
    syncs = [(r["weight_version"], r.get("sync/version"), r.get("sync/failed")) for r in records]
    assert records[-1].get("sync/version") == 8 and not records[-1].get("sync/failed"), (syncs, out[-6000:])
    assert_ledger_ok(run_dir)


@pytest.mark.slow
@pytest.mark.multiproc
def test_style_example_learns_its_task(tiny_hf_dir: Any, tmp_path: Path) -> None:
    """examples/tiny_cpu (the style example, `./launch.sh style`; style markers, 40 versions): the reward the engines'
    rollouts earn climbs, i.e.
    the trajectories, the SAO step and the weight pushes together optimize the policy the engines sample from."""
    import statistics

    run_dir = tmp_path / "run"
    ports = {"engine": find_free_port(), "bus": find_free_port(), "sync": find_free_port()}
    cmd = [
        sys.executable, "-m", "megatron_sao", "run", str(REPO / "examples" / "tiny_cpu" / "config.yaml"),
        "--model.hf_path", str(tiny_hf_dir("qwen3_moe")), "--launch.run_dir", str(run_dir),
        "--rollout.base_port", str(ports["engine"]), "--bus.bind", f"tcp://127.0.0.1:{ports['bus']}",
        "--weight_sync.master_port", str(ports["sync"]),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rewards = [
        float(line.split("| reward ")[1].split(" |")[0]) for line in done.stdout.splitlines() if "| reward " in line
    ]
    assert len(rewards) == 40
    first, last = statistics.mean(rewards[:8]), statistics.mean(rewards[-8:])
    assert last >= 0.6 and last >= first + 0.3, rewards
    assert_ledger_ok(run_dir)


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_agentic_main_job_raises_its_reward_from_a_fresh_model(tmp_path: Path) -> None:
    """What ./launch.sh runs, from scratch: a random model, the warm start on demonstrations, value pre-training
    and SAO on key_chain. The reward of the last 10 steps beats the initial policy's (the value pre-training
    rollouts) by at least 0.15 (measured: +0.26 and +0.36 in two runs of 60 steps)."""
    from megatron_sao.models.tiny import make_tiny_model
    from megatron_sao.run.summary import summarize

    base = make_tiny_model("qwen3_moe", tmp_path / "base", hidden=128)
    config = str(REPO / "examples" / "tiny_agentic" / "config.yaml")
    warm = subprocess.run([sys.executable, "tools/warm_start.py", "--config", config, "--base", str(base), "--out",
                           str(tmp_path / "warm")], cwd=REPO, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert warm.returncode == 0, warm.stdout[-2000:] + warm.stderr[-2000:]
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_sao", "run", config, "--model.hf_path", str(tmp_path / "warm"),
           "--launch.run_dir", str(run_dir), "--rollout.base_port", str(find_free_port()), "--bus.bind",
           f"tcp://127.0.0.1:{find_free_port()}", "--weight_sync.master_port", str(find_free_port())]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    s = summarize(run_dir)
    # value pre-training in batches of 64: ended by the ready rule (a batch explains >= 0.1) or the budget of 4
    assert 2 <= s["pretrain_steps"] <= 4 and s["policy_steps"] == 60, s
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last_pretraining = [r for r in records if "pretrain/samples" in r][-1]
    assert last_pretraining["value/explained_variance"] > 0, last_pretraining  # the critic starts RL explaining some
    assert s["reward_after"] >= s["reward_before"] + 0.15, s
    assert "[run] reward" in done.stdout
    assert_ledger_ok(run_dir)

"""A learner SIGKILLed mid-run and resumed from its checkpoint trains exactly (bitwise) what a learner that never
crashed trains over the same trajectories: same losses at every step after the resume, same final weights.

Both runs are the real `python -m megatron_sao learn` process on the tiny example; one producer (this test) pushes
a fixed list of trajectories over the bus with a spool. After the kill, what the learner consumed past its last
checkpoint was never committed: the producer sends it again, the restored de-dup state drops what the checkpoint
holds, and the batches after the resume are the uncrashed run's batches."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_sao.distributed.spawn import find_free_port
from tests.chaos.report import write_report
from tests.run.test_arms import REPO, _env

STEPS, PER_STEP, SAVE_EVERY = 6, 4, 2
KILL_AT = 3  # after version 3: the checkpoint of version 2 is the resume point, step 3 is trained twice
LOSSES = ("loss/policy", "loss/value", "loss/value_first", "policy/grad_norm", "value/grad_norm")


def _learner(hf_dir: Path, run_dir: Path, bus: str) -> list[str]:
    return [
        sys.executable, "-m", "megatron_sao", "learn", str(REPO / "examples" / "tiny_cpu" / "config.yaml"),
        "--engines", "", "--model.hf_path", str(hf_dir), "--launch.run_dir", str(run_dir), "--bus.bind", bus,
        "--learner.max_steps", str(STEPS), "--learner.trajectories_per_step", str(PER_STEP),
        "--learner.save_interval", str(SAVE_EVERY), "--bus.max_staleness", "100", "--launch.tensorboard", "false",
        "--bus.curve", "false",  # the producer is this test, not one of a run's workers holding the run's keys
    ]  # fmt: skip


def _produce(bus: str, spool: Path, done: threading.Event) -> threading.Thread:
    """Push the same STEPS x PER_STEP trajectories, in the same order, then wait until the learner commits them."""
    from megatron_sao.bus import TrajectorySender
    from megatron_sao.config.bus import BusConfig
    from megatron_sao.learner.synthetic import make_batch

    def run() -> None:
        trajectories = make_batch(STEPS * PER_STEP, seed=7, vocab=300)
        with TrajectorySender(BusConfig(bind=bus, spool_dir=str(spool)), "replay") as sender:
            for t in trajectories:
                sender.send(t)
            while not done.is_set() and not sender.flush(timeout_s=0.5):
                pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _records(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").is_file() else []
    return [r for r in map(json.loads, lines) if "step/trajectories" in r]


def _steps(run_dir: Path) -> dict[int, dict[str, Any]]:
    """The last record of each trained version (a version trained twice, before and after the kill: the second)."""
    return {r["weight_version"]: r for r in _records(run_dir)}


def _policy(run_dir: Path, hf_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    subprocess.run([sys.executable, "tools/convert_megatron_to_hf.py", "--ckpt", str(run_dir / "checkpoints"),
                    "--out", str(out), "--hf-config", str(hf_dir), "--dtype", "fp32", "--quiet"],
                   cwd=REPO, check=True, capture_output=True, timeout=300)  # fmt: skip
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


def _run(hf_dir: Path, run_dir: Path, kill_at: int | None) -> float:
    """The run's seconds from its (re)start after the kill to its first trained step (0 without a kill)."""
    bus = f"tcp://127.0.0.1:{find_free_port()}"
    done = threading.Event()
    producer = _produce(bus, run_dir.parent / f"{run_dir.name}-spool", done)
    try:
        proc = subprocess.Popen(_learner(hf_dir, run_dir, bus), cwd=REPO, env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        if kill_at is not None:
            deadline = time.monotonic() + 300
            while max(_steps(run_dir), default=0) < kill_at:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)  # no checkpoint of this step: it is trained again after the resume
            proc.wait(60)
            restarted, trained = time.monotonic(), len(_records(run_dir))
            proc = subprocess.Popen(_learner(hf_dir, run_dir, bus), cwd=REPO, env=_env(),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
            while len(_records(run_dir)) == trained and proc.poll() is None:
                time.sleep(0.05)
            recovery = time.monotonic() - restarted
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:]
        return recovery if kill_at is not None else 0.0
    finally:
        done.set()
        producer.join(30)


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_killed_and_resumed_learner_trains_bitwise_as_an_uncrashed_one(tiny_hf_dir: Any, tmp_path: Path) -> None:
    hf_dir = Path(tiny_hf_dir("qwen3_moe"))
    _run(hf_dir, tmp_path / "uncrashed", kill_at=None)
    recovery = _run(hf_dir, tmp_path / "crashed", kill_at=KILL_AT)
    ref, got = _steps(tmp_path / "uncrashed"), _steps(tmp_path / "crashed")
    assert sorted(ref) == sorted(got) == list(range(1, STEPS + 1))
    for version in range(1, STEPS + 1):
        assert {k: got[version][k] for k in LOSSES} == {k: ref[version][k] for k in LOSSES}, version  # bitwise
    a = _policy(tmp_path / "uncrashed", hf_dir, tmp_path / "hf-uncrashed")
    b = _policy(tmp_path / "crashed", hf_dir, tmp_path / "hf-crashed")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    starts = [x for x in map(json.loads, (tmp_path / "crashed" / "trajectories.jsonl").read_text().splitlines())
              if x.get("event") == "start"]  # fmt: skip
    assert [s["version"] for s in starts] == [0, SAVE_EVERY * (KILL_AT // SAVE_EVERY)]
    consumed = [x for x in map(json.loads, (tmp_path / "crashed" / "trajectories.jsonl").read_text().splitlines())
                if "id" in x]  # fmt: skip
    write_report("resume_exact", {
        "faults": [{"fault": "SIGKILL learner, resume vs uncrashed run", "at_version": KILL_AT,
                    "recovered_s": round(recovery, 1), "until": "its restart trained a step"}],
        "ledger": {"produced": STEPS * PER_STEP, "consumed": STEPS * PER_STEP,
                   "voided": len(consumed) - STEPS * PER_STEP},
        "ok": True, "bitwise": True,
    })  # fmt: skip

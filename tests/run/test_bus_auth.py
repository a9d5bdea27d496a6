"""The bus is authenticated by default (issue 31, item 4): a run with the default config makes its own CURVE keys in the
run dir (owner-only), every role uses them, and a process that connects a TrajectorySender without them gets nothing
trained -- its sender stops with BusHandshakeError, its handshakes are counted (bus/handshake_failed: it speaks no
CURVE; bus/auth_failed: an unknown key) -- while the run trains as usual."""

from __future__ import annotations

import json
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from megatron_sao.bus import TrajectorySender
from megatron_sao.bus.sender_io import BusHandshakeError
from tests.bus.helpers import fast_cfg, traj
from tests.run.test_arms import REPO, _cmd, _env, assert_ledger_ok


@pytest.mark.multiproc
def test_a_foreign_sender_gets_nothing_trained_with_the_default_config(tiny_hf_dir: Any, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = _cmd(tiny_hf_dir("qwen3_moe"), run_dir, "--learner.max_steps", "8", "--algo.value.pretrain_samples", "0")
    bind = cmd[cmd.index("--bus.bind") + 1]
    run = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "metrics.jsonl").is_file():
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            time.sleep(0.5)
        intruder = TrajectorySender(fast_cfg(bind, connect=bind, spool_dir=None), "intruder")
        refused_at_send: BaseException | None = None
        try:
            for i in range(20):
                try:
                    intruder.send(traj(i, worker="intruder"), timeout_s=0.5)  # made-up trajectories, reward 1.0
                except TimeoutError:
                    continue  # never admitted: no credit ever comes
            intruder.flush(30)  # the sends may all be queued before the refusal arrives: it is heard while waiting
        except RuntimeError as failed:  # the producer hears the refused handshake (issue 46) instead of waiting
            refused_at_send = failed.__cause__
        finally:
            intruder.close()
        assert isinstance(refused_at_send, BusHandshakeError), refused_at_send
        out, err = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, out[-2000:] + err[-2000:]
    keys = run_dir / "bus_keys"
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert stat.S_IMODE((keys / "server.key_secret").stat().st_mode) == 0o600
    trained = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert trained and not [t for t in trained if t.get("worker") == "intruder"]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "step/trajectories" in r]
    assert len([r for r in steps if r["weight_version"] > 0]) == 8
    refused = steps[-1].get("bus/auth_failed", 0) + steps[-1].get("bus/handshake_failed", 0)  # (a plain client fails
    assert refused >= 1, {k: v for k, v in steps[-1].items() if k.startswith("bus/")}  # the mechanism, not the key)
    assert_ledger_ok(run_dir)

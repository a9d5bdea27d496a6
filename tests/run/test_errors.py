"""Errors that name the file or the field: a truncated safetensors shard (learner / converter and engine), a
run_dir that cannot be written, tensor parallelism that does not divide the attention or key/value heads."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from megatron_sao.config import ConfigError, load_config
from tests.run.test_arms import REPO, _cmd, _env


def _truncated_copy(hf_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    bad = tmp_path / "bad_model"
    shutil.copytree(hf_dir, bad)
    (shard,) = bad.glob("*.safetensors")
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return bad, shard


@pytest.mark.multiproc
def test_a_truncated_shard_is_named_by_the_learner_loader_and_the_engine(tiny_hf_dir: Any, tmp_path: Path) -> None:
    from megatron_sao.engines.embedded.model_runner import load_hf_model
    from megatron_sao.models.weights import HFCheckpoint, WeightMismatchError

    bad, shard = _truncated_copy(Path(tiny_hf_dir("qwen3_moe")), tmp_path)
    with pytest.raises(WeightMismatchError, match=f"{shard} is not a readable safetensors file.*truncated"):
        HFCheckpoint(bad)  # what the learner's load_hf and tools/convert_hf_to_megatron.py read through
    with pytest.raises(ValueError, match=f"{shard} is not a readable safetensors file"):
        load_hf_model(bad)
    done = subprocess.run([sys.executable, "tools/convert_hf_to_megatron.py", "--hf", str(bad), "--out",
                           str(tmp_path / "out"), "--quiet"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=_env())  # fmt: skip
    assert done.returncode != 0 and str(shard) in done.stdout + done.stderr


@pytest.mark.multiproc
def test_an_unwritable_run_dir_is_named(tiny_hf_dir: Any, tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    done = subprocess.run(_cmd(tiny_hf_dir("qwen3_moe"), blocker / "run"), cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=_env())  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"launch.run_dir='{blocker / 'run'}' is not writable" in done.stderr


def test_tensor_parallel_must_divide_the_heads(tiny_hf_dir: Any) -> None:
    hf = str(tiny_hf_dir("qwen3_moe"))  # 4 attention heads, 2 key/value heads

    def check(tp: int) -> None:
        load_config("examples/tiny_cpu/config.yaml", ["--model.hf_path", hf, "--parallel.tensor", str(tp),
                                                      "--launch.nproc_per_node", str(tp)])  # fmt: skip

    with pytest.raises(ConfigError, match=r"parallel.tensor=4 does not divide the model's 2 key/value heads"):
        check(4)  # found when the config is read, not 26 s later inside the ranks
    with pytest.raises(ConfigError, match=r"parallel.tensor=3 does not divide the model's 4 attention heads"):
        check(3)
    check(2)


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "megatron_sao", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=_env())  # fmt: skip


def _in_process(capsys: pytest.CaptureFixture[str], *argv: str) -> subprocess.CompletedProcess[str]:
    """The command line run in this process (no Python start: for commands that start nothing), as `_cli` reports."""
    from megatron_sao.cli import main

    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(argv), code, out.out, out.err)


@pytest.mark.multiproc
def test_what_a_config_names_is_resolved_before_anything_starts(
    tiny_hf_dir: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """run/preflight.py: a misspelt environment, a checkpoint or prompt file that is not there, a model of another
    family: `config check` and `run` refuse them at once (exit 2, one line naming the field and the fix), before an
    engine starts or a file is written; a cluster's model path that is not on this machine is only a note. `run` and
    `eval` start from the command line; `config check` and `plan` (which start nothing) run in this process."""
    hf = str(tiny_hf_dir("qwen3_moe"))
    base = [str(REPO / "examples/tiny_cpu/config.yaml"), "--model.hf_path", hf, "--launch.run_dir",
            str(tmp_path / "run")]  # fmt: skip
    done = _in_process(capsys, "config", "check", *base, "--rollout.env.name", "keychain")
    assert done.returncode == 2 and done.stderr.count("error:") == 1, done.stderr
    assert "rollout.env.name='keychain': unknown environment" in done.stderr
    assert "did you mean 'key_chain'" in done.stderr
    done = _cli("run", *base, "--rollout.env.name", "keychain")
    assert done.returncode == 2 and "rollout.env.name='keychain'" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
    done = _in_process(
        capsys, "config", "check", *base, "--learner.load", str(tmp_path / "nope"), "--eval.prompts", "/nope.jsonl"
    )
    assert done.returncode == 2 and "learner.load=" in done.stderr and "eval.prompts='/nope.jsonl'" in done.stderr
    glm = str(tiny_hf_dir("glm4_moe"))
    done = _in_process(capsys, "config", "check", *base[:1], "--model.hf_path", glm, "--model.family", "qwen3_moe")
    assert done.returncode == 2 and "model.family=qwen3_moe but config.json says model_type" in done.stderr
    done = _in_process(capsys, "plan", *base[:1], "--model.hf_path", glm, "--model.family", "qwen3_moe", "--nodes", "1")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    cut = tmp_path / "cut"  # a model whose config.json was cut short: the file and the line named, wherever read
    cut.mkdir()
    (cut / "config.json").write_text(Path(hf, "config.json").read_text()[:150])
    done = _in_process(capsys, "config", "check", *base[:1], "--model.hf_path", str(cut))
    assert done.returncode == 2 and f"{cut}/config.json is not valid JSON (" in done.stderr, done.stderr
    done = _in_process(capsys, "plan", *base[:1], "--hf-config", str(cut), "--nodes", "1")
    assert done.returncode == 2 and f"{cut}/config.json is not valid JSON" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    done = _cli("eval", *base, "--checkpoint", str(tmp_path / "nope"))
    assert done.returncode == 2 and "--checkpoint " in done.stderr and "no such file" in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()
    done = _in_process(capsys, "config", "check", str(REPO / "examples/tiny_agentic/config.yaml"),
                       "--model.hf_path", str(tmp_path / "none"))  # fmt: skip
    assert done.returncode == 2 and "model.hf_path=" in done.stderr, done.stderr  # a local run's model: here
    done = _in_process(
        capsys, "config", "check", str(REPO / "examples/qwen3_30b/config.yaml")
    )  # its model lives on the cluster
    assert done.returncode == 0 and "note: model.hf_path='/checkpoints/Qwen3-30B-A3B'" in done.stderr


@pytest.mark.multiproc
def test_an_unknown_flag_is_named_with_the_flag_it_is_closest_to() -> None:
    done = _cli("submit", "examples/qwen3_30b/config.yaml", "--dryrun")
    assert done.returncode == 2 and "unknown flag --dryrun: did you mean --dry-run?" in done.stderr, done.stderr
    done = _cli("run", "examples/tiny_cpu/config.yaml", "--learner.max_step", "3")  # an override: its own message
    assert done.returncode == 2 and done.stderr.count("did you mean 'learner.max_steps'") == 1, done.stderr
    done = _cli("plna", "examples/tiny_cpu/config.yaml")
    assert done.returncode == 2 and "unknown command plna: did you mean plan?" in done.stderr, done.stderr
    for argv, said in ((["stlye"], "unknown mode or command 'stlye': did you mean 'style'?"),
                       (["--dryrun"], "unknown flag --dryrun: a mode or command comes first")):  # fmt: skip
        done = subprocess.run(["./launch.sh", *argv], cwd=REPO, capture_output=True, text=True, timeout=30)
        assert done.returncode == 2 and said in done.stderr and "[setup]" not in done.stderr, done.stderr


@pytest.mark.multiproc
def test_launch_sh_help_describes_its_own_modes_first_without_installing_anything() -> None:
    done = subprocess.run(["./launch.sh", "--help"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "Start megatron-sao." and lines[1].startswith("  ./launch.sh ")
    assert "./launch.sh style" in done.stdout and "agent --engine URL" in done.stdout and "[setup]" not in done.stdout


def test_preflight_names_a_load_that_is_no_checkpoint_a_model_without_weights_and_what_makes_an_example_model(
    tiny_hf_dir: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A learner.load directory holding no checkpoint (a run dir given for its checkpoints/ is pointed there), a
    model directory with config.json but no weights, and an example's model not made yet (named with the launch.sh
    command that makes it) are each one line before anything starts."""
    import shutil

    from megatron_sao.config import load_config
    from megatron_sao.run.preflight import MADE_BY, problems

    hf = tiny_hf_dir("qwen3_moe")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("iter_0000004\n")
    found = problems(load_config("examples/tiny_cpu/config.yaml", ["--model.hf_path", str(hf), "--learner.load",
                                                                  str(run)]), model_here=True)  # fmt: skip
    assert found == [
        f"learner.load='{run}': not a checkpoint (it holds checkpoints/: point there); give a checkpoint "
        "directory (metadata.json in it), or a save_dir holding `latest` or iter_* checkpoints"
    ], found
    assert not problems(load_config("examples/tiny_cpu/config.yaml", ["--model.hf_path", str(hf), "--learner.load",
                                                                     str(run / "checkpoints")]), True)  # fmt: skip
    bare = tmp_path / "bare"
    shutil.copytree(hf, bare, ignore=shutil.ignore_patterns("*.safetensors"))
    agentic = "examples/tiny_agentic/config.yaml"  # (tiny_cpu makes its model: model.make_tiny)
    found = problems(load_config(agentic, ["--model.hf_path", str(bare)]), model_here=True)
    assert len(found) == 1 and "config.json but no weights (*.safetensors)" in found[0], found
    assert not problems(load_config(agentic, ["--model.hf_path", str(bare)]), False)
    launch = (REPO / "launch.sh").read_text()
    assert all(path in launch for path in MADE_BY), "MADE_BY names the paths launch.sh makes"
    monkeypatch.chdir(tmp_path)  # a fresh clone: the main job's model is not made yet
    found = problems(load_config(str(REPO / "examples/tiny_agentic/config.yaml")), model_here=True)
    assert len(found) == 1 and "; ./launch.sh makes it in its first step (tools/warm_start.py" in found[0], found


def test_a_role_that_refuses_its_config_is_not_restarted(tmp_path: Path) -> None:
    """Exit 2 is a configuration error (a garbage bus key, a model dir without weights): the same at every start, so
    the local supervisor stops the run at once with one message instead of restarting it launch.max_restarts times;
    any other exit is restarted within the budget."""
    from megatron_sao.run.local import Supervisor

    (tmp_path / "logs").mkdir()
    sup = Supervisor([], {}, [], lambda: None, tmp_path / "logs", max_restarts=5)
    assert sup._may_restart("rollout worker", 1, "RuntimeError: lost") and sup.gave_up is None
    assert not sup._may_restart("rollout worker", 2, "error: bus_keys/server.key is not a ZeroMQ certificate")
    assert "rollout worker refused its config (exit 2)" in (sup.gave_up or "") and "server.key" in sup.gave_up
    assert (tmp_path / "STOP").is_file()
    assert not sup._may_restart("rollout worker", 2, "again") and "again" not in sup.gave_up  # said once


@pytest.mark.multiproc
def test_a_worker_that_always_fails_ends_the_run_with_one_message(tiny_hf_dir: Any, tmp_path: Path) -> None:
    """A rollout worker that dies at every start (an environment option its class does not take): after
    launch.max_restarts the run stops the learner (it checkpoints) and exits 1 with one line naming the worker, its
    log and its last line -- instead of a learner waiting for trajectories forever."""
    import json
    import time

    run_dir = tmp_path / "run"
    cmd = _cmd(tiny_hf_dir("qwen3_moe"), run_dir, "--launch.max_restarts", "1", "--rollout.env.options",
               json.dumps({"no_such_option": 1}), "--learner.max_steps", "50")  # fmt: skip
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400, env=_env())
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rollout worker exited with" in errors[0] and "no_such_option" in errors[0], errors
    assert str(run_dir / "logs") in errors[0] and "Traceback" not in done.stdout + done.stderr
    assert not (run_dir / "STOP").exists()  # the learner took the request and removed it
    assert time.monotonic() - t0 < 300


@pytest.mark.slow  # default-tier cover: the supervisor's exit-2 unit test and tests/bus/test_curve.py's key checks
@pytest.mark.multiproc
@pytest.mark.parametrize("key", ["garbage", "another learner's"])
def test_a_bad_bus_key_ends_the_run_at_once_naming_the_file(key: str, tiny_hf_dir: Any, tmp_path: Path) -> None:
    """The run's server public key file is garbage, or a valid key of another learner (the secret beside it
    intact): the rollout worker refuses it, or hears the bus refuse its handshake (exit 2 either way), is not
    restarted, and the run exits 1 within a minute with one line naming the key file."""
    import time

    from megatron_sao.bus.auth import generate_keypair

    run_dir = tmp_path / "run"
    keys = run_dir / "bus_keys"
    generate_keypair(keys, "server")
    other = generate_keypair(tmp_path / "other", "server")[0].read_text()
    (keys / "server.key").write_text("not a certificate\n" if key == "garbage" else other)
    cmd = _cmd(tiny_hf_dir("qwen3_moe"), run_dir, "--learner.max_steps", "50")
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400, env=_env())
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rollout worker refused its config (exit 2)" in errors[0], errors
    assert "server.key" in errors[0] and "restarted" not in done.stdout, done.stdout[-2000:]
    assert time.monotonic() - t0 < 60 + 30  # (30 s: the learner's own start on a busy 2-core machine)


def test_a_local_run_moves_off_ports_another_process_holds_unless_they_were_asked_for() -> None:
    """Two local runs on one machine: the second finds its engine and bus ports (the config's, here free ports this
    test then holds) taken and takes free ones (run/local.py free_ports), printing which; a port given on the
    command line is kept (and refused if taken)."""
    import socket

    from megatron_sao.distributed.spawn import find_free_port
    from megatron_sao.run.local import free_ports, listener_of

    engine, bus = find_free_port(), find_free_port()
    ports = ["--rollout.base_port", str(engine), "--bus.bind", f"tcp://127.0.0.1:{bus}"]
    cfg = load_config("examples/tiny_cpu/config.yaml", ["--rollout.num_engines", "2", *ports])
    held = []
    for port in (engine + 1, bus):
        sock = socket.socket()
        sock.bind(("127.0.0.1", port))
        sock.listen()
        held.append(sock)
    try:
        moves = free_ports(cfg, [])  # as if the ports came from the config file
        assert moves[0] == "--rollout.base_port" and moves[2] == "--bus.bind", moves
        base = int(moves[1])
        assert all(listener_of(base + i) is None for i in range(2)) and base != engine
        assert listener_of(int(moves[3].rsplit(":", 1)[1])) is None
        assert free_ports(cfg, ["--rollout.base_port", str(engine), "--bus.bind", cfg.bus.bind]) == []
    finally:
        for sock in held:
            sock.close()


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_local_runs_side_by_side_on_default_ports_both_finish(tiny_hf_dir: Any, tmp_path: Path) -> None:
    hf = str(tiny_hf_dir("qwen3_moe"))
    small = ["--learner.max_steps", "2", "--learner.trajectories_per_step", "4", "--rollout.sampling.max_new_tokens",
             "8"]  # fmt: skip
    cmds = [[sys.executable, "-m", "megatron_sao", "run", "examples/tiny_cpu/config.yaml", "--model.hf_path", hf,
             "--launch.run_dir", str(tmp_path / f"run{i}"), *small] for i in range(2)]  # fmt: skip
    first = subprocess.Popen(cmds[0], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=_env())  # fmt: skip
    import time

    time.sleep(20)  # the first holds its engine and bus ports by now
    second = subprocess.run(cmds[1], cwd=REPO, capture_output=True, text=True, timeout=600, env=_env())
    out, _ = first.communicate(timeout=600)
    assert first.returncode == 0, out[-3000:]
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]

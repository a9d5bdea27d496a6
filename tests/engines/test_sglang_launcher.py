"""Engine launch commands (flag names from SGLang 0.5.23) and the bounded health wait."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from megatron_sao.config import RolloutConfig
from megatron_sao.engines.sglang_launcher import (
    EngineStartError,
    embedded_command,
    engine_commands,
    launch,
    sglang_command,
    stop,
    wait_healthy,
)

# SGLang 0.5.23 srt/arg_groups/fields/*.py field -> flag (arg_utils._field_to_cli_name: "--" + name with "-"):
# model.py model_path; serving.py host, port, skip_tokenizer_init, weight_version; parallel.py tp_size, dp_size,
# ep_size, nnodes, node_rank, dist_init_addr; schedule.py mem_fraction_static; device.py base_gpu_id. Flags taking a
# value / boolean switches:
SGLANG_VALUE_FLAGS = {"--model-path", "--host", "--port", "--tp-size", "--dp-size", "--ep-size",
                      "--mem-fraction-static", "--weight-version", "--base-gpu-id"}  # fmt: skip
SGLANG_SWITCHES = {"--skip-tokenizer-init"}


def _flags(cmd: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    i = cmd.index("sglang.launch_server") + 1
    while i < len(cmd):
        flag = cmd[i]
        if flag in SGLANG_SWITCHES:
            out[flag], i = None, i + 1
        else:
            out[flag], i = cmd[i + 1], i + 2
    return out


def test_sglang_command_uses_sglang_flag_names_and_config_values() -> None:
    rc = RolloutConfig(engine="sglang", num_engines=3, base_port=31000, host="10.0.0.5", api_key=False)
    rc.sglang.tp, rc.sglang.ep = 4, 4
    rc.sglang.skip_tokenizer_init = True
    rc.sglang.extra_args = ["--disable-radix-cache"]
    cmds = engine_commands(rc, "/models/qwen3", gpus_per_node=8)
    assert [u for u, _ in cmds] == [f"http://10.0.0.5:{31000 + i}" for i in range(3)]
    cmd = cmds[1][1]
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"] and cmd[-1] == "--disable-radix-cache"
    flags = _flags(cmd[:-1])
    assert set(flags) == SGLANG_VALUE_FLAGS | SGLANG_SWITCHES
    assert flags["--model-path"] == "/models/qwen3" and flags["--port"] == "31001" and flags["--tp-size"] == "4"
    assert flags["--ep-size"] == "4" and flags["--mem-fraction-static"] == "0.85" and flags["--weight-version"] == "0"
    assert [_flags(c[:-1])["--base-gpu-id"] for _, c in cmds] == ["0", "4", "0"]  # two engines per 8-GPU node
    rc.sglang.tp = 16
    with pytest.raises(ValueError, match="launch.gpus_per_node=8"):
        engine_commands(rc, "/m", gpus_per_node=8)
    rc.sglang.tp, rc.sglang.dp = 2, 2  # SGLang asserts dp_size == 1 for weight-update groups, unless DP attention
    with pytest.raises(ValueError, match="rollout.sglang.dp=2.*enable-dp-attention"):
        sglang_command(rc, "/m", 0, "0.0.0.0")
    rc.sglang.extra_args = ["--enable-dp-attention"]
    assert _flags(sglang_command(rc, "/m", 0, "0.0.0.0")[:-1])["--dp-size"] == "2"


def test_an_engine_spanning_nodes_gets_sglangs_multi_node_flags() -> None:
    """parallel.py nnodes, node_rank, dist_init_addr (--nnodes, --node-rank, --dist-init-addr host:port)."""
    rc = RolloutConfig(engine="sglang", base_port=30000, api_key=False)
    rc.sglang.tp, rc.sglang.ep, rc.sglang.nnodes = 16, 16, 2
    cmd = sglang_command(rc, "/m", 3, "10.0.0.9", node_rank=1, dist_init_host="10.0.0.8")
    flags = _flags(cmd)
    assert flags["--nnodes"] == "2" and flags["--node-rank"] == "1" and flags["--dist-init-addr"] == "10.0.0.8:31003"
    assert flags["--tp-size"] == "16" and flags["--port"] == "30003"
    with pytest.raises(ValueError, match="needs its node-rank 0's address"):
        sglang_command(rc, "/m", 0, "10.0.0.9")  # local mode cannot place an engine over nodes


@pytest.mark.multiproc
def test_an_sglang_engine_gets_the_runs_key_from_its_file_as_it_starts(tmp_path: Path) -> None:
    """rollout.api_key: SGLang takes --api-key on its command line only; the launch command reads it from the run's
    key file ($SAO_ENGINE_API_KEY_FILE) in the shell that starts the server, so no command we print holds it."""
    import subprocess

    from megatron_sao.engines.auth import API_KEY_FILE_ENV, ensure_key

    cmd = sglang_command(RolloutConfig(engine="sglang"), "/m", 0, "127.0.0.1")
    key_file = ensure_key(tmp_path)
    assert oct(key_file.stat().st_mode & 0o777) == "0o600" and key_file.read_text().strip() not in " ".join(cmd)
    assert cmd[:2] == ["bash", "-c"] and cmd[4:7] == [sys.executable, "-m", "sglang.launch_server"]
    shown = subprocess.run([*cmd[:4], "echo", *cmd[7:9]], capture_output=True, text=True, check=True,
                           env={**os.environ, API_KEY_FILE_ENV: str(key_file)}).stdout.split()  # fmt: skip
    assert shown == [*cmd[7:9], "--api-key", key_file.read_text().strip()]


def test_embedded_command_and_running_engines_need_no_launch() -> None:
    rc = RolloutConfig(num_engines=2)
    rc.embedded.threads = 1
    cmd = embedded_command(rc, "/m", 1, "127.0.0.1")
    assert cmd[1:4] == ["-m", "megatron_sao", "engine"] and cmd[cmd.index("--port") + 1] == "30001"
    assert cmd[cmd.index("--threads") + 1] == "1"
    assert engine_commands(RolloutConfig(engine_urls=["http://127.0.0.1:1"]), "/m", 8) == []


@pytest.mark.multiproc
def test_health_wait_reports_an_exited_engine_with_its_log(tmp_path: Path) -> None:
    code = "import sys; print('boom: no GPU'); sys.exit(3)"
    procs = launch([("http://127.0.0.1:9", [sys.executable, "-c", code])], tmp_path)
    with pytest.raises(EngineStartError, match="(?s)exited with 3.*boom: no GPU"):
        wait_healthy(procs, timeout_s=30)


@pytest.mark.multiproc
def test_health_wait_is_bounded(tmp_path: Path) -> None:
    procs = launch([("http://127.0.0.1:9", [sys.executable, "-c", "import time; time.sleep(60)"])], tmp_path)
    try:
        with pytest.raises(EngineStartError, match="not healthy after 1s"):
            wait_healthy(procs, timeout_s=1.0, poll_s=0.1)
    finally:
        stop(procs, timeout_s=5)
    assert procs[0].proc.poll() is not None


@pytest.mark.multiproc
def test_launched_embedded_engine_becomes_healthy(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    from megatron_sao.distributed.spawn import find_free_port
    from megatron_sao.engines.client import SGLangClient

    rc = RolloutConfig(base_port=find_free_port())
    rc.embedded.threads = 1
    procs = launch(engine_commands(rc, str(tiny_dirs["qwen3_moe_notok"]), 8), tmp_path)
    try:
        wait_healthy(procs, timeout_s=120)
        info = SGLangClient(procs[0].url).model_info()
        assert info["skip_tokenizer_init"] is True and info["weight_version"] == "0"
    finally:
        stop(procs)

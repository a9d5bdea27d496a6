"""Engine processes from the config: `python -m sglang.launch_server ...` commands for GPU clusters, or the embedded
CPU engine; start them, wait (bounded) until each answers /health, stop them (owned by engines/; used by the launch
scripts and the examples; the worker only needs the URLs).

SGLang flag names are those of SGLang 0.5.23 (srt/arg_groups/fields/*.py: `model_path` -> --model-path,
`tp_size` -> --tp-size, `dp_size` -> --dp-size, `ep_size` -> --ep-size, `mem_fraction_static` ->
--mem-fraction-static, `host`, `port`, `skip_tokenizer_init`, `weight_version`, `base_gpu_id`; field names become
flags by `--` + name.replace("_", "-"), arg_utils._field_to_cli_name); the same spellings exist in earlier 0.5.x
server_args.py.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_sao.config.rollout import RolloutConfig
from megatron_sao.config.weight_sync import WeightSyncConfig
from megatron_sao.distributed.spawn import child_env
from megatron_sao.engines.auth import API_KEY_FILE_ENV
from megatron_sao.engines.client import SGLangClient
from megatron_sao.engines.protocol import agent_url


def sglang_command(
    rollout: RolloutConfig,
    model_path: str,
    index: int,
    host: str,
    base_gpu_id: int = 0,
    python: str = sys.executable,
    node_rank: int = 0,
    dist_init_host: str | None = None,
) -> list[str]:
    """The launch command of SGLang engine `index` (port base_port + index), bound to `host`, on the GPUs from
    `base_gpu_id` on; for an engine spanning rollout.sglang.nnodes nodes, the part of node `node_rank`, all parts
    meeting at `dist_init_host`:dist_init_port + index (node-rank 0's address)."""
    sg = rollout.sglang
    if sg.dp > 1 and "--enable-dp-attention" not in sg.extra_args:
        raise ValueError(f"rollout.sglang.dp={sg.dp}: SGLang refuses weight-update groups for data-parallel replicas "
                         "without DP attention; run one engine per replica (rollout.sglang.dp=1, more "
                         "rollout.num_engines) or add --enable-dp-attention to rollout.sglang.extra_args")  # fmt: skip
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model_path]
    cmd += ["--host", host, "--port", str(rollout.base_port + index)]
    cmd += ["--tp-size", str(sg.tp), "--dp-size", str(sg.dp), "--ep-size", str(sg.ep)]
    cmd += ["--mem-fraction-static", str(sg.mem_fraction_static)]
    cmd += ["--weight-version", sg.weight_version, "--base-gpu-id", str(base_gpu_id)]
    if sg.skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    if rollout.return_routed_experts and "--enable-return-routed-experts" not in sg.extra_args:
        cmd.append("--enable-return-routed-experts")
    cmd += span_args("rollout.sglang", sg.nnodes, node_rank, dist_init_host, sg.dist_init_port + index)
    cmd += list(sg.extra_args)
    if rollout.api_key:  # SGLang takes the key on its command line only: read from the run's file as it starts
        cmd = ["bash", "-c", f'exec "$@" --api-key "$(cat "${API_KEY_FILE_ENV}")"', "sglang", *cmd]
    return cmd


def span_args(section: str, nnodes: int, node_rank: int, dist_init_host: str | None, port: int) -> list[str]:
    """The flags (SGLang's, which the embedded engine shares) of one part of an engine spanning `nnodes` nodes."""
    if nnodes == 1:
        return []
    if dist_init_host is None:
        raise ValueError(f"{section}.nnodes={nnodes}: an engine spanning nodes needs its node-rank 0's address "
                         "(--dist-init-addr); the Slurm launcher places such engines")  # fmt: skip
    return ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--dist-init-addr", f"{dist_init_host}:{port}"]


def embedded_command(
    rollout: RolloutConfig,
    model_path: str,
    index: int,
    host: str,
    python: str = sys.executable,
    node_rank: int = 0,
    dist_init_host: str | None = None,
) -> list[str]:
    """The launch command of embedded CPU engine `index` (port base_port + index), bound to `host`; for an engine
    spanning nodes (rollout.embedded.nnodes), its part on node `node_rank` meeting the others at `dist_init_host`."""
    em = rollout.embedded
    cmd = [python, "-m", "megatron_sao", "engine", "--model", model_path]
    cmd += ["--host", host, "--port", str(rollout.base_port + index)]
    cmd += ["--max-running-requests", str(em.max_running_requests), "--dtype", em.dtype]
    cmd += ["--weight-version", rollout.sglang.weight_version]
    if em.threads:
        cmd += ["--threads", str(em.threads)]
    if em.context_length:
        cmd += ["--context-length", str(em.context_length)]
    if em.tp > 1:
        cmd += ["--tp-size", str(em.tp)]
    if rollout.return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    cmd += span_args("rollout.embedded", em.nnodes, node_rank, dist_init_host, em.dist_init_port + index)
    return cmd


def agent_command(
    rollout: RolloutConfig,
    weight_sync: WeightSyncConfig,
    index: int,
    host: str,
    slot: int = 0,
    python: str = sys.executable,
    node_rank: int = 0,
    dist_init_host: str | None = None,
) -> list[str]:
    """The push agent beside engine `index` (weight_sync.agent): on the engine's node(s), at its port +
    weight_sync.agent_port_offset; on GPUs on the engine's GPUs (`slot` as for engine_command); for an engine
    spanning nodes, its part on node `node_rank`, the parts meeting at `dist_init_host`."""
    engine_port = rollout.base_port + index
    cmd = [python, "-m", "megatron_sao", "agent", "--engine", f"http://{dist_init_host or host}:{engine_port}"]
    cmd += ["--host", host, "--port", str(engine_port + weight_sync.agent_port_offset)]
    cmd += ["--part-mb", f"{weight_sync.agent_part_mb:g}", "--wait-engine", f"{rollout.health_timeout_s:g}"]
    if rollout.engine == "sglang":
        cmd += ["--device", "cuda", "--base-gpu-id", str(slot * rollout.sglang.gpus_per_node)]
        nnodes, port = rollout.sglang.nnodes, rollout.sglang.dist_init_port
    else:
        nnodes, port = rollout.embedded.nnodes, rollout.embedded.dist_init_port
    section = "rollout.sglang" if rollout.engine == "sglang" else "rollout.embedded"
    return cmd + span_args(section, nnodes, node_rank, dist_init_host,
                           port + index + weight_sync.agent_port_offset)  # fmt: skip


def engines_per_node(rollout: RolloutConfig, gpus_per_node: int) -> int | None:
    """How many SGLang engines fit on one node (None: embedded engines, which take no GPU); ValueError naming the
    fields when not even one does."""
    if rollout.engine != "sglang":
        return None
    sg = rollout.sglang
    gpus = sg.gpus_per_node
    if gpus > gpus_per_node:
        raise ValueError(
            f"rollout.sglang.tp x dp = {sg.gpus} GPUs per engine over rollout.sglang.nnodes={sg.nnodes} "
            f"node(s) is {gpus} per node, more than launch.gpus_per_node={gpus_per_node}: span more "
            "nodes (rollout.sglang.nnodes), lower rollout.sglang.tp or fix launch.gpus_per_node"
        )
    if sg.nnodes > 1 and gpus != gpus_per_node:
        raise ValueError(f"rollout.sglang.nnodes={sg.nnodes}: an engine spanning nodes takes them whole, but tp x dp / "
                         f"nnodes = {gpus} is not launch.gpus_per_node={gpus_per_node}")  # fmt: skip
    return gpus_per_node // gpus


def engine_command(
    rollout: RolloutConfig,
    model_path: str,
    index: int,
    host: str,
    slot: int = 0,
    python: str = sys.executable,
    node_rank: int = 0,
    dist_init_host: str | None = None,
) -> list[str]:
    """Engine `index`'s command; `slot`: its place among the engines of its node (which GPUs an SGLang engine
    takes); `node_rank`, `dist_init_host`: for an engine spanning nodes, which part and where the parts meet."""
    if rollout.engine == "sglang":
        return sglang_command(rollout, model_path, index, host, slot * rollout.sglang.gpus_per_node, python,
                              node_rank, dist_init_host)  # fmt: skip
    return embedded_command(rollout, model_path, index, host, python, node_rank, dist_init_host)


def engine_commands(rollout: RolloutConfig, model_path: str, gpus_per_node: int) -> list[tuple[str, list[str]]]:
    """(url, command) of every engine to launch on this machine (rollout.host; launch.mode=local, where engines that
    do not fit on one node's GPUs wrap round as on the next node); empty when rollout.engine_urls names running
    engines."""
    if rollout.engine_urls:
        return []
    per_node = engines_per_node(rollout, gpus_per_node) or rollout.num_engines
    host = rollout.host
    return [
        (f"http://{host}:{rollout.base_port + i}", engine_command(rollout, model_path, i, host, i % per_node))
        for i in range(rollout.num_engines)
    ]


def agent_commands(rollout: RolloutConfig, weight_sync: WeightSyncConfig, gpus_per_node: int
                   ) -> list[tuple[str, list[str]]]:  # fmt: skip
    """(url, command) of the push agent of every engine engine_commands launches (none unless weight_sync.agent)."""
    if rollout.engine_urls or not weight_sync.agent:
        return []
    per_node = engines_per_node(rollout, gpus_per_node) or rollout.num_engines
    host = rollout.host
    return [
        (agent_url(f"http://{host}:{rollout.base_port + i}", weight_sync.agent_port_offset),
         agent_command(rollout, weight_sync, i, host, i % per_node))
        for i in range(rollout.num_engines)
    ]  # fmt: skip


class EngineStartError(RuntimeError):
    """An engine exited or did not become healthy in time; the message carries its log tail."""


@dataclass
class EngineProcess:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""
        return "\n".join(text.splitlines()[-lines:])


def launch(commands: list[tuple[str, list[str]]], log_dir: str | Path, role: str = "engine") -> list[EngineProcess]:
    """Start each command with its output in log_dir/<role>_<i>.log."""
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    procs = []
    for i, (url, cmd) in enumerate(commands):
        log_path = Path(log_dir) / f"{role}_{i}.log"
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env())
            procs.append(EngineProcess(url, proc, log_path))
    return procs


def wait_healthy(procs: list[EngineProcess], timeout_s: float, poll_s: float = 0.5) -> None:
    """Return when every engine answers /health; EngineStartError when one exits or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    pending = {p.url: p for p in procs}
    while pending:
        for url, p in list(pending.items()):
            if p.proc.poll() is not None:
                raise EngineStartError(f"engine {url} exited with {p.proc.returncode}:\n{p.log_tail()}")
            if SGLangClient(url).health(timeout_s=2.0):
                del pending[url]
        if pending and time.monotonic() > deadline:
            tails = "\n".join(f"--- {u} ---\n{p.log_tail()}" for u, p in pending.items())
            raise EngineStartError(f"engines {sorted(pending)} not healthy after {timeout_s:.0f}s:\n{tails}")
        if pending:
            time.sleep(poll_s)


def stop(procs: list[EngineProcess], timeout_s: float = 20.0) -> None:
    """SIGTERM each engine, SIGKILL what is still alive after timeout_s."""
    for p in procs:
        if p.proc.poll() is None:
            p.proc.terminate()
    for p in procs:
        try:
            p.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait(timeout=timeout_s)

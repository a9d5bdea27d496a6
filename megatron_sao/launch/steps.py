"""The srun steps of a run (launch.mode=slurm): one per engine (and its push agent, with weight_sync.agent), one
per rollout worker, one for the learner (torchrun on every learner node), one for the value job of a critic on its
own ranks (torchrun on its nodes), each the same `python -m megatron_sao ...` command local mode runs, plus the
addresses the node map wires in as ordinary config overrides. Nothing Slurm-specific reaches a role but where it
runs."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megatron_sao.config.tree import SAOConfig
from megatron_sao.engines.protocol import agent_url
from megatron_sao.engines.sglang_launcher import agent_command, engine_command
from megatron_sao.launch.nodemap import NodeMap

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Step:
    name: str  # engine-0, agent-0, learner, rollout-0: its log is <run_dir>/logs/<name>.log
    role: str  # engine | agent | learner | critic | worker
    nodes: tuple[str, ...]
    command: tuple[str, ...]  # what runs on each node
    env: dict[str, str] = field(default_factory=dict)  # set on top of the allocation's environment
    url: str | None = None  # an engine's

    def srun(self, srun_args: list[str]) -> list[str]:
        """The srun command line of this step. --overlap: steps share the allocation's CPUs and GPUs (an SGLang
        engine picks its GPUs by --base-gpu-id); one task per node (--ntasks too: the batch script's SLURM_NTASKS
        would otherwise ask for one task per node of the job)."""
        return ["srun", "--overlap", f"--nodes={len(self.nodes)}", f"--ntasks={len(self.nodes)}", "--ntasks-per-node=1",
                f"--nodelist={','.join(self.nodes)}", f"--job-name={self.name}", "--kill-on-bad-exit=1",
                *srun_args, *self.command]  # fmt: skip


def step_env(cfg: SAOConfig) -> dict[str, str]:
    """What every step adds to the allocation's environment: the project on PYTHONPATH, unbuffered output, and the
    run's engine key file (rollout.api_key; the file itself on the shared run dir, made by the launcher)."""
    from megatron_sao.engines.auth import API_KEY_FILE_ENV, KEY_FILE

    env = {"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    if cfg.rollout.api_key:
        env[API_KEY_FILE_ENV] = str(Path(cfg.launch.run_dir) / KEY_FILE)
    return env


def build_steps(
    cfg: SAOConfig, config_path: str, overrides: list[str], nodes: NodeMap, python: str = sys.executable
) -> list[Step]:
    """Every step of the run on `nodes`: engines first, then the learner (and the value job), then the rollout
    workers."""
    la, r = cfg.launch, cfg.rollout
    model = cfg.engine_model_path or ""
    urls = ",".join(nodes.engine_urls)
    # an engine spanning nodes is one step per node: the same server with its --node-rank; node-rank 0 serves HTTP
    steps = [
        Step(
            f"engine-{e.index}" if rank == 0 else f"engine-{e.index}-node{rank}",
            "engine",
            (node.name,),
            tuple(engine_command(r, model, e.index, node.addr, e.slot, python, rank, e.node.addr)),
            step_env(cfg),
            e.url if rank == 0 else None,
        )  # fmt: skip
        for e in nodes.engines
        for rank, node in enumerate(e.span)
    ]
    if cfg.weight_sync.agent:  # each engine's push agent, on its node(s): same names, "agent" for "engine"
        steps += [
            Step(
                f"agent-{e.index}" if rank == 0 else f"agent-{e.index}-node{rank}",
                "agent",
                (node.name,),
                tuple(agent_command(r, cfg.weight_sync, e.index, node.addr, e.slot, python, rank, e.node.addr)),
                step_env(cfg),
                agent_url(e.url, cfg.weight_sync.agent_port_offset) if rank == 0 else None,
            )  # fmt: skip
            for e in nodes.engines
            for rank, node in enumerate(e.span)
        ]
    learn = ["learn", config_path, "--engines", urls, *overrides, "--bus.bind", nodes.bus_bind]
    if nodes.critic_bridge:
        learn += ["--critic-bridge", nodes.critic_bridge]
    torchrun = _torchrun(python, nodes.rdzv, la.nnodes, la.nproc_per_node, learn)
    steps.append(Step("learner", "learner", tuple(n.name for n in nodes.learner), tuple(torchrun), step_env(cfg)))
    if nodes.value and nodes.value_rdzv and nodes.critic_bridge:
        critic = ["critic", config_path, "--bridge", nodes.critic_bridge, *overrides]
        cmd = _torchrun(python, nodes.value_rdzv, len(nodes.value), la.value_nproc_per_node, critic)
        steps.append(Step("critic", "critic", tuple(n.name for n in nodes.value), tuple(cmd), step_env(cfg)))
    for w in nodes.workers:
        cmd = [python, "-m", "megatron_sao", "rollout", config_path, "--engines", urls, "--worker-id", w.worker_id,
               "--shard", f"{w.shard[0]}/{w.shard[1]}", *overrides, "--bus.connect", nodes.bus_connect]  # fmt: skip
        steps.append(Step(w.worker_id, "worker", (w.node.name,), tuple(cmd), step_env(cfg)))
    return steps


def _torchrun(python: str, rdzv: str, nnodes: int, nproc: int, command: list[str]) -> list[str]:
    """torchrun on every node of a step (its node rank from Slurm), meeting at `rdzv` (host:port)."""
    host, port = rdzv.rsplit(":", 1)
    return ["bash", "-c", 'exec "$0" -m torch.distributed.run --node-rank="$SLURM_NODEID" "$@"', python,
            f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", f"--master-addr={host}", f"--master-port={port}",
            "-m", "megatron_sao", *command]  # fmt: skip


def describe(nodes: NodeMap, steps: list[Step], srun_args: list[str]) -> str:
    """The node map and every step's srun command with its environment (the dry run's output)."""
    lines = ["node map:", nodes.table(), "", f"bus: learner binds {nodes.bus_bind}, workers connect to "
             f"{nodes.bus_connect}; torchrun rendezvous {nodes.rdzv}", ""]  # fmt: skip
    if nodes.critic_bridge:
        lines[-1:] = [f"value job: torchrun rendezvous {nodes.value_rdzv}, bridge to the learner {nodes.critic_bridge}",
                      ""]  # fmt: skip
    for step in steps:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in step.env.items())
        lines.append(f"[{step.name}] env {env} \\\n    {shlex.join(step.srun(srun_args))}")
    return "\n".join(lines)

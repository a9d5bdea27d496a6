"""`python -m megatron_sao agent --engine URL --port N [options]`: start a push agent beside an engine (called by
cli.py; the launchers start one per engine when weight_sync.agent is on)."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import threading
import time

from megatron_sao.engines.embedded.tp import TPLayout


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megatron_sao agent",
        description="Push agent: receives a shard-aware push beside an SGLang (or embedded) engine without pausing "
        "it, then hands each engine TP rank its slice by /update_weights_from_tensor (docs/weight_sync.md).",
    )
    p.add_argument("--engine", required=True, metavar="URL", help="the engine this agent serves (http://HOST:PORT)")
    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="the engine's model directory (default: its /server_info model_path)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on the ready line)")
    p.add_argument("--handover", choices=["auto", "direct", "hf"], default="auto",
                   help="direct: the engine's /weight_shards blocks (embedded engine); hf: full HF tensors with each "
                   "rank's own experts (SGLang's load_format None); auto: direct where the engine serves "
                   "/weight_shards")  # fmt: skip
    p.add_argument("--part-mb", type=float, default=512.0,
                   help="bytes per engine rank in one /update_weights_from_tensor call (bounds the GPU copy "
                   "lent)")  # fmt: skip
    p.add_argument("--pause-engine", choices=["auto", "always"], default="auto",
                   help="pause the engine in place for the handover: auto where it loads in place (SGLang), not "
                   "where it stages a push itself (the embedded engine); always: every engine (to measure SGLang's "
                   "stall on the embedded one)")  # fmt: skip
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: receive over NCCL and lend CUDA IPC handles (on the engine's GPUs)")  # fmt: skip
    p.add_argument("--base-gpu-id", type=int, default=0, help="the engine's --base-gpu-id")
    p.add_argument("--gpu-id-step", type=int, default=1, help="the engine's --gpu-id-step")
    p.add_argument("--nnodes", type=int, default=1, help="nodes the engine's ranks span (one agent on each)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's place among them; node 0 serves HTTP")
    p.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                   help="where the agent's ranks meet (node 0's address); default on one node: a free local "
                   "port")  # fmt: skip
    p.add_argument("--weight-session-timeout", type=float, default=300.0, metavar="S",
                   help="drop a push no update touched for S seconds (its trainer is gone)")  # fmt: skip
    p.add_argument("--wait-engine", type=float, default=600.0, metavar="S",
                   help="how long to wait for the engine to answer /health at start")  # fmt: skip
    p.add_argument("--tp-rank", type=int, default=None, help=argparse.SUPPRESS)  # the node's other ranks
    p.add_argument("--api-key", default=None, help="the engine's key (SGLang's --api-key), asked of the agent's own "
                   "callers too (default: the run's key file, $SAO_ENGINE_API_KEY_FILE)")  # fmt: skip
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def _wait_engine(url: str, timeout_s: float, key: str | None) -> dict:
    from megatron_sao.engines.client import SGLangClient

    client = SGLangClient(url, api_key=key)
    deadline = time.monotonic() + timeout_s
    while not client.health(timeout_s=2.0):
        if time.monotonic() > deadline:
            raise SystemExit(f"error: the engine at {url} did not answer /health within {timeout_s:.0f}s "
                             "(--engine, --wait-engine)")  # fmt: skip
        time.sleep(0.5)
    return client.server_info()


def _start_node_ranks(argv: list[str], layout: TPLayout) -> list[subprocess.Popen[bytes]]:
    from megatron_sao.distributed.spawn import child_env

    addr = ["--dist-init-addr", f"{layout.host}:{layout.port}"]
    cmd = [sys.executable, "-m", "megatron_sao", "agent", *argv, *addr]
    return [subprocess.Popen([*cmd, "--tp-rank", str(r)], env=child_env()) for r in layout.node_ranks[1:]]


def main(argv: list[str]) -> int:
    from megatron_sao.distributed.spawn import die_with_parent_if_asked

    die_with_parent_if_asked()
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import torch

    from megatron_sao.engines import protocol as P
    from megatron_sao.engines.agent.handover import HandoverError, checkpoint_table, expert_count, plan_handover
    from megatron_sao.engines.agent.ranks import AgentReceiver, serve_rank
    from megatron_sao.engines.auth import run_key
    from megatron_sao.engines.client import EngineError, SGLangClient
    from megatron_sao.engines.embedded import tp
    from megatron_sao.engines.embedded.cli import layout_of

    try:
        key = args.api_key or run_key()
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    info = _wait_engine(args.engine, args.wait_engine, key)
    client = SGLangClient(args.engine, api_key=key)
    try:
        proto = P.ServerProtocol.from_server_info(info, args.engine)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if not proto.session:
        raise SystemExit(f"error: the engine runs SGLang {proto.version}; the push agent hands over inside a "
                         "weight-update session (SGLang >= 0.5.21): upgrade it or set weight_sync.agent: "
                         "false")  # fmt: skip
    model = args.model or info.get("model_path")
    if not model:
        raise SystemExit("error: the engine's /server_info names no model_path: give --model")
    try:
        shards = client.weight_shards() if info.get("engine") == P.EMBEDDED_ENGINE else None
    except EngineError:
        shards = None
    try:
        table = checkpoint_table(model)
        handover = plan_handover(args.handover, info, table, shards, expert_count(model))
    except HandoverError as e:
        raise SystemExit(f"error: {e}") from None
    args.tp_size = handover.tp_size
    try:
        layout = layout_of(args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    tp_rank = layout.node_ranks[0] if args.tp_rank is None else args.tp_rank
    device = torch.device("cpu")
    if args.device == "cuda":
        local = tp_rank - layout.node_ranks[0]  # SGLang's GPU of a rank: base + its place on the node x step
        device = torch.device("cuda", args.base_gpu_id + local * args.gpu_id_step)
        torch.cuda.set_device(device)
    agent_proto = P.ServerProtocol(proto.version, agent=True)
    store, peers = None, None
    if layout.tp_size > 1:
        children = _start_node_ranks(argv, layout) if args.tp_rank is None else []
        store = tp.join(layout, tp_rank)
        threading.Thread(target=tp.watch_ranks, args=(store, layout, children, tp_rank), name="agent-tp-watch",
                         daemon=True).start()  # fmt: skip
        if tp_rank != 0:
            receiver = AgentReceiver(table, agent_proto, handover, tp_rank, device, float("inf"))
            serve_rank(store, tp_rank, receiver)
            return 0
        peers = tp.Peers(store, layout)
    from megatron_sao.engines.agent.server import AgentState, serve

    receiver = AgentReceiver(table, agent_proto, handover, 0, device, args.weight_session_timeout, peers=peers)
    state = AgentState(client, info, receiver, handover, int(args.part_mb * 2**20),
                       pause_always=args.pause_engine == "always")  # fmt: skip
    state.api_key = key  # its callers need the engine's key too
    serve(state, args.host, args.port)
    return 0

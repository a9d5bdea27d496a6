"""`python -m megatron_sao engine --model DIR --port N [options]`: start the embedded engine (called by cli.py)."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import threading

from megatron_sao.engines import protocol as P
from megatron_sao.engines.embedded.tp import TPLayout


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megatron_sao engine",
        description="Embedded CPU engine speaking SGLang's HTTP API (token-in/token-out, in-place weight updates).",
    )
    p.add_argument("--model", "--model-path", dest="model", required=True, help="HF model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed on the ready line)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--max-running-requests", type=int, default=32, help="KV slots: requests decoded together")
    p.add_argument("--context-length", type=int, default=None, help="default: config.max_position_embeddings")
    p.add_argument("--skip-tokenizer-init", action="store_true", help="token-in/token-out even with tokenizer files")
    p.add_argument("--weight-version", default=P.DEFAULT_WEIGHT_VERSION, help="initial weight_version string")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--random-seed", type=int, default=0, help="seeds requests without a sampling_seed")
    p.add_argument("--emulate-sglang", default=None, metavar="VERSION",
                   help="follow the weight-update rules of this SGLang release (default: the newest one read, "
                   "megatron_sao.engines.embedded.server.EMULATED_SGLANG)")  # fmt: skip
    p.add_argument("--load-in-place", action="store_true",
                   help="load each weight update into the live model at its call, as SGLang does (one copy, no "
                   "staging): a push cut part-way leaves the engine partially updated. Default: a session's updates "
                   "are staged and switched in together at its end")  # fmt: skip
    p.add_argument("--weight-session-timeout", type=float, default=300.0, metavar="S",
                   help="discard a weight-update session no update touched for S seconds (its trainer is gone) and "
                   "resume generating")  # fmt: skip
    p.add_argument("--tp-size", "--tp", dest="tp_size", type=int, default=1,
                   help="tensor-parallel ranks of this engine (processes; gloo), as SGLang's --tp-size")  # fmt: skip
    p.add_argument("--nnodes", type=int, default=1, help="nodes the engine's ranks span (tp-size / nnodes on each)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's place among them; node 0 serves HTTP")
    p.add_argument(
        "--dist-init-addr",
        default=None,
        metavar="HOST:PORT",
        help="where the engine's ranks meet (node 0's address); default on one node: a free local port",
    )
    p.add_argument("--tp-rank", type=int, default=None, help=argparse.SUPPRESS)  # the node's other ranks (started here)
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="capture each token's experts in every MoE layer; requests with return_routed_experts get "
                   "meta_info.routed_experts (SGLang's flag and format)")  # fmt: skip
    p.add_argument("--api-key", default=None, help="SGLang's --api-key: every endpoint but /health* needs "
                   "`Authorization: Bearer KEY` (default: the run's key file, $SAO_ENGINE_API_KEY_FILE)")  # fmt: skip
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def layout_of(args: argparse.Namespace) -> TPLayout:
    """The engine's TP layout from the command line (a free local port when one node and no --dist-init-addr)."""
    host, port = "127.0.0.1", 0
    if args.dist_init_addr:
        host, sep, port_s = args.dist_init_addr.rpartition(":")
        if not sep or not port_s.isdigit():
            raise ValueError(f"--dist-init-addr={args.dist_init_addr!r}: use HOST:PORT")
        port = int(port_s)
    elif args.tp_size > 1 and args.nnodes == 1:
        from megatron_sao.distributed.spawn import find_free_port

        port = find_free_port(host)
    return TPLayout(args.tp_size, args.nnodes, args.node_rank, host, port)


def start_node_ranks(argv: list[str], layout: TPLayout) -> list[subprocess.Popen[bytes]]:
    """The other TP ranks of this node: the same command with --tp-rank, dying with this process."""
    from megatron_sao.distributed.spawn import child_env

    addr = ["--dist-init-addr", f"{layout.host}:{layout.port}"]
    cmd = [sys.executable, "-m", "megatron_sao", "engine", *argv, *addr]
    return [subprocess.Popen([*cmd, "--tp-rank", str(r)], env=child_env()) for r in layout.node_ranks[1:]]


def main(argv: list[str]) -> int:
    from megatron_sao.distributed.spawn import die_with_parent_if_asked

    die_with_parent_if_asked()  # started by a local run: end with it
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import torch

    from megatron_sao.engines.embedded.server import EMULATED_SGLANG, build_state, serve
    from megatron_sao.engines.protocol import parse_version

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.random_seed)
    if args.max_running_requests < 1:
        raise SystemExit("error: --max-running-requests must be >= 1")
    sglang_version = args.emulate_sglang or EMULATED_SGLANG
    try:
        parse_version(sglang_version)
    except ValueError as e:
        raise SystemExit(f"error: --emulate-sglang: {e}") from None
    try:
        layout = layout_of(args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    store = None
    if layout.tp_size > 1:
        from megatron_sao.engines.embedded import tp
        from megatron_sao.engines.embedded.server import serve_follower

        children = start_node_ranks(argv, layout) if args.tp_rank is None else []
        tp_rank = layout.node_ranks[0] if args.tp_rank is None else args.tp_rank
        store = tp.join(layout, tp_rank)
        threading.Thread(target=tp.watch_ranks, args=(store, layout, children, tp_rank), name="engine-tp-watch",
                         daemon=True).start()  # fmt: skip
        if tp_rank != 0:
            serve_follower(store, tp_rank, layout.tp_size, args.model, dtype=args.dtype,
                           max_running=args.max_running_requests, context_length=args.context_length,
                           sglang_version=sglang_version, in_place=args.load_in_place)  # fmt: skip
            return 0
    try:
        state = build_state(
            args.model,
            dtype=args.dtype,
            max_running=args.max_running_requests,
            context_length=args.context_length,
            skip_tokenizer_init=args.skip_tokenizer_init,
            weight_version=args.weight_version,
            sglang_version=sglang_version,
            in_place=args.load_in_place,
            session_timeout_s=args.weight_session_timeout,
            tp_store=store,
            tp_layout=layout,
            enable_return_routed_experts=args.enable_return_routed_experts,
        )
    except ValueError as e:  # a model the engine cannot serve as given: named, no traceback
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    from megatron_sao.engines.auth import run_key

    try:
        state.api_key = args.api_key or run_key()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    serve(state, args.host, args.port)
    return 0

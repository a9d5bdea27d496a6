"""`python -m megatron_sao engine --model DIR --port N [options]`: start the embedded engine (called by cli.py)."""

from __future__ import annotations

import argparse
import logging

from megatron_sao.engines import protocol as P


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
    p.add_argument("--weight-session-timeout", type=float, default=300.0, metavar="S",
                   help="discard a weight-update session no update touched for S seconds (its trainer is gone) and "
                   "resume generating")  # fmt: skip
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


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
    state = build_state(
        args.model,
        dtype=args.dtype,
        max_running=args.max_running_requests,
        context_length=args.context_length,
        skip_tokenizer_init=args.skip_tokenizer_init,
        weight_version=args.weight_version,
        sglang_version=sglang_version,
        session_timeout_s=args.weight_session_timeout,
    )
    serve(state, args.host, args.port)
    return 0

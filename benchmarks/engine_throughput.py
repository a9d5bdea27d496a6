#!/usr/bin/env python
"""Generated tokens/s of the embedded engine: N concurrent requests (continuous batching) vs the same N requests one
after another, side by side in one run, over HTTP to an engine process. Prints both rates and their ratio.

python benchmarks/engine_throughput.py [--model DIR | --family qwen3_moe --hidden 64 --layers 2]
                                       [--requests 32] [--new-tokens 64] [--threads 1]
No timing asserts: this measures, it does not judge.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_sao.distributed.spawn import find_free_port  # noqa: E402
from megatron_sao.engines.client import SGLangClient  # noqa: E402
from megatron_sao.models.tiny import make_tiny_model  # noqa: E402


def run(client: SGLangClient, prompts: list[list[int]], new_tokens: int, concurrent: bool) -> tuple[int, float]:
    sampling = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 0}
    t0 = time.perf_counter()
    if concurrent:
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: client.generate(p, sampling), prompts))
    else:
        results = [client.generate(p, sampling) for p in prompts]
    return sum(len(r.output_ids) for r in results), time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF model directory (default: a fresh tiny model)")
    p.add_argument("--family", default="qwen3_moe")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine process")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or str(make_tiny_model(a.family, Path(tmp) / "m", hidden=a.hidden, layers=a.layers))
        port = find_free_port()
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(a.threads)}
        cmd = [sys.executable, "-m", "megatron_sao", "engine", "--model", model, "--port", str(port), "--threads",
               str(a.threads), "--max-running-requests", str(a.requests), "--log-level", "warning"]  # fmt: skip
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
        try:
            client = SGLangClient(f"http://127.0.0.1:{port}")
            deadline = time.monotonic() + 120
            while not client.health(1.0):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("engine did not start")
                time.sleep(0.2)
            prompts = [[1 + (i * 7 + j) % 300 for j in range(a.prompt_len)] for i in range(a.requests)]
            run(client, prompts[:2], 4, concurrent=True)  # warm-up
            seq_tokens, seq_s = run(client, prompts, a.new_tokens, concurrent=False)
            bat_tokens, bat_s = run(client, prompts, a.new_tokens, concurrent=True)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    seq, bat = seq_tokens / seq_s, bat_tokens / bat_s
    name = model if a.model else f"tiny {a.family} hidden={a.hidden} layers={a.layers}"
    print(
        f"model {name}, {a.requests} requests x {a.new_tokens} new tokens, prompt {a.prompt_len}, {a.threads} thread(s)"
    )
    print(f"sequential : {seq_tokens} tokens in {seq_s:.2f}s = {seq:.1f} tok/s")
    print(f"batched    : {bat_tokens} tokens in {bat_s:.2f}s = {bat:.1f} tok/s")
    print(f"batched / sequential = {bat / seq:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

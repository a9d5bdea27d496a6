"""Peak memory of the two conversion tools against the model size: do they stream?

    PYTHONPATH=. python benchmarks/conversion_memory.py [--layers 8 --hidden 1024 --experts 16] [--workdir DIR]

Builds a tiny random Qwen3-MoE (fp32, saved in --hf-shard-size safetensors shards), then runs
convert_hf_to_megatron and convert_megatron_to_hf (--max-shard-size HF shards), each in a fresh process that
first imports torch/megatron/transformers and sets up the world-size-1 process group (the fixed cost, measured
as the baseline), then converts while a thread samples /proc/self/status every 5 ms. It prints, per direction:
baseline RSS, peak RSS (VmHWM, includes memory-mapped file pages), peak anonymous RSS (RssAnon: the memory the
process itself allocated), both minus the baseline, next to the model size, the largest decoder layer and the
largest HF shard. It asserts nothing.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _measured(direction: str, args: tuple, results: Any) -> None:
    import torch  # noqa: F401 - the fixed cost is part of the baseline
    import transformers  # noqa: F401
    from megatron.core import dist_checkpointing  # noqa: F401
    from megatron.core.models.gpt import GPTModel  # noqa: F401

    from megatron_sao.config.parallel import ParallelConfig
    from megatron_sao.convert.hf_to_megatron import convert_hf_to_megatron
    from megatron_sao.convert.megatron_to_hf import convert_megatron_to_hf
    from megatron_sao.distributed import init_distributed

    init_distributed(ParallelConfig())
    baseline = _status()
    peak = {"RssAnon": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak["RssAnon"] = max(peak["RssAnon"], _status()["RssAnon"])
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    if direction == "hf->megatron":
        convert_hf_to_megatron(*args, progress=False)
    else:
        convert_megatron_to_hf(*args[:3], max_shard_size=args[3], progress=False)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    final = _status()
    results.put(dict(baseline=baseline, peak_hwm=final["VmHWM"], peak_anon=peak["RssAnon"], seconds=seconds))


def _run(direction: str, *args: Any) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    p = ctx.Process(target=_measured, args=(direction, args, results))
    p.start()
    out = results.get(timeout=3600)
    p.join()
    return out


def _sizes(hf_dir: Path) -> tuple[int, int, int]:
    """(model bytes, largest decoder layer bytes, largest safetensors file bytes)"""
    import re

    from megatron_sao.models.weights import HFCheckpoint

    hf = HFCheckpoint(hf_dir)
    layers: dict[int, int] = {}
    total = 0
    for name in hf.names():
        nbytes = hf.dtype(name).itemsize
        for s in hf.shape(name):
            nbytes *= s
        total += nbytes
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m:
            layers[int(m.group(1))] = layers.get(int(m.group(1)), 0) + nbytes
    return total, max(layers.values()), max(f.stat().st_size for f in hf.files())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--hf-shard-size", default="100MB", help="shards of the source HF model")
    p.add_argument("--max-shard-size", default="100MB", help="shards written by megatron -> HF")
    p.add_argument("--workdir", default=None, help="where to put the models (default: a temporary directory)")
    a = p.parse_args()
    from megatron_sao.models.tiny import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="sao_convmem_", dir=a.workdir) as tmp:
        root = Path(tmp)
        hf = make_tiny_model(
            "qwen3_moe", root / "hf", layers=a.layers, hidden=a.hidden, experts=a.experts,
            max_shard_size=a.hf_shard_size, tokenizer=False,
        )  # fmt: skip
        model, layer, shard = _sizes(hf)
        rows = [
            ("hf->megatron", _run("hf->megatron", str(hf), str(root / "ckpt"))),
            ("megatron->hf", _run("megatron->hf", str(root / "ckpt"), str(root / "back"), str(hf), a.max_shard_size)),
        ]
    print(
        f"qwen3_moe fp32: {a.layers} layers, hidden {a.hidden}, {a.experts} experts: model {model / MIB:.0f} MiB, "
        f"largest layer {layer / MIB:.0f} MiB, largest HF shard {shard / MIB:.0f} MiB"
    )
    print(f"{'direction':14} {'baseline':>9} {'peak RSS':>9} {'+':>7} {'peak anon':>10} {'+':>7} {'time':>7}")
    for name, r in rows:
        base, anon_base = r["baseline"]["VmRSS"], r["baseline"]["RssAnon"]
        print(
            f"{name:14} {base / MIB:8.0f}M {r['peak_hwm'] / MIB:8.0f}M {(r['peak_hwm'] - base) / MIB:6.0f}M "
            f"{r['peak_anon'] / MIB:9.0f}M {(r['peak_anon'] - anon_base) / MIB:6.0f}M {r['seconds']:6.1f}s"
        )


if __name__ == "__main__":
    main()

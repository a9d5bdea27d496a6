#!/usr/bin/env python
"""A full weight push vs a raw broadcast of the same bytes, side by side in one run, at PP=1 and PP=2 sources.

Per layout (one learner rank per pipeline stage, gloo on CPU), interleaved `--repeats` times:
  push      WeightSync.push into a running embedded engine: pause, begin, the stages' gathers and packing, one
            flattened bucket per request, the marker, end (the engine commits its staged copy), continue;
            verification none (what the checksums cost is printed apart; --per-tensor also times, after the packed
            rounds, the per-tensor protocol of SGLang < 0.5.6).
  raw       each stage source broadcasts its stage's bytes as ONE buffer to a bare receiver rank over an update
            group of the same shape (1 source + 1 receiver rank per stage, all stages at once): the transport floor.
  raw+copy  the fair CPU floor: the raw broadcast plus one memory copy of the stage's bytes (a push must land them in
            the model at least once; on a CPU box that pass competes with the transfer for the same cores).
Prints the medians, `overhead ratio X` (push / raw at PP=1, packed path; target <= 1.25), `fair overhead ratio X`
(push / (raw + copy)) with the push's control time (choosing the engines, the requests, the engine's commit) shown
apart, the PP=1 -> PP=2 speed-up of the push, and per rank the push's extra memory: the MemoryMeter peak (every
buffer the push allocated) against the plan's bound (2 buckets + the largest tensor), and the process's RSS
high-water growth during one push.

Then (`--part tp2`, or all) the shard-aware path into engines at TP=2: two TP=2 embedded engines, each kept decoding
by a stream of requests, take the same pushes interleaved -- whole tensors to one (weight_sync.transfer full), each
rank only its blocks to the other (transfer auto: sharded) -- both with pause_mode none (the push is staged while
the engine decodes, and switched at one token boundary). Prints `bytes per engine rank shard-aware/full X` (the
largest rank's bytes, from the learner's per-rank accounting, which the tests check against the engine's traffic),
the push times, tokens decoded during each push, and `engine stall / push X`: 1 - (tokens per second decoded during
the shard-aware pushes) / (tokens per second in an equally long idle window just before), medians over the repeats.
On one CPU machine the learner's packing shares the cores with the engines, which counts as stall here too; so the
engine's own count is printed beside it, `engine-counted stall / push`: the seconds its scheduler spent in calls at
a token boundary (the commit) and paused (`/server_info` load boundary_s + paused_s) over the push's wall time.

Then (`--part agent`, or all) the push agent's path: full pushes into a TP=2 engine paused in place for the whole
push (SGLang's own path) against pushes through a push agent beside a second TP=2 engine; both engines load in place
as SGLang does (`--load-in-place`: each update copied into the live model at its call, no staging), so the agent
pauses its engine in place for the handover, as it must an SGLang engine. Prints
`bytes per engine rank agent/full X` (here the embedded engine's "direct" blocks; SGLang's "hf" handover sends dense
tensors whole and only the rank's experts: `plan` gives those bytes) and `engine stall / push X` for each path, as
the engine counts it (paused + commit over the push's wall time).

Then (`--part delta`, or all) pushes of only what changed (weight_sync.delta): a bf16 model (HF dtype bf16, fp32
master weights), real SAO policy steps on synthetic on-policy batches at each `--delta-lrs` (the paper's 1e-6, the
tiny_agentic example's 5e-4), after every step the same weights pushed whole to one embedded engine and as deltas to
another (order alternating). Prints per lr the change density (bf16 elements changed per push, from the sender's
comparison), `bytes per push delta/full X` and `push time delta/full X`, medians over the steps after the first
(which goes whole), and the sources' bases (the memory deltas cost).

    python benchmarks/weight_sync.py [--hidden 512 --layers 8 --experts 8 --vocab 16384 --bucket-mb 32 --repeats 5]
                                     [--part all|pp|tp2|agent|delta] [--delta-lrs 1e-6,5e-4 --delta-steps 6]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]


def _rss_hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_hwm() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux)


def _rank(hf_dir: str, pp: int, url: str, ports: dict[str, int], args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from megatron_sao.config import load_config
    from megatron_sao.distributed import init_distributed
    from megatron_sao.distributed.update_group import host_store, init_update_group
    from megatron_sao.learner.learner import Learner
    from megatron_sao.weight_sync import WeightSync, hf_dtype_of

    torch.set_num_threads(1)
    cfg = load_config(None, [
        "--model.hf_path", hf_dir, "--model.dtype", "fp32", "--parallel.pipeline", str(pp),
        "--launch.nproc_per_node", str(pp), "--weight_sync.bucket_mb", str(args["bucket_mb"]),
        "--weight_sync.master_port", str(ports["sync"]), "--weight_sync.verify", "none",
    ])  # fmt: skip
    ctx = init_distributed(cfg.parallel, seed=0)
    learner = Learner(cfg, roles={"policy"}, layout=ctx)
    learner.load_hf(hf_dir)
    dtype_of = hf_dtype_of(learner.hf_source, torch.float32)
    packed = WeightSync(learner.policy.model, learner.spec, dtype_of, cfg.weight_sync, [url], layout=ctx)
    cfg_tensor = cfg.weight_sync.model_copy(update={"load_format": "per_tensor", "master_port": ports["sync"] + 200,
                                                    "group_name": "per_tensor"})  # fmt: skip
    per_tensor = None
    if args["per_tensor"]:  # collective: every rank builds it or none does
        per_tensor = WeightSync(learner.policy.model, learner.spec, dtype_of, cfg_tensor, [url], layout=ctx)
    stage_bytes = sum(b.send_bytes for b in packed.stage.buckets)
    raw_buf = torch.empty(stage_bytes, dtype=torch.uint8) if packed.is_source else None
    # the fair floor's one memory copy of the stage (what the engine's commit must do at least once)
    copy_buf = torch.ones(stage_bytes, dtype=torch.uint8) if packed.is_source else None
    raw_group = None
    if packed.is_source:  # the raw floor's group: this source + one bare receiver rank, as a push's group
        Path(f"{args['sizes']}.{packed.stage.stage}").write_text(str(stage_bytes))
        store, port = host_store("127.0.0.1", ports["raw"] + packed.stage.stage, 2, 300.0, tries=1)
        name = f"raw{pp}_{packed.stage.stage}"  # group names are unique per process (the receiver's too)
        raw_group = init_update_group("gloo", "127.0.0.1", port, 2, 0, name, 300.0, store=store)
    out: dict[str, list[float]] = {"push": [], "raw": [], "copy": [], "control": [], "per_tensor": []}
    phases: dict[str, list[float]] = {}
    version = 0
    rss_first = 0.0
    for rep in range(args["repeats"] + 1):  # the first round warms up and is dropped
        version += 1
        dist.barrier()
        if not rep:
            _reset_hwm()
            base = _rss_hwm_mb()
        t0 = time.monotonic()
        metrics = packed.push(version)
        dist.barrier()
        push_s = time.monotonic() - t0
        if not rep:
            rss_first = _rss_hwm_mb() - base
        if rep:
            for k, v in metrics.items():
                if k.startswith("sync/time_") or k == "sync/stage_seconds_max":
                    phases.setdefault(k.removeprefix("sync/"), []).append(v)
        dist.barrier()
        t0 = time.monotonic()
        if raw_group is not None:
            dist.broadcast(raw_buf, src=0, group=raw_group)
        dist.barrier()
        raw_s = time.monotonic() - t0
        t0 = time.monotonic()
        if copy_buf is not None:
            copy_buf.copy_(raw_buf)
        dist.barrier()
        copy_s = time.monotonic() - t0
        if rep:
            out["push"].append(push_s)
            out["raw"].append(raw_s)
            out["copy"].append(copy_s)
            # everything but the bytes' transfer: choosing the engines, the requests around it, the engine's commit
            out["control"].append(sum(metrics.get(f"sync/time_{k}", 0.0) for k in ("plan", "connect", "open",
                                                                                     "finish")))  # fmt: skip
    if per_tensor is not None:  # apart: two syncs taking turns on one engine would re-form groups at every push
        for rep in range(args["repeats"] + 1):
            version += 1
            dist.barrier()
            t0 = time.monotonic()
            per_tensor.push(version)
            dist.barrier()
            if rep:
                out["per_tensor"].append(time.monotonic() - t0)
    _reset_hwm()
    base = _rss_hwm_mb()
    version += 1
    packed.push(version)
    rss = _rss_hwm_mb() - base
    verify_cfg = cfg.weight_sync.model_copy(update={"verify": "auto"})
    packed.cfg = verify_cfg
    t0 = time.monotonic()
    version += 1
    packed.push(version)
    dist.barrier()
    verified_s = time.monotonic() - t0
    return {"times": out, "phases": {k: statistics.median(v) for k, v in phases.items()},
            "stage_bytes": stage_bytes, "source": packed.is_source, "peak": packed.peak_bytes,
            "bound": packed.plan.memory_bound(), "rss_growth_mb": rss, "rss_first_mb": rss_first,
            "verified_s": verified_s,
            "buckets": len(packed.stage.buckets), "largest": packed.plan.largest_tensor_bytes}  # fmt: skip


def _receiver(ports: dict[str, int], stages: int, rounds: int, sizes: str, tag: str = "") -> None:
    """The raw floor's far end: rank 1 of one 2-rank group per stage (joined one after the other: torch builds
    process groups one at a time), then receiving each stage's buffer every round, all stages at once. (`--part tp2`:
    one group per engine rank, each receiving that rank's bytes.)"""
    from megatron_sao.distributed.update_group import init_update_group

    groups, buffers = {}, {}
    for s in range(stages):
        path = Path(f"{sizes}.{s}")
        while not path.is_file():
            time.sleep(0.05)
        buffers[s] = torch.empty(int(path.read_text()), dtype=torch.uint8)
        groups[s] = init_update_group("gloo", "127.0.0.1", ports["raw"] + s, 2, 1, f"{tag or f'raw{stages}'}_{s}",
                                      300.0)  # fmt: skip

    def run(s: int) -> None:
        for _ in range(rounds):
            torch.distributed.broadcast(buffers[s], src=0, group=groups[s])

    threads = [threading.Thread(target=run, args=(s,)) for s in range(stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g in groups.values():
        torch.distributed.destroy_process_group(g)


def _decoding(url: str, stop: threading.Event) -> threading.Thread:
    """Keep an engine decoding: one greedy request after another until `stop`."""
    from megatron_sao.engines.client import SGLangClient

    def run() -> None:
        client = SGLangClient(url, timeout_s=600)
        while not stop.is_set():
            with contextlib.suppress(Exception):
                client.generate([3, 17, 29, 5, 11], {"max_new_tokens": 64, "temperature": 0.0, "ignore_eos": True})

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _tokens(url: str) -> int:
    from megatron_sao.engines.client import SGLangClient

    return int(SGLangClient(url).server_info()["load"]["generated_tokens"])


def _held_s(url: str) -> float:
    """What the engine itself counts as not decoding for a push: boundary calls (the commit) and time paused."""
    from megatron_sao.engines.client import SGLangClient

    load = SGLangClient(url).server_info()["load"]
    return float(load["boundary_s"]) + float(load["paused_s"])


class _RawFloor:
    """The shard-aware push's fair CPU floor: the bytes each engine rank received in a push, broadcast raw as one
    buffer per rank over its own 2-rank group (all ranks at once, as the push's block groups), then copied once (the
    engine's commit must land them in the model at least once)."""

    def __init__(self, rank_bytes: list[int], port: int, sizes: str) -> None:
        from megatron_sao.distributed.update_group import host_store, init_update_group

        self.buffers = [torch.ones(n, dtype=torch.uint8) for n in rank_bytes]
        self.copies = [torch.zeros(n, dtype=torch.uint8) for n in rank_bytes]
        self.groups = []
        for i, n in enumerate(rank_bytes):
            Path(f"{sizes}.{i}").write_text(str(n))
            store, bound = host_store("127.0.0.1", port + i, 2, 300.0, tries=1)
            self.groups.append(init_update_group("gloo", "127.0.0.1", bound, 2, 0, f"rawtp_{i}", 300.0, store=store))

    def run(self) -> tuple[float, float]:
        """(raw broadcast s, one copy s)."""
        import torch.distributed as dist

        t0 = time.monotonic()
        threads = [threading.Thread(target=dist.broadcast, args=(b, 0, g)) for b, g in zip(self.buffers, self.groups)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        raw_s = time.monotonic() - t0
        t0 = time.monotonic()
        for c, b in zip(self.copies, self.buffers):
            c.copy_(b)
        return raw_s, time.monotonic() - t0


def _tp2_rank(hf_dir: str, urls: dict[str, str], port: int, args: dict[str, Any]) -> dict[str, Any]:
    """One learner rank: interleaved full and shard-aware pushes into two decoding TP=2 engines; after each shard-aware
    push, its raw floor (_RawFloor)."""
    import torch.distributed as dist

    from megatron_sao.config import load_config
    from megatron_sao.distributed import init_distributed
    from megatron_sao.learner.learner import Learner
    from megatron_sao.weight_sync import WeightSync, hf_dtype_of

    torch.set_num_threads(1)
    cfg = load_config(None, [
        "--model.hf_path", hf_dir, "--model.dtype", "fp32", "--launch.nproc_per_node", "1",
        "--weight_sync.bucket_mb", str(args["bucket_mb"]), "--weight_sync.verify", "none",
        "--weight_sync.pause_mode", "none",
    ])  # fmt: skip
    ctx = init_distributed(cfg.parallel, seed=0)
    learner = Learner(cfg, roles={"policy"}, layout=ctx)
    learner.load_hf(hf_dir)
    dtype_of = hf_dtype_of(learner.hf_source, torch.float32)
    syncs = {}
    modes = args.get("modes") or {"full": ("full", "none"), "sharded": ("auto", "none")}
    for i, (key, (transfer, pause)) in enumerate(modes.items()):
        ws = cfg.weight_sync.model_copy(update={"transfer": transfer, "master_port": port + 50 * i,
                                                "group_name": f"bench_{key}", "pause_mode": pause})  # fmt: skip
        syncs[key] = WeightSync(learner.policy.model, learner.spec, dtype_of, ws, [urls[key]], layout=ctx)
    stop = threading.Event()
    streams = [_decoding(u, stop) for u in urls.values()]
    time.sleep(2.0)
    out: dict[str, list[float]] = {f"{k}_{m}": [] for k in syncs
                                   for m in ("s", "tokens", "idle_rate", "rank_mb", "held_s", "control")}  # fmt: skip
    out.update({"raw_s": [], "copy_s": []})
    floor: _RawFloor | None = None
    for rep in range(args["repeats"] + 1):  # the first round forms the groups and is dropped
        version = rep + 1
        for key, sync in syncs.items():
            url = urls[key]
            window = statistics.median(out[f"{key}_s"]) if out[f"{key}_s"] else 1.0
            t0, n0 = time.monotonic(), _tokens(url)
            time.sleep(window)
            idle_rate = (_tokens(url) - n0) / (time.monotonic() - t0)
            n0, h0, t0 = _tokens(url), _held_s(url), time.monotonic()
            metrics = sync.push(version)
            seconds, tokens, held = time.monotonic() - t0, _tokens(url) - n0, _held_s(url) - h0
            if metrics.get("sync/failed"):
                raise SystemExit(f"{key} push failed: {metrics}")
            if rep:
                out[f"{key}_s"].append(seconds)
                out[f"{key}_tokens"].append(tokens)
                out[f"{key}_idle_rate"].append(idle_rate)
                out[f"{key}_rank_mb"].append(metrics["sync/engine_rank_mb_max"])
                out[f"{key}_held_s"].append(held)
                out[f"{key}_control"].append(
                    sum(metrics.get(f"sync/time_{k}", 0.0) for k in ("plan", "connect", "open", "finish"))
                )
                for k, v in metrics.items():
                    if k.startswith("sync/time_"):
                        out.setdefault(f"{key}_{k.removeprefix('sync/')}", []).append(v)
            if key == "sharded":
                if floor is None:  # sized by what each engine rank received in this (first) push
                    sender = sync.sender
                    assert sender is not None and sender.rank_bytes is not None
                    floor = _RawFloor(sender.rank_bytes[url], args["raw_port"], args["sizes"])
                if rep:
                    raw_s, copy_s = floor.run()
                    out["raw_s"].append(raw_s)
                    out["copy_s"].append(copy_s)
    stop.set()
    for t in streams:
        t.join(120)
    for sync in syncs.values():
        sync.close()
    dist.barrier()
    return out


def _start_engine(hf_dir: str, work: Path, name: str, *extra: str) -> tuple[subprocess.Popen, str]:
    port = find_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    log = open(work / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the engine
    proc = subprocess.Popen([sys.executable, "-m", "megatron_sao", "engine", "--model", hf_dir, "--port", str(port),
                             "--threads", "1", *extra], stdout=log, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> None:
    from megatron_sao.engines.client import SGLangClient

    client, deadline = SGLangClient(url), time.monotonic() + 300
    while not client.health(timeout_s=1.0):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"engine did not start: {log.read_text()[-2000:]}")
        time.sleep(0.3)


def find_port() -> int:
    from megatron_sao.distributed.spawn import find_free_port

    return find_free_port()


def shard_aware(hf_dir: str, work: Path, args: argparse.Namespace, results: dict[str, Any]) -> None:
    from megatron_sao.distributed import spawn_ranks

    engines = {k: _start_engine(hf_dir, work, f"tp2_{k}", "--tp-size", "2") for k in ("full", "sharded")}
    try:
        for k, (proc, url) in engines.items():
            _wait_healthy(proc, url, work / f"tp2_{k}.log")
        urls = {k: url for k, (_, url) in engines.items()}
        raw_port, sizes = find_port(), str(work / "tp2_rank_bytes")
        rx = threading.Thread(target=_receiver, args=({"raw": raw_port}, 2, args.repeats, sizes, "rawtp"), daemon=True)
        rx.start()
        opts = {"bucket_mb": args.bucket_mb, "repeats": args.repeats, "raw_port": raw_port, "sizes": sizes}
        (out,) = spawn_ranks(_tp2_rank, 1, hf_dir, urls, find_port(), opts, timeout_s=3000)
        rx.join(60)
    finally:
        for proc, _ in engines.values():
            proc.kill()
            proc.wait()
    results["tp2"] = out
    med = {k: statistics.median(v) for k, v in out.items()}
    print(f"TP=2 engines, pause_mode none, {args.repeats} repeats (medians):")
    for key in ("full", "sharded"):
        rate = med[f"{key}_tokens"] / med[f"{key}_s"]
        print(f"  {key:8s} push {med[f'{key}_s']:.3f} s (runs {', '.join(f'{x:.3f}' for x in out[f'{key}_s'])}); "
              f"largest engine rank received {med[f'{key}_rank_mb']:.1f} MB; {med[f'{key}_tokens']:.0f} tokens "
              f"decoded during the push ({rate:.1f}/s vs {med[f'{key}_idle_rate']:.1f}/s idle)")  # fmt: skip
        phases = {k.removeprefix(f"{key}_time_"): v for k, v in med.items() if k.startswith(f"{key}_time_")}
        print("    phases (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    stalls = [max(0.0, 1 - (n / s) / idle) for n, s, idle in
              zip(out["sharded_tokens"], out["sharded_s"], out["sharded_idle_rate"])]  # fmt: skip
    print(f"bytes per engine rank shard-aware/full {med['sharded_rank_mb'] / med['full_rank_mb']:.2f}")
    print(f"engine stall / push {statistics.median(stalls):.2f} (runs {', '.join(f'{x:.2f}' for x in stalls)})")
    push, fair = statistics.median(out["sharded_s"]), statistics.median([r + c for r, c in
                                                                        zip(out["raw_s"], out["copy_s"])])  # fmt: skip
    control = statistics.median(out["sharded_control"])
    print(f"fair CPU overhead (shard-aware): push {push:.3f} s / (raw broadcast of each engine rank's bytes "
          f"{statistics.median(out['raw_s']):.3f} s + one copy {statistics.median(out['copy_s']):.3f} s) "
          f"{push / fair:.2f}; control (plan, requests, the engine's commit) {control:.3f} s of the push, "
          f"without it {(push - control) / fair:.2f}")  # fmt: skip
    for key in ("full", "sharded"):  # the engine's own count: no CPU contention in it
        held = [h / s for h, s in zip(out[f"{key}_held_s"], out[f"{key}_s"])]
        print(f"engine-counted stall / push ({key}: commit at the token boundary + paused) "
              f"{statistics.median(held):.2f} (runs {', '.join(f'{x:.2f}' for x in held)})")  # fmt: skip


def agent_path(hf_dir: str, work: Path, args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Full pushes into a TP=2 engine paused in place (SGLang's path) against pushes through a push agent beside a
    second TP=2 engine, the agent pausing it in place for the handover as it must an SGLang engine; both engines
    load in place as SGLang does (--load-in-place: one copy per update, no staging)."""
    from megatron_sao.distributed import spawn_ranks
    from megatron_sao.engines.client import SGLangClient

    engines = {
        k: _start_engine(hf_dir, work, f"agent_{k}", "--tp-size", "2", "--load-in-place") for k in ("full", "agent")
    }  # SGLang's loading: each update into the live model at its call
    agent = None
    try:
        for k, (proc, url) in engines.items():
            _wait_healthy(proc, url, work / f"agent_{k}.log")
        agent_port = find_port()
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        log = open(work / "agent.log", "wb")  # noqa: SIM115 - lives as long as the agent
        agent = subprocess.Popen([sys.executable, "-m", "megatron_sao", "agent", "--engine", engines["agent"][1],
                                  "--port", str(agent_port)], stdout=log,
                                 stderr=subprocess.STDOUT, env=env)  # fmt: skip
        agent_url = f"http://127.0.0.1:{agent_port}"
        _wait_healthy(agent, agent_url, work / "agent.log")
        urls = {"full": engines["full"][1], "agent": agent_url}
        opts = {"bucket_mb": args.bucket_mb, "repeats": args.repeats,
                "modes": {"full": ("full", "in_place"), "agent": ("auto", "auto")}}  # fmt: skip
        (out,) = spawn_ranks(_tp2_rank, 1, hf_dir, urls, find_port(), opts, timeout_s=3000)
        handover = SGLangClient(agent_url).server_info()["handover"]  # where the engine's stop went, per phase
    finally:
        for proc in [p for p, _ in engines.values()] + ([agent] if agent is not None else []):
            proc.kill()
            proc.wait()
    results["agent"] = out
    results["agent_handover"] = handover
    med = {k: statistics.median(v) for k, v in out.items() if v}
    print(f"TP=2 engines: full push paused in place (SGLang's path) vs through a push agent, {args.repeats} repeats "
          "(medians):")  # fmt: skip
    for key in ("full", "agent"):
        print(f"  {key:6s} push {med[f'{key}_s']:.3f} s (runs {', '.join(f'{x:.3f}' for x in out[f'{key}_s'])}); "
              f"largest engine rank received {med[f'{key}_rank_mb']:.1f} MB; {med[f'{key}_tokens']:.0f} tokens "
              f"decoded during the push")  # fmt: skip
    print(f"bytes per engine rank agent/full {med['agent_rank_mb'] / med['full_rank_mb']:.2f}")
    for key in ("agent", "full"):
        held = [h / s for h, s in zip(out[f"{key}_held_s"], out[f"{key}_s"])]
        print(f"engine stall / push ({key}: paused + commit, counted by the engine) {statistics.median(held):.2f} "
              f"(runs {', '.join(f'{x:.2f}' for x in held)})")  # fmt: skip
    n = max(handover["handovers"], 1)
    print(f"agent handover, mean of {handover['handovers']} (the first included): "
          + ", ".join(f"{k} {1000 * v / n:.0f} ms" for k, v in handover.get("phases_s", {}).items()))  # fmt: skip


def _delta_rank(hf_dir: str, urls: dict[str, str], port: int, lr: float, args: dict[str, Any]) -> dict[str, Any]:
    """One learner rank at policy lr `lr`: after each policy step, the same weights pushed whole and as deltas."""
    from transformers import AutoModelForCausalLM

    from megatron_sao.config import load_config
    from megatron_sao.distributed import destroy_distributed, init_distributed
    from megatron_sao.learner.learner import Learner
    from megatron_sao.learner.synthetic import make_batch
    from megatron_sao.weight_sync import WeightSync, hf_dtype_of

    torch.set_num_threads(1)
    cfg = load_config(None, [
        "--model.hf_path", hf_dir, "--model.dtype", "fp32", "--launch.nproc_per_node", "1",
        "--learner.max_tokens_per_microbatch", "256", "--learner.policy.lr", str(lr),
        "--learner.policy.warmup_steps", "0", "--learner.value.lr", str(5 * lr),
        "--weight_sync.bucket_mb", str(args["bucket_mb"]), "--weight_sync.verify", "none",
    ])  # fmt: skip
    ctx = init_distributed(cfg.parallel, seed=0)
    learner = Learner(cfg, layout=ctx)
    learner.load_hf(hf_dir)
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    dtype_of = hf_dtype_of(learner.hf_source, torch.float32)
    syncs = {}
    for i, key in enumerate(("full", "delta")):
        ws = cfg.weight_sync.model_copy(update={"delta": key, "master_port": port + 50 * i,
                                                "group_name": f"bench_{key}"})  # fmt: skip
        syncs[key] = WeightSync(learner.policy.model, learner.spec, dtype_of, ws, [urls[key]], layout=ctx)
        syncs[key].pushes = 1000 * i  # two pushers in one learner: their push orders' keys differ
    out: dict[str, list[float]] = {k: [] for k in ("full_s", "delta_s", "full_bytes", "delta_bytes", "density",
                                                   "fp32_changed", "base_mb")}  # fmt: skip
    vocab = int(reference.config.vocab_size)
    for step in range(args["steps"] + 1):
        if step:  # the first push of each path carries the launch weights: the delta path's goes whole
            batch = make_batch(8, seed=step, vocab=vocab)
            with torch.no_grad():  # on-policy log-probs (the initial model's): DIS keeps the tokens
                for t in batch:
                    toks = torch.from_numpy(t.tokens.astype("int64")).view(1, -1)
                    logp = torch.log_softmax(reference(toks).logits[0, :-1], -1).gather(1, toks[0, 1:].view(-1, 1))
                    t.rollout_logprobs[1:] = (logp.view(-1).numpy() * t.action_mask[1:]).astype("float32")
            before = [p.detach().clone() for p in learner.policy.model.parameters()]
            learner.train_step(batch)
            moved = sum(int((p.detach() != b).sum()) for p, b in zip(learner.policy.model.parameters(), before))
            out["fp32_changed"].append(moved / sum(b.numel() for b in before))
        order = ("full", "delta") if step % 2 else ("delta", "full")
        for key in order:
            t0 = time.monotonic()
            metrics = syncs[key].push(step + 1)
            seconds = time.monotonic() - t0
            if metrics.get("sync/failed"):
                raise SystemExit(f"{key} push failed: {metrics}")
            if step:
                out[f"{key}_s"].append(seconds)
                out[f"{key}_bytes"].append(metrics["sync/bytes"])
                if key == "delta":
                    out["density"].append(metrics["sync/delta_density"])
                    out["base_mb"].append(metrics["sync/delta_base_mb"])
    for sync in syncs.values():
        sync.close()
    destroy_distributed()
    return out


def delta_path(work: Path, args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Whole pushes against delta pushes of the same weights after real policy steps, per learning rate."""
    from megatron_sao.distributed import spawn_ranks
    from megatron_sao.models.tiny import make_tiny_model

    hf_dir = str(make_tiny_model(args.family, work / "model_bf16", layers=args.layers, hidden=args.hidden,
                                 experts=args.experts, vocab_size=args.vocab, dtype="bf16"))  # fmt: skip
    engines = {k: _start_engine(hf_dir, work, f"delta_{k}") for k in ("full", "delta")}
    try:
        for k, (proc, url) in engines.items():
            _wait_healthy(proc, url, work / f"delta_{k}.log")
        urls = {k: url for k, (_, url) in engines.items()}
        opts = {"bucket_mb": args.bucket_mb, "steps": args.delta_steps}
        for lr in (float(x) for x in args.delta_lrs.split(",")):
            (out,) = spawn_ranks(_delta_rank, 1, hf_dir, urls, find_port(), lr, opts, timeout_s=3000)
            results[f"delta_lr={lr:g}"] = out
            med = {k: statistics.median(v) for k, v in out.items() if v}
            ratios = [d / f for d, f in zip(out["delta_bytes"], out["full_bytes"])]
            times = [d / f for d, f in zip(out["delta_s"], out["full_s"])]
            print(f"policy lr {lr:g}, {args.delta_steps} policy steps, a push after each (medians; the first push "
                  f"of each path not counted): bf16 elements changed per push {med['density']:.4f} (fp32 master "
                  f"weights: {med['fp32_changed']:.3f}); full push {med['full_bytes'] / 2**20:.1f} MB in "
                  f"{med['full_s']:.3f} s, delta push {med['delta_bytes'] / 2**20:.2f} MB in {med['delta_s']:.3f} s; "
                  f"the source's bases {med['base_mb']:.1f} MB")  # fmt: skip
            print(f"  bytes per push delta/full {statistics.median(ratios):.4f} "
                  f"(runs {', '.join(f'{x:.4f}' for x in ratios)})")  # fmt: skip
            print(
                f"  push time delta/full {statistics.median(times):.2f} (runs {', '.join(f'{x:.2f}' for x in times)})"
            )
    finally:
        for proc, _ in engines.values():
            proc.kill()
            proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="qwen3_moe")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--bucket-mb", type=float, default=32.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--per-tensor", action="store_true", help="also time the per-tensor protocol (SGLang < 0.5.6)")
    p.add_argument("--json", default=None, help="write the results here too")
    p.add_argument(
        "--part",
        choices=("all", "pp", "tp2", "agent", "delta"),
        default="all",
        help="pp: the push vs raw broadcast at PP=1/2; tp2: shard-aware vs full into TP=2 engines; agent: full "
        "pushes paused in place vs pushes through a push agent; delta: whole pushes vs deltas after policy steps",
    )
    p.add_argument("--delta-lrs", default="1e-6,5e-4", help="policy learning rates of --part delta")
    p.add_argument("--delta-steps", type=int, default=6, help="policy steps (pushes measured) per learning rate")
    args = p.parse_args()

    from megatron_sao.distributed import spawn_ranks
    from megatron_sao.distributed.spawn import find_free_port
    from megatron_sao.engines.client import SGLangClient
    from megatron_sao.models.tiny import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    hf_dir = str(make_tiny_model(args.family, work / "model", layers=args.layers, hidden=args.hidden,
                                 experts=args.experts, vocab_size=args.vocab))  # fmt: skip
    size_mb = sum(f.stat().st_size for f in Path(hf_dir).glob("*.safetensors")) / 2**20
    port = find_free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    log = open(work / "engine.log", "wb")  # noqa: SIM115 - lives as long as the engine
    engine = subprocess.Popen([sys.executable, "-m", "megatron_sao", "engine", "--model", hf_dir, "--port", str(port),
                               "--threads", "1"], stdout=log, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    results: dict[str, Any] = {"model_mb": size_mb, "bucket_mb": args.bucket_mb, "repeats": args.repeats}
    if args.part in ("tp2", "agent", "delta"):
        engine.kill()
        engine.wait()
        if args.part == "delta":
            delta_path(work, args, results)
        else:
            (shard_aware if args.part == "tp2" else agent_path)(hf_dir, work, args, results)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))
        return
    try:
        client = SGLangClient(url)
        deadline = time.monotonic() + 300
        while not client.health(timeout_s=1.0):
            if engine.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"engine did not start: {(work / 'engine.log').read_text()[-2000:]}")
            time.sleep(0.3)
        print(
            f"model {size_mb:.0f} MB fp32 ({args.family}, {args.layers} layers, hidden {args.hidden}, "
            f"{args.experts} experts, vocab {args.vocab}); buckets of {args.bucket_mb} MB; {args.repeats} repeats"
        )
        for pp in (1, 2):
            ports = {"sync": find_free_port(), "raw": find_free_port()}
            sizes = str(work / f"stage_bytes_pp{pp}")
            rx = threading.Thread(target=_receiver, args=(ports, pp, args.repeats + 1, sizes), daemon=True)
            rx.start()
            opts = {"bucket_mb": args.bucket_mb, "repeats": args.repeats, "per_tensor": args.per_tensor,
                    "sizes": sizes}  # fmt: skip
            per_rank = spawn_ranks(_rank, pp, hf_dir, pp, url, ports, opts, timeout_s=3000)
            rx.join(60)
            results[f"pp{pp}"] = per_rank
            t = per_rank[0]["times"]
            push, raw = statistics.median(t["push"]), statistics.median(t["raw"])
            fair = statistics.median([r + c for r, c in zip(t["raw"], t["copy"])])
            line = f"PP={pp}: push {push:.3f} s (median; runs {', '.join(f'{x:.3f}' for x in t['push'])}), raw " \
                   f"broadcast {raw:.3f} s, push/raw {push / raw:.2f}; raw + one copy of the model {fair:.3f} s, " \
                   f"push/(raw + copy) {push / fair:.2f}; control (plan, requests, commit) " \
                   f"{statistics.median(t['control']):.3f} s of the push"  # fmt: skip
            if t["per_tensor"]:
                line += f"; per-tensor push {statistics.median(t['per_tensor']):.3f} s"
            print(line + f"; with checksum verification {per_rank[0]['verified_s']:.3f} s")
            print("  push phases (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in per_rank[0]["phases"].items()))
            for rank, r in enumerate(per_rank):
                print(f"  rank {rank}{' (source)' if r['source'] else ''}: {r['buckets']} buckets, stage "
                      f"{r['stage_bytes'] / 2**20:.1f} MB; extra memory {r['peak'] / 2**20:.1f} MB (bound "
                      f"{r['bound'] / 2**20:.1f} MB: 2 buckets + largest tensor {r['largest'] / 2**20:.1f} MB); RSS "
                      f"high-water +{r['rss_first_mb']:.1f} MB during the first push (buffers made, groups formed), "
                      f"+{r['rss_growth_mb']:.1f} MB during a later one")  # fmt: skip
        p1 = statistics.median(results["pp1"][0]["times"]["push"])
        r1 = statistics.median(results["pp1"][0]["times"]["raw"])
        p2 = statistics.median(results["pp2"][0]["times"]["push"])
        f1 = statistics.median([r + c for r, c in zip(results["pp1"][0]["times"]["raw"],
                                                      results["pp1"][0]["times"]["copy"])])  # fmt: skip
        c1 = statistics.median(results["pp1"][0]["times"]["control"])
        print(f"overhead ratio {p1 / r1:.2f}")
        print(f"fair overhead ratio {p1 / f1:.2f} (push / (raw broadcast + one memory copy of the model)); "
              f"control {c1:.3f} s of the push's {p1:.3f} s; without it {(p1 - c1) / f1:.2f}")  # fmt: skip
        print(f"speed-up pp1/pp2 {p1 / p2:.2f}")
    finally:
        engine.kill()
        engine.wait()
    if args.part == "all":
        shard_aware(hf_dir, work, args, results)
        agent_path(hf_dir, work, args, results)
        delta_path(work, args, results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()

"""Throughput of the trajectory bus vs raw pyzmq PUSH/PULL of the same frames, on loopback.

    PYTHONPATH=. python tools/bus_bench.py [--sizes 1024 32768 131072] [--target-mb 512] [--max-count 20000]

For each size, one producer process sends `count` trajectories (same arrays, fresh ids) and this process receives
them: once through TrajectorySender -> TrajectoryReceiver (with credits, receipt acks, validation, de-dup and a
commit every 256), once as raw PUSH/PULL multipart messages of the same bytes (copy=False on both ends). Prints
one line per size: `<N> tokens: bus <X> GB/s, raw <Y> GB/s, ratio <Z> (bus <A> traj/s, raw <B> traj/s)`.
Counts and time are bounded (--target-mb per run, --max-count, --timeout-s).
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_sao.bus import TrajectoryReceiver, TrajectorySender, codec
from megatron_sao.bus.synthetic import make_trajectory
from megatron_sao.config.bus import BusConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _copies(num_tokens: int, count: int):
    base = make_trajectory("t", num_tokens, num_turns=4)
    for i in range(count):
        header = msgspec.structs.replace(base.header, trajectory_id=f"bench-{i}")
        yield type(base)(header, base.tokens, base.rollout_logprobs, base.action_mask, base.weight_versions)


def _ready_then_wait_for_go() -> None:
    print("ready", flush=True)
    sys.stdin.readline()


def _bus_producer(addr: str, num_tokens: int, count: int) -> None:
    cfg = BusConfig(bind=addr)
    sender = TrajectorySender(cfg, "bench")
    trajs = list(_copies(num_tokens, count))
    _ready_then_wait_for_go()
    for t in trajs:
        sender.send(t, timeout_s=60)
    sender.flush(60)
    sender.close()


def _raw_producer(addr: str, num_tokens: int, count: int) -> None:
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(addr)
    frames = [codec.encode(t) for t in _copies(num_tokens, count)]
    _ready_then_wait_for_go()
    for f in frames:
        push.send_multipart(f, copy=False)
    push.close(linger=-1)
    ctx.term()


def _start_producer(mode: str, addr: str, num_tokens: int, count: int) -> subprocess.Popen:
    """The producer process; returns once it is connected and its trajectories are built, then says go."""
    cmd = [sys.executable, __file__, "--producer", mode, "--addr", addr, "--sizes", str(num_tokens)]
    proc = subprocess.Popen([*cmd, "--max-count", str(count)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError(f"{mode} producer failed to start (exit code {proc.wait()})")
    time.sleep(0.2)  # connection handshake
    proc.stdin.write("go\n")
    proc.stdin.flush()
    return proc


def _run_bus(num_tokens: int, count: int, timeout_s: float) -> tuple[float, int]:
    addr = f"tcp://127.0.0.1:{_free_port()}"
    receiver = TrajectoryReceiver(BusConfig(bind=addr))
    proc = _start_producer("bus", addr, num_tokens, count)
    nbytes = 0
    try:
        t0 = time.perf_counter()
        for i in range(count):
            traj = receiver.recv(timeout_s=timeout_s)
            if traj is None:
                raise TimeoutError(f"bus: only {i} of {count} trajectories arrived")
            nbytes += traj.tokens.nbytes * 3 + traj.action_mask.nbytes
            if i % 256 == 255:
                receiver.commit()
        elapsed = time.perf_counter() - t0
        receiver.commit()
        proc.wait(timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        receiver.close()
    return elapsed, nbytes


def _run_raw(num_tokens: int, count: int, timeout_s: float) -> tuple[float, int]:
    addr = f"tcp://127.0.0.1:{_free_port()}"
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(addr)
    pull.rcvtimeo = int(timeout_s * 1000)
    proc = _start_producer("raw", addr, num_tokens, count)
    nbytes = 0
    try:
        t0 = time.perf_counter()
        for _ in range(count):
            frames = pull.recv_multipart(copy=False)
            nbytes += sum(len(f) for f in frames[1:])
        elapsed = time.perf_counter() - t0
        proc.wait(timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pull.close(linger=0)
        ctx.term()
    return elapsed, nbytes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 32768, 131072])
    p.add_argument("--target-mb", type=float, default=512.0, help="payload per run and size")
    p.add_argument("--max-count", type=int, default=20000)
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--repeats", type=int, default=1, help="best of N runs per mode (noisy shared machines)")
    p.add_argument("--producer", choices=["bus", "raw"], help=argparse.SUPPRESS)
    p.add_argument("--addr", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.producer:
        (_bus_producer if args.producer == "bus" else _raw_producer)(args.addr, args.sizes[0], args.max_count)
        return 0
    for n in args.sizes:
        per_msg = 13 * n
        count = max(20, min(args.max_count, int(args.target_mb * 2**20 / per_msg)))
        bus = min((_run_bus(n, count, args.timeout_s) for _ in range(args.repeats)), key=lambda r: r[0])
        raw = min((_run_raw(n, count, args.timeout_s) for _ in range(args.repeats)), key=lambda r: r[0])
        bus_gbs, raw_gbs = bus[1] / bus[0] / 1e9, raw[1] / raw[0] / 1e9
        print(
            f"{n} tokens: bus {bus_gbs:.2f} GB/s, raw {raw_gbs:.2f} GB/s, ratio {bus_gbs / raw_gbs:.2f} "
            f"(bus {count / bus[0]:.0f} traj/s, raw {count / raw[0]:.0f} traj/s; {count} trajectories)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

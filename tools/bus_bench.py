"""Throughput of the trajectory bus vs raw pyzmq PUSH/PULL of the same frames, on loopback.

    PYTHONPATH=. python tools/bus_bench.py [--sizes 1024 32768 131072] [--target-mb 512] [--max-count 20000]

For each size, one producer process sends `count` trajectories (same arrays, fresh ids) and this process receives
them: once through TrajectorySender -> TrajectoryReceiver (credits, receipt acks, validation on both ends, de-dup,
recv_batch(32), a commit every 256), once as raw PUSH/PULL multipart messages of the same bytes (copy=False on both
ends). Prints one line per size: `<N> tokens: bus <X> GB/s, raw <Y> GB/s, ratio <Z> (bus <A> traj/s, raw <B> traj/s)`.
Counts and time are bounded (--target-mb per run, --max-count, --timeout-s).

Diagnostics: --breakdown adds, per mode, the receiving process's CPU per trajectory by thread (the learner's thread,
the bus socket thread, libzmq's I/O thread) and the producer's, from the run with the median time.
--skip-validation (an experiment, never a setting of the bus) makes the receiver skip the per-token value checks,
to show what they cost.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import yaml
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # idle BLAS threads spin on small machines (both modes alike)

from megatron_sao.bus import TrajectoryReceiver, TrajectorySender, codec
from megatron_sao.bus.schema import Trajectory
from megatron_sao.bus.synthetic import make_trajectory
from megatron_sao.config.bus import BusConfig

BATCH = 32
"""Trajectories per recv_batch() in the bus run (a learner step takes trajectories_per_step of them)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _copies(num_tokens: int, count: int):
    base = make_trajectory("t", num_tokens, num_turns=4)
    for i in range(count):
        header = msgspec.structs.replace(base.header, trajectory_id=f"bench-{i}")
        yield type(base)(header, base.tokens, base.rollout_logprobs, base.action_mask, base.weight_versions)


def _thread_cpu_us() -> dict[str, float]:
    """CPU microseconds so far of each live thread of this process, by role (Linux /proc; {} elsewhere)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{os.getpid()}/task") if os.path.isdir("/proc") else []:
        try:
            with open(f"/proc/{os.getpid()}/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/{os.getpid()}/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        role = "learner thread" if int(tid) == os.getpid() else names.get(int(tid), comm)
        out[role] = out.get(role, 0.0) + ns / 1000
    return out


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _ready_then_wait_for_go() -> float:
    print("ready", flush=True)
    sys.stdin.readline()
    return _cpu_s()


def _report_cpu(start: float) -> None:
    print(f"cpu {_cpu_s() - start}", flush=True)


def _bus_cfg(addr: str, options: list[str]) -> BusConfig:
    """BusConfig for both ends, with --set KEY=VALUE overrides (YAML values)."""
    kw = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in options)}
    return BusConfig(bind=addr, **kw)


def _bus_producer(addr: str, num_tokens: int, count: int, options: list[str]) -> None:
    cfg = _bus_cfg(addr, options)
    sender = TrajectorySender(cfg, "bench")
    trajs = list(_copies(num_tokens, count))
    cpu0 = _ready_then_wait_for_go()
    for t in trajs:
        sender.send(t, timeout_s=60)
    sender.flush(60)
    sender.close()
    _report_cpu(cpu0)


def _raw_producer(addr: str, num_tokens: int, count: int, options: list[str]) -> None:
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(addr)
    frames = [codec.encode(t) for t in _copies(num_tokens, count)]
    cpu0 = _ready_then_wait_for_go()
    for f in frames:
        push.send_multipart(f, copy=False)
    push.close(linger=-1)
    ctx.term()
    _report_cpu(cpu0)


def _start_producer(mode: str, addr: str, num_tokens: int, count: int, options: list[str]) -> subprocess.Popen:
    """The producer process; returns once it is connected and its trajectories are built, then says go."""
    cmd = [sys.executable, __file__, "--producer", mode, "--addr", addr, "--sizes", str(num_tokens)]
    cmd += [f"--set={o}" for o in options]
    proc = subprocess.Popen([*cmd, "--max-count", str(count)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError(f"{mode} producer failed to start (exit code {proc.wait()})")
    time.sleep(0.2)  # connection handshake
    proc.stdin.write("go\n")
    proc.stdin.flush()
    return proc


def _producer_cpu(proc: subprocess.Popen, timeout_s: float) -> float:
    """Wait for the producer; the CPU seconds it reported for its sending."""
    assert proc.stdout is not None
    out, _ = proc.communicate(timeout=timeout_s)
    lines = [x for x in out.splitlines() if x.startswith("cpu ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"producer exited with {proc.returncode}: {out[-2000:]}")
    return float(lines[-1].split()[1])


Run = tuple[float, int, float, dict[str, float]]
"""(seconds, payload bytes, CPU seconds of both processes while sending, CPU us of each thread of the receiving
process and of the producer process)."""


def _run_bus(num_tokens: int, count: int, timeout_s: float, options: list[str]) -> Run:
    addr = f"tcp://127.0.0.1:{_free_port()}"
    receiver = TrajectoryReceiver(_bus_cfg(addr, options))
    proc = _start_producer("bus", addr, num_tokens, count, options)
    nbytes = 0
    try:
        t0, cpu0, threads0 = time.perf_counter(), _cpu_s(), _thread_cpu_us()
        got, committed = 0, 0
        while got < count:  # as a learner takes them: a step's worth at a time, a commit now and then
            batch = receiver.recv_batch(min(BATCH, count - got), timeout_s=timeout_s)
            if not batch:
                raise TimeoutError(f"bus: only {got} of {count} trajectories arrived")
            got += len(batch)
            nbytes += sum(t.tokens.nbytes * 3 + t.action_mask.nbytes for t in batch)
            if got - committed >= 256:
                receiver.commit()
                committed = got
        elapsed, cpu, threads = time.perf_counter() - t0, _cpu_s() - cpu0, _thread_cpu_us()
        receiver.commit()
        producer_cpu = _producer_cpu(proc, timeout_s)
        cpu += producer_cpu
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        receiver.close()
    return elapsed, nbytes, cpu, _per_thread(threads0, threads, producer_cpu)


def _per_thread(before: dict[str, float], after: dict[str, float], producer_cpu_s: float) -> dict[str, float]:
    out = {k: v - before[k] for k, v in after.items() if k in before}
    out["producer process"] = producer_cpu_s * 1e6
    return out


def _run_raw(num_tokens: int, count: int, timeout_s: float, options: list[str]) -> Run:
    addr = f"tcp://127.0.0.1:{_free_port()}"
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(addr)
    pull.rcvtimeo = int(timeout_s * 1000)
    proc = _start_producer("raw", addr, num_tokens, count, [])
    nbytes = 0
    try:
        t0, cpu0, threads0 = time.perf_counter(), _cpu_s(), _thread_cpu_us()
        for _ in range(count):
            frames = pull.recv_multipart(copy=False)
            nbytes += sum(len(f) for f in frames[1:])
        elapsed, cpu, threads = time.perf_counter() - t0, _cpu_s() - cpu0, _thread_cpu_us()
        producer_cpu = _producer_cpu(proc, timeout_s)
        cpu += producer_cpu
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pull.close(linger=0)
        ctx.term()
    return elapsed, nbytes, cpu, _per_thread(threads0, threads, producer_cpu)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 32768, 131072])
    p.add_argument("--target-mb", type=float, default=512.0, help="payload per run and size")
    p.add_argument("--max-count", type=int, default=20000)
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--repeats", type=int, default=5, help="best of N interleaved runs per mode")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="bus config option, both ends")
    p.add_argument("--breakdown", action="store_true", help="CPU per trajectory by thread (median run)")
    p.add_argument("--skip-validation", action="store_true", help="experiment: receiver skips the value checks")
    p.add_argument("--producer", choices=["bus", "raw"], help=argparse.SUPPRESS)
    p.add_argument("--addr", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.producer:
        producer = _bus_producer if args.producer == "bus" else _raw_producer
        producer(args.addr, args.sizes[0], args.max_count, args.set)
        return 0
    if args.skip_validation:  # the receiver's decode looks validate_values up in codec at each call
        codec.validate_values = _skip_value_checks
        print("EXPERIMENT: the receiver skips the per-token value checks (--skip-validation)", flush=True)
    for n in args.sizes:
        count = max(20, min(args.max_count, int(args.target_mb * 2**20 / (13 * n))))
        runs: dict[str, list[Run]] = {"bus": [], "raw": []}
        for _ in range(args.repeats):  # interleaved, best of N: the machine's other load hits both alike
            runs["bus"].append(_run_bus(n, count, args.timeout_s, args.set))
            runs["raw"].append(_run_raw(n, count, args.timeout_s, args.set))
        bus, raw = (min(runs[k], key=lambda r: r[0]) for k in ("bus", "raw"))
        bus_gbs, raw_gbs = bus[1] / bus[0] / 1e9, raw[1] / raw[0] / 1e9
        bus_cpu, raw_cpu = (min(r[2] for r in runs[k]) / count * 1e6 for k in ("bus", "raw"))
        # each bus run against the raw run next to it: the spread says how much of the ratio is machine noise
        paired = sorted(raw_run[0] / bus_run[0] for bus_run, raw_run in zip(runs["bus"], runs["raw"]))
        print(
            f"{n} tokens: bus {bus_gbs:.2f} GB/s, raw {raw_gbs:.2f} GB/s, ratio {bus_gbs / raw_gbs:.2f} "
            f"(bus {count / bus[0]:.0f} traj/s, raw {count / raw[0]:.0f} traj/s; CPU per trajectory, both "
            f"processes: bus {bus_cpu:.0f} us, raw {raw_cpu:.0f} us; {count} trajectories, best of {args.repeats}; "
            f"paired ratios min/median/max {paired[0]:.2f}/{paired[len(paired) // 2]:.2f}/{paired[-1]:.2f})",
            flush=True,
        )
        if args.breakdown:
            for mode in ("bus", "raw"):
                median = sorted(runs[mode], key=lambda r: r[0])[len(runs[mode]) // 2]
                parts = ", ".join(f"{k} {v / count:.0f}" for k, v in sorted(median[3].items()) if v / count >= 1)
                print(f"  {mode}: CPU us per trajectory by thread: {parts}", flush=True)
    return 0


def _skip_value_checks(traj: Trajectory) -> None:
    traj.extras["oldest_version"] = None  # what validation would have found (the staleness gate admits it)


if __name__ == "__main__":
    raise SystemExit(main())

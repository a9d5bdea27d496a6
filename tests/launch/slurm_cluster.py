"""A real Slurm cluster on this machine for the launcher's tests (../shared/notes/slurm-local.md): slurmctld and
several slurmd "nodes" from Debian's packages, a private munged, all in one temp dir, stopped by their pid files.
Installs slurm-wlm and munge with apt when they are missing and we are root (CI); otherwise the tests that need it
skip with the reason."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class SlurmUnavailable(RuntimeError):
    pass


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _free_range(n: int, attempts: int = 200) -> int:
    """The first of `n` consecutive ports that are all free now (slurmd's ports are a range: one taken by another
    process makes its slurmd fail to bind, and the node never comes up)."""
    rng = random.Random()
    for _ in range(attempts):
        first = rng.randrange(20000, 60000 - n)
        socks: list[socket.socket] = []
        try:
            for port in range(first, first + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", port))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise SlurmUnavailable(f"no {n} consecutive free ports found for slurmd")


def ensure_installed() -> None:
    if shutil.which("slurmctld") and shutil.which("munged"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable("slurm-wlm and munge are not installed and this is not a root machine with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"]):
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if done.returncode != 0:
            raise SlurmUnavailable(f"{' '.join(cmd)} failed: {done.stderr[-1000:]}")


CONF = """ClusterName=sao-test
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmUser=root
MpiDefault=none
KillWait=30
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmdSpoolDir={dir}/slurmd-%n
StateSaveLocation={dir}/state
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
NodeName=n[1-{nodes}] NodeHostname=localhost NodeAddr=127.0.0.1 Port={first}-{last} CPUs={cpus} RealMemory=4000 \
  State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _stop(pid_file: Path) -> None:
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended between the last check and here
        return


@contextmanager
def local_cluster(workdir: Path, nodes: int = 3) -> Iterator[dict[str, str]]:
    """Start the cluster in `workdir`; yields the environment its clients need (SLURM_CONF)."""
    ensure_installed()
    d = workdir.resolve()
    (d / "state").mkdir(parents=True, exist_ok=True)
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    first = _free_range(nodes)  # slurmd ports are a range
    ctld = next(p for p in iter(lambda: _free_ports(1)[0], None) if not first <= p < first + nodes)
    conf = d / "slurm.conf"
    conf.write_text(CONF.format(ctld_port=ctld, dir=d, nodes=nodes, first=first, last=first + nodes - 1,
                                cpus=os.cpu_count() or 2))  # fmt: skip
    env = {**os.environ, "SLURM_CONF": str(conf)}
    pid_files = [d / "munged.pid", d / "slurmctld.pid", *(d / f"slurmd-n{i}.pid" for i in range(1, nodes + 1))]
    try:
        subprocess.run(["munged", "--force", f"--socket={d}/munge.sock", f"--key-file={key}",
                        f"--log-file={d}/munged.log", f"--pid-file={d}/munged.pid", f"--seed-file={d}/munged.seed"],
                       check=True, capture_output=True)  # fmt: skip
        subprocess.run(["slurmctld", "-f", str(conf)], check=True, env=env, capture_output=True)
        for i in range(1, nodes + 1):
            subprocess.run(["slurmd", "-f", str(conf), "-N", f"n{i}"], check=True, env=env, capture_output=True)
        deadline = time.monotonic() + 60
        while True:
            shown = subprocess.run(["sinfo", "-h", "-o", "%T %D"], env=env, capture_output=True, text=True)
            if shown.stdout.split() == ["idle", str(nodes)]:
                break
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"the nodes did not come up idle: {shown.stdout}{shown.stderr}\n"
                                       + (d / "slurmctld.log").read_text(errors="replace")[-2000:])  # fmt: skip
            time.sleep(0.5)
        yield env
    finally:
        for pid_file in reversed(pid_files):
            _stop(pid_file)

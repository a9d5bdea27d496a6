"""launch.mode=local: the whole run on this machine (`python -m megatron_sao run CONFIG`, what ./launch.sh runs).

    engines        rollout.num_engines processes (embedded CPU engine, or SGLang servers), or rollout.engine_urls
    rollout worker one `python -m megatron_sao rollout` process pushing onto the bus
    learner        this process (one rank), or torchrun with launch.nproc_per_node ranks
    value job      learner.value_on_separate_ranks: `python -m megatron_sao critic` (torchrun with
                   launch.value_nproc_per_node ranks when more than one), bridged to the learner on a free port
Logs of the child processes go to <run_dir>/logs/. Whatever happens, the children are stopped on the way out.
Running it again with the same run_dir resumes: the learner from save_dir/latest (with the bus state), the
rollout worker from its prompt cursor.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_sao.config.roles import LearnerJob
from megatron_sao.config.tree import SAOConfig
from megatron_sao.distributed.spawn import child_env
from megatron_sao.engines import sglang_launcher as engines
from megatron_sao.files import STOP_FILE
from megatron_sao.models.tiny import make_configured

log = logging.getLogger(__name__)


def _child_env() -> dict[str, str]:
    env = child_env()
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_local(cfg: SAOConfig, config_path: str, overrides: list[str]) -> dict[str, Any]:
    """Start engines and a rollout worker, train, stop everything; returns the learner's summary."""
    if cfg.launch.mode != "local":
        raise ValueError(f"launch.mode={cfg.launch.mode!r}: run_local starts everything on this machine; "
                         "launch.mode=slurm goes through launch/slurm.py")  # fmt: skip
    make_configured(cfg.model)
    if not cfg.model.hf_path or not Path(cfg.model.hf_path).is_dir():
        raise ValueError(f"model.hf_path={cfg.model.hf_path!r} is not a directory: point it at an HF model (for the "
                         "tiny example: python tools/make_tiny_model.py --family qwen3_moe --out <dir>)")  # fmt: skip
    _refuse_taken_ports(cfg)
    run_dir = Path(cfg.launch.run_dir)
    use_run_key(cfg)
    logs = run_dir / "logs"
    try:
        logs.mkdir(parents=True, exist_ok=True)
        (logs / ".writable").touch()
    except OSError as e:
        raise ValueError(f"launch.run_dir={cfg.launch.run_dir!r} is not writable ({e.strerror}: {e.filename}); "
                         "choose a directory this user can write") from None  # fmt: skip
    procs: list[engines.EngineProcess] = []
    workers: list[subprocess.Popen[bytes]] = []
    supervisor: Supervisor | None = None
    value_job: subprocess.Popen[bytes] | None = None
    try:
        commands = engines.engine_commands(cfg.rollout, cfg.engine_model_path, cfg.launch.gpus_per_node)
        urls = list(cfg.rollout.engine_urls) or [url for url, _ in commands]
        if commands:
            print(f"[run] starting {len(commands)} {cfg.rollout.engine} engine(s): {', '.join(urls)}", flush=True)
            procs = engines.launch(commands, logs)
            engines.wait_healthy(procs, cfg.rollout.health_timeout_s)
        agents = engines.agent_commands(cfg.rollout, cfg.weight_sync, cfg.launch.gpus_per_node)
        if agents:  # beside the engines (weight_sync.agent); supervised and stopped with them
            print(f"[run] starting {len(agents)} push agent(s): {', '.join(u for u, _ in agents)}", flush=True)
            started = engines.launch(agents, logs, role="agent")
            procs += started
            commands += agents
            engines.wait_healthy(started, cfg.rollout.health_timeout_s)
        cmd = [sys.executable, "-m", "megatron_sao", "rollout", config_path, "--engines", ",".join(urls), *overrides]

        def start_worker() -> None:
            with open(logs / "rollout.log", "ab") as out:
                workers.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_child_env()))

        def first_worker() -> None:
            start_worker()
            print(f"[run] rollout worker started (log: {logs / 'rollout.log'}); training", flush=True)

        supervisor = Supervisor(procs, dict(commands), workers, start_worker, logs, cfg.launch.max_restarts)
        supervisor.start()
        bridge = None
        value = cfg.jobs.value
        if value is not None:
            from megatron_sao.distributed.spawn import find_free_port

            bridge = f"tcp://127.0.0.1:{find_free_port()}"
            value_job = _start_value_job(value, config_path, overrides, bridge, logs)
        if cfg.launch.learner_world_size > 1:
            first_worker()  # torchrun's ranks resume and push on their own; tokens before that are just stale
            summary = _torchrun_learner(cfg, config_path, overrides, urls, logs, bridge)
        else:
            from megatron_sao.run.learn import learn

            summary = learn(cfg, urls, on_ready=first_worker, critic_bridge=bridge)
        if supervisor.gave_up is not None:
            raise RoleFailed(supervisor.gave_up)
        return summary
    finally:
        if value_job is not None:
            _stop_value_job(value_job)
        if supervisor is not None:
            supervisor.stop.set()
            supervisor.join(10)
        for worker in workers:
            if worker.poll() is None:
                worker.terminate()
                try:
                    worker.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    worker.kill()
                    worker.wait()
        engines.stop(procs)


def _last_line(tail: str) -> str:
    """A log's last non-empty line (the error of a traceback): what the terminal shows; the rest stays in the log."""
    return next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "(empty log)")


class RoleFailed(RuntimeError):
    """A role of a local run kept failing past launch.max_restarts; the run stopped (after a checkpoint)."""


def listener_of(port: int) -> tuple[int | None, str] | None:
    """(pid, command line) of the process listening on TCP `port` on this machine, None when no one does (pid None:
    a listener whose owner this user cannot see)."""
    import psutil

    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            if conn.pid is None:
                return None, "?"
            try:
                return conn.pid, " ".join(psutil.Process(conn.pid).cmdline())
            except psutil.Error:
                return conn.pid, "?"
    return None


def use_run_key(cfg: SAOConfig) -> None:
    """rollout.api_key, for engines this process starts: the run's key file made (once) and named in this process's
    environment, which every engine, agent, worker and client it starts inherits (engines/auth.py)."""
    from megatron_sao.engines.auth import API_KEY_FILE_ENV, ensure_key

    if cfg.rollout.api_key and not cfg.rollout.engine_urls:
        os.environ[API_KEY_FILE_ENV] = str(ensure_key(cfg.launch.run_dir))


def free_ports(cfg: SAOConfig, overrides: list[str]) -> list[str]:
    """Overrides that move the engines and the bus off ports another process listens on, so two local runs (or a
    run beside a leftover) start side by side; empty when every port is free. A port given on the command line is
    kept (and refused by _refuse_taken_ports if taken): the user asked for it."""
    from megatron_sao.distributed.spawn import find_free_port

    given = {o.split("=", 1)[0] for o in overrides if o.startswith("--")}
    moves: list[str] = []
    r = cfg.rollout
    if not r.engine_urls and "--rollout.base_port" not in given:
        offsets = [0] + ([cfg.weight_sync.agent_port_offset] if cfg.weight_sync.agent else [])
        block = [r.base_port + i + o for i in range(r.num_engines) for o in offsets]
        if any(listener_of(p) is not None for p in block):
            base = _free_block(r.num_engines, offsets, find_free_port)
            print(f"[run] ports {r.base_port}..{r.base_port + r.num_engines - 1} (rollout.base_port) are taken; the "
                  f"engines use {base}.. instead", flush=True)  # fmt: skip
            moves += ["--rollout.base_port", str(base)]
    if cfg.bus.bind.startswith("tcp://") and "--bus.bind" not in given:
        host, _, port = cfg.bus.bind.removeprefix("tcp://").rpartition(":")
        if listener_of(int(port)) is not None:
            new = find_free_port(host)
            print(f"[run] port {port} (bus.bind) is taken; the bus binds {new} instead", flush=True)
            moves += ["--bus.bind", f"tcp://{host}:{new}"]
    return moves


def _free_block(n: int, offsets: list[int], find: Callable[[], int]) -> int:
    """A base port whose next n ports (each also at every offset) nobody listens on."""
    import socket

    for _ in range(64):
        base = find()
        ports = [base + i + o for i in range(n) for o in offsets]
        if max(ports) > 65535:
            continue
        ok = True
        for p in ports:
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise ValueError(f"no block of {n} free ports found for the engines: set rollout.base_port")


def _refuse_taken_ports(cfg: SAOConfig) -> None:
    """A leftover engine or learner of another run on our ports would answer our health checks and take our
    trajectories: refuse to start, naming the port, the process and the field to change."""
    ports = {}
    if not cfg.rollout.engine_urls:
        ports.update(
            {cfg.rollout.base_port + i: f"engine {i} (rollout.base_port)" for i in range(cfg.rollout.num_engines)}
        )
        if cfg.weight_sync.agent:
            offset = cfg.weight_sync.agent_port_offset
            ports.update({cfg.rollout.base_port + i + offset: f"engine {i}'s push agent (weight_sync.agent_port_offset)"
                          for i in range(cfg.rollout.num_engines)})  # fmt: skip
    if cfg.bus.bind.startswith("tcp://"):
        ports[int(cfg.bus.bind.rsplit(":", 1)[1])] = "the bus (bus.bind)"
    for port, what in ports.items():
        owner = listener_of(port)
        if owner is not None:
            pid, cmd = owner
            raise ValueError(f"port {port} for {what} is already taken by pid {pid} ({cmd[:160]}): a leftover of "
                             f"another run? stop it (kill {pid}) or choose another port")  # fmt: skip


class Supervisor(threading.Thread):
    """Restarts an engine or the rollout worker that exits while the learner trains (launch.max_restarts each).

    A restarted engine comes back with its initial weights; the learner's next weight push sees it healthy again
    and forms the update group anew with it (weight_sync/engines.py), and what it generates before that is
    stale and gated like any other stale trajectory. A restarted worker resumes from its prompt cursor."""

    POLL_S = 2.0

    def __init__(
        self,
        procs: list[engines.EngineProcess],
        commands: dict[str, list[str]],
        workers: list[subprocess.Popen[bytes]],
        start_worker: Callable[[], None],
        logs: Path,
        max_restarts: int,
    ) -> None:
        super().__init__(name="sao-run-supervisor", daemon=True)
        self.max_restarts = max_restarts
        self.procs, self.commands, self.workers = procs, commands, workers
        self.start_worker, self.logs = start_worker, logs
        self.stop = threading.Event()
        self.restarts: dict[str, int] = {}
        self.gave_up: str | None = None  # why the run cannot go on (a role that kept failing), once it is known

    def give_up(self, why: str) -> None:
        """A role the run needs is gone for good: ask the learner to stop (the STOP file: it checkpoints and exits)
        and remember why, so the run ends non-zero with this one message instead of waiting forever."""
        if self.gave_up is None:
            self.gave_up = why
            log.error("%s; stopping the run", why)
            (self.logs.parent / STOP_FILE).write_text(f"run supervisor: {why}\n")

    def run(self) -> None:
        while not self.stop.wait(self.POLL_S):
            for i, p in enumerate(self.procs):
                if p.proc.poll() is not None and self._may_restart(p.url, p.proc.returncode, p.log_tail(20)):
                    with open(p.log_path, "ab") as out:
                        proc = subprocess.Popen(self.commands[p.url], stdout=out, stderr=subprocess.STDOUT,
                                                env=child_env())  # fmt: skip
                    self.procs[i] = engines.EngineProcess(p.url, proc, p.log_path)
            if self.workers and self.workers[-1].poll() is not None:
                tail = (self.logs / "rollout.log").read_text(errors="replace").splitlines()[-20:]
                if self._may_restart("rollout worker", self.workers[-1].returncode, "\n".join(tail)):
                    self.start_worker()

    def _may_restart(self, what: str, code: int | None, tail: str) -> bool:
        n = self.restarts.get(what, 0)
        if code == 2 and n <= self.max_restarts:  # a refused config: the same at every start
            self.restarts[what] = self.max_restarts + 1
            self.give_up(f"{what} refused its config (exit 2), which a restart cannot change; its log in {self.logs} "
                         f"ends with: {_last_line(tail)}")  # fmt: skip
            return False
        if n >= self.max_restarts:
            if n == self.max_restarts:
                self.restarts[what] = n + 1
                self.give_up(f"{what} exited with {code} after {n} restart(s) (launch.max_restarts); its log in "
                             f"{self.logs} ends with: {_last_line(tail)}")  # fmt: skip
            return False
        self.restarts[what] = n + 1
        log.error("%s exited with %s; restarting it (%d/%d). Its log in %s ends with: %s", what, code, n + 1,
                  self.max_restarts, self.logs, _last_line(tail))  # fmt: skip
        print(f"[run] {what} exited with {code}; restarted ({n + 1}/{self.max_restarts})", flush=True)
        return True


def _start_value_job(
    job: LearnerJob, config_path: str, overrides: list[str], bridge: str, logs: Path
) -> subprocess.Popen[bytes]:
    """The value job (config.roles.Jobs.value), logging to <run_dir>/logs/critic.log; it joins the learner's bridge
    once the learner is up, and exits when the learner tells it to."""
    n = job.world_size
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"] if n > 1 else \
        [sys.executable]  # fmt: skip
    cmd = [*launcher, "-m", "megatron_sao", "critic", config_path, "--bridge", bridge, *overrides]
    print(f"[run] value job: {n} rank(s) beside the learner (log: {logs / 'critic.log'})", flush=True)
    with open(logs / "critic.log", "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_child_env())


def _stop_value_job(proc: subprocess.Popen[bytes], grace_s: float = 60.0) -> None:
    """The learner told it to stop (or is gone, which ends it too): wait, then make sure."""
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        log.error("the value job did not exit %.0f s after the learner; killing it", grace_s)
        proc.kill()
        proc.wait()


def _torchrun_learner(
    cfg: SAOConfig, config_path: str, overrides: list[str], urls: list[str], logs: Path, bridge: str | None = None
) -> dict[str, Any]:
    n = cfg.launch.nproc_per_node
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           "-m", "megatron_sao", "learn", config_path, "--engines", ",".join(urls), *overrides]  # fmt: skip
    if bridge is not None:
        cmd += ["--critic-bridge", bridge]
    print(f"[run] learner: torchrun with {n} ranks (rank logs: {logs})", flush=True)
    t0 = time.monotonic()
    rc = subprocess.call(cmd, env=_child_env())
    if rc != 0:
        raise RuntimeError(f"the learner (torchrun, {n} ranks) exited with {rc}")
    return {"version": None, "seconds": time.monotonic() - t0}

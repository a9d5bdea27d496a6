"""launch.mode=slurm: `./launch.sh run CONFIG` inside an allocation (sbatch, salloc) runs every role as its own srun
step on the nodes the node map gives it, and watches them.

    engines        one step each; the launcher waits until every engine answers /health
    learner        one step over the learner nodes: torchrun per node, rendezvous on the first
    value job      learner.value_on_separate_ranks: one step over its nodes (torchrun), bridged to the learner; the two
                   are a pair: when one exits unexpectedly the other is stopped and both start again
    rollout workers one step each, once the engines hold the learner's weights (after a resume: its checkpoint's)
Every step's output goes to <run_dir>/logs/<step>.log and, prefixed with [step], to the launcher's output. A step that
exits unexpectedly is started again (launch.max_restarts per step; the learner resumes from its checkpoint, an
engine comes back on its launch weights and gets the next push). The run ends when the learner reaches
learner.max_steps; or on SIGTERM / scancel / a step beyond its budget: the learner is told to checkpoint and
given launch.stop_timeout_s, then every step is stopped. Exit status 0 when the learner finished or stopped cleanly
(it checkpointed), 1 when a step failed beyond its budget or the learner did not stop cleanly.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from megatron_sao.config.tree import SAOConfig
from megatron_sao.engines.client import SGLangClient
from megatron_sao.launch.nodemap import Node, NodeMap, placeholder_nodes, plan
from megatron_sao.launch.steps import Step, build_steps, describe
from megatron_sao.models.tiny import make_configured

log = logging.getLogger(__name__)

POLL_S = 1.0
VALUE_DONE_GRACE_S = 120.0
"""How long the learner may take to finish after its value job ended with 0 (training over) before the launcher
takes the value job's exit for a failure."""


class LaunchError(RuntimeError):
    """The run could not start or was lost (the message says which step and shows its log's tail)."""


def allocation_nodes() -> list[Node]:
    """The allocation's nodes in order, each with the address the others reach it at (NodeAddr, resolved)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise LaunchError("launch.mode=slurm runs inside a Slurm allocation (no SLURM_JOB_NODELIST here): submit "
                          "it with `./launch.sh submit CONFIG`, or run it under sbatch / salloc; `--dry-run` shows "
                          "the plan without Slurm")  # fmt: skip
    names = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    nodes = []
    for name in names.stdout.split():
        shown = subprocess.run(["scontrol", "show", "node", "-o", name], capture_output=True, text=True)
        match = re.search(r"\bNodeAddr=(\S+)", shown.stdout)
        addr = match.group(1) if match else name
        with contextlib.suppress(OSError):  # else keep the name: the roles resolve it themselves
            addr = socket.gethostbyname(addr)
        nodes.append(Node(name, addr))
    return nodes


def dry_run(cfg: SAOConfig, config_path: str, overrides: list[str], python: str = sys.executable) -> str:
    """The node map and every command, for the allocation when inside one, else for placeholder nodes."""
    nodes = allocation_nodes() if os.environ.get("SLURM_JOB_NODELIST") else placeholder_nodes(cfg.launch.total_nodes)
    node_map = plan(cfg, nodes)
    return describe(node_map, build_steps(cfg, config_path, overrides, node_map, python), cfg.launch.slurm.srun_args)


class Running:
    """One srun step: the process, its restarts, the thread copying its output to its log and to ours."""

    def __init__(self, step: Step, logs: Path, srun_args: list[str]) -> None:
        self.step, self.log_path, self.srun_args = step, logs / f"{step.name}.log", srun_args
        self.restarts = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.tail: list[str] = []

    def start(self) -> None:
        env = {**os.environ, **self.step.env}
        self.proc = subprocess.Popen(self.step.srun(self.srun_args), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=env)  # fmt: skip
        threading.Thread(target=self._copy, args=(self.proc.stdout,), daemon=True).start()

    def _copy(self, stream: IO[bytes] | None) -> None:
        assert stream is not None
        with open(self.log_path, "ab") as out:
            for raw in stream:
                out.write(raw)
                out.flush()
                line = raw.decode(errors="replace").rstrip("\n")
                self.tail = [*self.tail[-39:], line]
                print(f"[{self.step.name}] {line}", flush=True)

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)  # srun forwards it to the step's tasks

    def wait(self, timeout_s: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class SlurmRun:
    def __init__(self, cfg: SAOConfig, config_path: str, overrides: list[str], nodes: list[Node]) -> None:
        self.cfg = cfg
        self.node_map: NodeMap = plan(cfg, nodes)
        self.logs = Path(cfg.launch.run_dir) / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        steps = build_steps(cfg, config_path, overrides, self.node_map)
        srun_args = list(cfg.launch.slurm.srun_args)
        # an engine's push agent (weight_sync.agent) is started, awaited, watched and restarted like an engine
        self.engines = [Running(s, self.logs, srun_args) for s in steps if s.role in ("engine", "agent")]
        (self.learner,) = [Running(s, self.logs, srun_args) for s in steps if s.role == "learner"]
        self.critic = next((Running(s, self.logs, srun_args) for s in steps if s.role == "critic"), None)
        self.workers = [Running(s, self.logs, srun_args) for s in steps if s.role == "worker"]
        self.signum = 0
        from megatron_sao.files import STOP_FILE

        self.stop_file = Path(cfg.launch.run_dir) / STOP_FILE

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum
        print(f"[launch] {signal.Signals(signum).name}: the learner checkpoints, then every step stops", flush=True)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        job = os.environ.get("SLURM_JOB_ID", "?")
        print(f"[launch] job {job}: {len(self.engines)} engine(s), learner on {len(self.node_map.learner)} node(s) "
              f"x {self.cfg.launch.nproc_per_node} rank(s), {len(self.workers)} rollout worker(s); logs in "
              f"{self.logs}\n{self.node_map.table()}", flush=True)  # fmt: skip
        code = 1
        try:
            self._start()
            code = self._watch()
        finally:
            learner_code = self._stop_all()
        if self.signum:  # stopped from outside: clean when the learner checkpointed and exited by itself
            print(f"[launch] stopped by {signal.Signals(self.signum).name}; the learner exited with {learner_code}",
                  flush=True)  # fmt: skip
            return 0 if learner_code == 0 else 1
        return code

    def _start(self) -> None:
        self.stop_file.unlink(missing_ok=True)  # a request the last run left
        for e in self.engines:
            e.start()
        self._wait_engines_healthy()
        self.learner.start()
        if self.critic is not None:
            self.critic.start()
        self._wait_engines_at(self._resume_version())
        for w in self.workers:
            w.start()
        print("[launch] rollout workers started; training", flush=True)

    def _wait_engines_healthy(self) -> None:
        deadline = time.monotonic() + self.cfg.rollout.health_timeout_s
        pending = [e for e in self.engines if e.step.url]  # node-rank 0 of each engine serves HTTP
        while pending:
            for e in [e for e in self.engines if e.exited() is not None]:  # any part of any engine
                raise LaunchError(f"{e.step.name} ({e.step.url or 'a node-rank > 0 part'}) exited with {e.exited()} "
                                  "while starting:\n" + "\n".join(e.tail[-20:]))  # fmt: skip
            for e in list(pending):
                if e.exited() is not None:
                    raise LaunchError(f"{e.step.name} ({e.step.url}) exited with {e.exited()} while starting:\n"
                                      + "\n".join(e.tail[-20:]))  # fmt: skip
                if SGLangClient(e.step.url or "").health(timeout_s=2.0):
                    pending.remove(e)
            if self.signum:
                raise LaunchError(f"stopped by {signal.Signals(self.signum).name} while the engines started")
            if pending and time.monotonic() > deadline:
                names = ", ".join(e.step.name for e in pending)
                raise LaunchError(f"{names} not healthy after rollout.health_timeout_s="
                                  f"{self.cfg.rollout.health_timeout_s:.0f}s (logs in {self.logs})")  # fmt: skip
            if pending:
                time.sleep(POLL_S)
        print(f"[launch] {len(self.engines)} engine(s) healthy", flush=True)

    def _resume_version(self) -> int:
        """The version the learner resumes at (its checkpoint's), 0 for a fresh run."""
        from megatron_sao.learner.checkpoint import own_checkpoint_dir

        latest = Path(self.cfg.learner.load or own_checkpoint_dir(self.cfg)) / "latest"
        if not latest.is_file():
            return 0
        match = re.fullmatch(r"iter_(\d+)", latest.read_text().strip())
        return int(match.group(1)) if match else 0

    def _wait_engines_at(self, version: int) -> None:
        """A resumed learner pushes its checkpoint's weights first; workers start once the engines hold them, so no
        token is generated with weights the learner never had."""
        if version == 0:
            return
        print(f"[launch] waiting for the learner to push version {version} (its checkpoint) to the engines",
              flush=True)  # fmt: skip
        while True:
            held = []
            for e in self.engines:
                if not e.step.url:
                    continue  # a node-rank > 0 part of an engine spanning nodes
                try:
                    held.append(SGLangClient(e.step.url or "").weight_version())
                except (OSError, ValueError, RuntimeError) as err:  # not answering yet (or restarting): not there
                    log.debug("%s: no weight version yet (%r)", e.step.name, err)
                    held.append(-1)
            if all(v >= version for v in held):
                return
            if self.learner.exited() is not None or self.signum:
                return  # _watch deals with it
            time.sleep(POLL_S)

    def _watch(self) -> int:
        limit = self.cfg.launch.max_restarts
        while True:
            if self.signum:
                return 0
            code = self.learner.exited()
            if code is None and self.critic is not None and self.critic.exited() == 0:
                # the value job ends with 0 only when the learner told it training is over: the learner is finishing
                # (its last checkpoint, the final push); let it, instead of taking it for a failure
                code = self.learner.wait(VALUE_DONE_GRACE_S)
            if code is None and self.critic is not None and self.critic.exited() is not None:
                # the learner cannot go on without its value job (nor checkpoint): stop it and start both again
                print(f"[launch] the value job exited with {self.critic.exited()}; stopping the learner to start both "
                      "again. Its log ends:\n" + "\n".join(self.critic.tail[-20:]), flush=True)  # fmt: skip
                self.learner.signal(signal.SIGTERM)
                code = self.learner.wait(30.0)
                if code is None:
                    self.learner.kill()
                    code = self.learner.exited() or 1
                code = code or 1  # an interrupted learner is a failed one here
            if code is not None:
                if code == 0:
                    print("[launch] the learner finished", flush=True)
                    return 0
                if code == 2 or code >= 128 or self.learner.restarts >= limit:
                    why = "refused its config" if code == 2 else f"exited with {code}"
                    print(f"[launch] the learner {why}; stopping the run. Its log ends:\n" +
                          "\n".join(self.learner.tail[-20:]), flush=True)  # fmt: skip
                    return 1 if code < 128 else code
                self._restart_learner(code)
            for r in (*self.engines, *self.workers):
                code = r.exited()
                if code is None or (r.step.role == "worker" and code == 0):
                    continue  # running, or a worker that ran out of prompts
                if code == 2 or r.restarts >= limit:  # 2: it refused its config, which a restart cannot change
                    why = "refused its config (exit 2)" if code == 2 else \
                        f"exited with {code} after {limit} restart(s) (launch.max_restarts)"  # fmt: skip
                    print(f"[launch] {r.step.name} {why}; stopping the run. Its log ends:\n" + "\n".join(r.tail[-20:]),
                          flush=True)  # fmt: skip
                    return 1
                self._restart(r, code)
            time.sleep(POLL_S)

    def _restart_learner(self, code: int) -> None:
        """The learner again, with a new value job beside it (the old one's bridge died with the learner)."""
        if self.critic is not None:
            self.critic.signal(signal.SIGTERM)
            self.critic.signal(signal.SIGTERM)  # a second one: the value job holds the first for the learner
            if self.critic.wait(30.0) is None:
                self.critic.kill()
        self._restart(self.learner, code)
        if self.critic is not None:
            self.critic.start()

    def _restart(self, r: Running, code: int) -> None:
        r.restarts += 1
        print(f"[launch] {r.step.name} exited with {code}; starting it again ({r.restarts}/"
              f"{self.cfg.launch.max_restarts})", flush=True)  # fmt: skip
        parts = self._engine_parts(r)
        for p in parts:  # the parts of an engine spanning nodes cannot rejoin a running one: all start again
            if p is not r and p.exited() is None:
                p.signal(signal.SIGTERM)
                if p.wait(30.0) is None:
                    p.kill()
        for p in parts:
            p.start()

    def _engine_parts(self, r: Running) -> list[Running]:
        """`r`, and for a part of an engine spanning nodes (engine-<i>, engine-<i>-node<r>) its other parts."""
        if r.step.role not in ("engine", "agent"):
            return [r]
        base = r.step.name.split("-node")[0]
        return [r] + [e for e in self.engines if e is not r and (e.step.name == base or
                                                                 e.step.name.startswith(base + "-node"))]  # fmt: skip

    def _stop_all(self) -> int | None:
        """The learner first (a stop request: it checkpoints and exits; SIGTERM, then SIGKILL if it has not within
        launch.stop_timeout_s), then workers and engines; the learner's exit status (None: never started)."""
        if self.learner.exited() is None and self.learner.proc is not None:
            self.stop_file.write_text(f"launcher, job {os.environ.get('SLURM_JOB_ID', '?')}\n")
            if self.learner.wait(self.cfg.launch.stop_timeout_s) is None:
                print(f"[launch] the learner did not stop within launch.stop_timeout_s="
                      f"{self.cfg.launch.stop_timeout_s:.0f}s; SIGTERM, then SIGKILL", flush=True)  # fmt: skip
                self.learner.signal(signal.SIGTERM)
                if self.learner.wait(30.0) is None:
                    self.learner.kill()
        if self.critic is not None and self.critic.wait(30.0) is None:  # the learner told it to stop, or is gone
            self.critic.kill()
        rest = [*self.workers, *self.engines]
        for r in rest:
            r.signal(signal.SIGTERM)
        deadline = time.monotonic() + 30.0
        for r in rest:
            if r.wait(max(deadline - time.monotonic(), 0.1)) is None:
                r.kill()
        print("[launch] every step stopped", flush=True)
        return self.learner.exited()


def run_slurm(cfg: SAOConfig, config_path: str, overrides: list[str]) -> int:
    """Inside an allocation: run every role as a step, watch them; the exit status (module docstring)."""
    try:
        make_configured(cfg.model)  # on the first node, before any step reads the model
        if cfg.rollout.api_key:  # the run's engine key, on the shared run dir (every step names it: steps.step_env)
            from megatron_sao.engines.auth import API_KEY_FILE_ENV, ensure_key

            os.environ[API_KEY_FILE_ENV] = str(ensure_key(cfg.launch.run_dir))  # this launcher's own health checks
        return SlurmRun(cfg, config_path, overrides, allocation_nodes()).run()
    except LaunchError as e:
        print(f"[launch] error: {e}", file=sys.stderr, flush=True)
        return 1

"""The learner's loop (every learner rank; `python -m megatron_sao learn CONFIG --engines URL[,URL...]`).

    resume from learner.load / save_dir/latest (weights, optimizers, version, bus de-dup state), else load HF
    rank 0: receive trajectories_per_step finished trajectories from the bus; every rank gets the same list
    learner.train_step: K value updates, one DIS policy update (version += 1)
    every weight_sync.interval versions (and when an engine joined or a push failed): every pipeline stage gathers
        its layers as HF tensors and its source broadcasts them to the engines (weight_sync/)
    every learner.save_interval versions and at the end: checkpoint (with the bus state), then commit the bus
    one progress line per step on rank 0, every metric in <run_dir>/metrics.jsonl

Engines start from the HF weights (version 0); after a resume they get the checkpoint's weights before any new
trajectory is taken, so the versions they tag tokens with are the learner's.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_sao.bus.schema import Trajectory
from megatron_sao.config.tree import SAOConfig
from megatron_sao.config.weight_sync import WeightSyncConfig

log = logging.getLogger(__name__)

WAIT_LOG_S = 30.0
"""A learner waiting for trajectories says so this often (with what the bus saw)."""
FINAL_PUSH_ATTEMPTS = 6
FINAL_PUSH_RETRY_S = 5.0
"""After the last step, a failed push is retried this many times, this far apart."""
RESYNC_AFTER_S = 5.0
"""A learner that waited this long while the engines may lag it pushes its weights again (see _fill)."""


def checkpoint_dir(cfg: SAOConfig) -> Path:
    """learner.save_dir, else <launch.run_dir>/checkpoints."""
    return Path(cfg.learner.save_dir or Path(cfg.launch.run_dir) / "checkpoints")


def _resume_path(cfg: SAOConfig) -> Path | None:
    from megatron_sao.learner.checkpoint import LATEST

    if cfg.learner.load:
        return Path(cfg.learner.load)
    if (checkpoint_dir(cfg) / LATEST).is_file():
        return checkpoint_dir(cfg)
    return None


def _share(obj: Any) -> Any:
    """Rank 0's object on every rank of the learner's world."""
    if dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class EngineWeights:
    """Which policy version the engines hold, as far as the learner knows, and when to push (every rank alike)."""

    def __init__(self, learner: Any, sync: Any, cfg: WeightSyncConfig) -> None:
        self.learner, self.sync, self.cfg = learner, sync, cfg  # sync: a WeightSync, or None without engines
        self.version = 0  # engines start from the HF weights
        self.failed = False  # the last push failed: retried at the next step, whatever the interval

    @property
    def enabled(self) -> bool:
        return self.sync is not None

    @property
    def lagging(self) -> bool:
        return self.enabled and (self.failed or self.learner.version != self.version)

    def due(self) -> bool:
        """Collective: push now? On the interval, after a failed push, or when the set of engines changed (one came
        back or joined: it is brought to the current version before the router gives it work)."""
        if not self.enabled:
            return False
        v = self.learner.version
        if v != self.version and (self.failed or v % self.cfg.interval == 0):
            return True
        return self.sync.engines_changed()

    def finish(self, attempts: int = FINAL_PUSH_ATTEMPTS) -> dict[str, float]:
        """Collective, at the end of training: the engines must end up with the final weights, so a last push that
        failed (an engine restarting) is retried, every FINAL_PUSH_RETRY_S, a few times; the last retry's metrics."""
        metrics: dict[str, float] = {}
        for attempt in range(attempts):
            if not self.lagging:
                break
            if attempt:
                time.sleep(FINAL_PUSH_RETRY_S)
            metrics = self.push()
        if self.lagging and dist.get_rank() == 0:
            log.error("the engines do not hold the final version %d (the last pushes failed)", self.learner.version)
        return metrics

    def push(self) -> dict[str, float]:
        """Collective: push the learner's weights; the same metrics on every rank."""
        result: dict[str, float] = _share(self.sync.push(self.learner.version) or None) or {}
        self.failed = bool(result.get("sync/failed"))
        if not self.failed:
            self.version = self.learner.version
        return result


class MetricsLog:
    """One JSON line per step in <run_dir>/metrics.jsonl (rank 0)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record, sort_keys=True) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _progress(step_s: float, batch: Sequence[Trajectory], metrics: dict[str, float], max_steps: int) -> str:
    rewards = [t.header.reward for t in batch]
    parts = [
        f"step {int(metrics.get('step/version', 0))}/{max_steps}",
        f"{len(batch)} traj",
        f"reward {sum(rewards) / max(len(rewards), 1):.3f}",
    ]
    for key, label in (("dis/pg_loss", "pg_loss"), ("value/v_loss", "v_loss"), ("staleness/mean", "staleness")):
        if key in metrics:
            parts.append(f"{label} {metrics[key]:.4g}")
    parts.append(f"{step_s:.1f}s")
    return " | ".join(parts)


def learn(cfg: SAOConfig, engine_urls: list[str], on_ready: Callable[[], None] | None = None) -> dict[str, Any]:
    """Train until learner.max_steps policy versions; returns rank 0's summary (final version, steps, paths).

    `on_ready` runs on rank 0 once the receiver listens and the engines hold the learner's weights (after a resume:
    once they were pushed), before the first trajectory is taken: run/local.py starts the rollout worker there, so
    no token is generated with weights the learner never had."""
    from megatron_sao.bus import TrajectoryReceiver
    from megatron_sao.distributed.bootstrap import destroy_distributed, init_distributed
    from megatron_sao.learner.checkpoint import load_checkpoint, save_checkpoint
    from megatron_sao.learner.learner import Learner

    init_distributed(cfg.parallel, seed=cfg.learner.seed)
    rank0 = dist.get_rank() == 0
    if not engine_urls and rank0:
        log.warning("no engine URLs (--engines / rollout.engine_urls): the engines never get the trained weights; "
                    "every trajectory will be generated by the initial policy")  # fmt: skip
    learner = Learner(cfg)
    resume = _resume_path(cfg)
    extra: dict[str, Any] = {}
    if resume is not None:
        extra = load_checkpoint(learner, resume)
        log.info("resumed from %s at version %d", resume, learner.version)
    elif cfg.model.hf_path:
        learner.load_hf(cfg.model.hf_path)
    else:
        raise ValueError("model.hf_path is not set and there is no checkpoint to resume: set model.hf_path")
    run_dir = Path(cfg.launch.run_dir)
    save_dir = str(checkpoint_dir(cfg))
    receiver = TrajectoryReceiver(cfg.bus, lambda: learner.version, state=extra.get("bus")) if rank0 else None
    sync = _weight_sync(learner, cfg, engine_urls) if engine_urls else None
    metrics_log = MetricsLog(run_dir / "metrics.jsonl") if rank0 else None
    engines = EngineWeights(learner, sync, cfg.weight_sync)
    steps = 0
    saved_at = learner.version if resume is not None else -1
    try:
        held: list[Trajectory] = []  # rank 0: trajectories received for the next step
        if engines.enabled and learner.version > 0:  # give the engines the checkpoint's weights first
            engines.push()
        if learner.version >= cfg.learner.max_steps and rank0:
            print(f"[learner] already at version {learner.version} >= learner.max_steps={cfg.learner.max_steps} "
                  f"(resumed from {resume}); raise learner.max_steps to train on", flush=True)  # fmt: skip
        elif rank0 and on_ready is not None:
            on_ready()
        while learner.version < cfg.learner.max_steps:
            n = cfg.learner.trajectories_per_step
            batch = _share((held[:n] if _fill(receiver, held, n, engines.lagging) else None) if rank0 else None)
            if batch is None:  # waiting while trajectories came stale or not at all: the engines lag, push again
                engines.push()
                continue
            del held[:n]
            t0 = time.monotonic()
            metrics = learner.train_step(batch)
            step_s = time.monotonic() - t0
            steps += 1
            if engines.due():  # a skipped step (nothing trainable) leaves the version: nothing new to push or save
                metrics.update(engines.push())
            due = learner.version % cfg.learner.save_interval == 0 or learner.version >= cfg.learner.max_steps
            if due and learner.version != saved_at:
                _save(learner, save_dir, receiver, save_checkpoint)
                saved_at = learner.version
            if rank0:
                assert receiver is not None and metrics_log is not None
                record = {"version": learner.version, "step_s": step_s, "time": time.time(), **metrics}
                record.update({f"bus/{k}": v for k, v in receiver.metrics().items()})
                metrics_log.write(record)
                print(f"[learner] {_progress(step_s, batch, metrics, cfg.learner.max_steps)}", flush=True)
        if saved_at != learner.version:
            _save(learner, save_dir, receiver, save_checkpoint)
        final = engines.finish()
        if final and metrics_log is not None:
            metrics_log.write({"version": learner.version, "time": time.time(), **final})
    finally:
        if sync is not None:
            try:
                sync.close()
            except Exception as e:  # the run's result does not depend on a clean goodbye
                log.warning("closing the weight update groups: %r", e)
        if receiver is not None:
            receiver.close()
        if metrics_log is not None:
            metrics_log.close()
    summary = {"version": learner.version, "steps": steps, "save_dir": save_dir, "run_dir": str(run_dir)}
    destroy_distributed()
    return summary


def _weight_sync(learner: Any, cfg: SAOConfig, engine_urls: list[str]) -> Any:
    """Collective: the learner's WeightSync (the plan of every stage's gathers, rank 0's engine set)."""
    import torch

    from megatron_sao.weight_sync import WeightSync, hf_dtype_of

    assert learner.policy is not None
    dtype_of = hf_dtype_of(learner.hf_source, torch.float32 if learner.spec.dtype == "fp32" else torch.bfloat16)
    return WeightSync(learner.policy.model, learner.spec, dtype_of, cfg.weight_sync, engine_urls)


def _fill(receiver: Any, held: list[Trajectory], n: int, lagging: bool) -> bool:
    """Receive into `held` until it holds n trajectories (True). Returns False, keeping what it took, when the
    engines may lag the learner and the bus has brought nothing fresh for RESYNC_AFTER_S: the last weight push
    failed (an engine was down), or trajectories keep arriving too stale to train on (an engine restarted with its
    initial weights); the caller then pushes the weights again. Says every WAIT_LOG_S that it is waiting."""
    waited = 0.0
    stale0 = receiver.metrics().get("stale_dropped", 0.0)
    while len(held) < n:
        slice_s = RESYNC_AFTER_S if waited < WAIT_LOG_S else WAIT_LOG_S
        got = receiver.recv_batch(n - len(held), timeout_s=slice_s)
        held += got
        if got or len(held) >= n:
            continue
        waited += slice_s
        m = receiver.metrics()
        if lagging or m.get("stale_dropped", 0.0) > stale0:
            return False
        if waited >= WAIT_LOG_S:
            log.warning(
                "learner waiting for trajectories: %d of %d this step (bus: %d sessions, %d accepted, %d rejected, "
                "%d dropped as stale)", len(held), n, int(m.get("sessions", 0)), int(m.get("accepted", 0)),
                int(m.get("rejected", 0)), int(m.get("stale_dropped", 0)),
            )  # fmt: skip
    return True


def _save(learner: Any, save_dir: str, receiver: Any, save_checkpoint: Any) -> None:
    """Checkpoint with rank 0's bus state in it, then tell the producers it is durable."""
    bus_state = _share(receiver.state_dict() if receiver is not None else None)
    path = save_checkpoint(learner, save_dir, extra={"bus": bus_state})
    if receiver is not None:
        receiver.commit()
        log.info("checkpoint %s (version %d)", path, learner.version)

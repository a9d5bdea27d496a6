"""The value job's process (`python -m megatron_sao critic CONFIG --bridge tcp://HOST:PORT`, every rank; torchrun for
more than one) for a critic on its own ranks (config.roles.Jobs.value): its torch.distributed world with the critic's
layout, its end of the bridge to the learner job, the signals it holds for the learner job, and its teardown. What
crosses the bridge, and the learner that answers it, are learner/value_job.py's.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

from megatron_sao.config.tree import SAOConfig
from megatron_sao.distributed.bridge import Bridge
from megatron_sao.learner.value_job import BRIDGE_TIMEOUT_S, ValueJob, value_job_config

log = logging.getLogger(__name__)


def start_value_job(cfg: SAOConfig, bridge_address: str) -> ValueJob:
    """Collective over the value job: its world (the critic's layout), the bridge (rank 0) and the value model."""
    from megatron_sao.distributed.bootstrap import init_distributed

    cfg = value_job_config(cfg)
    layout = init_distributed(cfg.parallel, seed=cfg.learner.seed)
    bridge = Bridge.open(bridge_address, host=False, timeout_s=BRIDGE_TIMEOUT_S) if layout.is_rank0 else None
    return ValueJob(cfg, bridge, layout)


def stop_value_job(job: ValueJob) -> None:
    """Its end of the bridge, then its world."""
    from megatron_sao.distributed.bootstrap import destroy_distributed

    job.close()
    destroy_distributed()


def serve(cfg: SAOConfig, bridge_address: str) -> None:
    """The value job's loop, on every rank: answer the policy job until it says Stop (or goes away)."""
    # A stop (scancel, Ctrl-C) reaches both jobs: the policy job checkpoints, which needs this one, and then tells it
    # to stop. A second signal ends it at once.
    signals = {"n": 0}

    def on_signal(signum: int, frame: Any) -> None:
        signals["n"] += 1
        if signals["n"] > 1:
            raise KeyboardInterrupt
        log.warning("%s: the value job waits for the policy job to checkpoint and stop it", signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    job = None
    try:
        job = start_value_job(cfg, bridge_address)
        job.serve()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if job is not None:
            stop_value_job(job)

"""Files every stage writes, kept whole: append-only JSON-lines logs and a full disk named (jsonl.py). The lowest
layer beside config/: no torch, no megatron."""

from megatron_sao.files.jsonl import DiskFull, JsonlAppender, is_disk_full, no_space, read_records

# What a run directory holds (launch.run_dir), named once:
STOP_FILE = "STOP"
"""A request that the learner finish its step, checkpoint and stop (written by the Slurm launcher, the local run's
supervisor, or a user); removed by the learner once it stopped."""
METRICS_FILE = "metrics.jsonl"
"""One record per learner step, push and evaluation (files/metrics_schema.py, record "learner")."""


SAMPLES_FILE = "samples.jsonl"
"""A few decoded trajectories of each learner step (run/samples.py, launch.samples_per_step)."""
TRAJECTORIES_FILE = "trajectories.jsonl"
"""The learner's side of the trajectory ledger: what each step consumed (run/ledger.py)."""
STALE_FILE = "stale.jsonl"
"""The bus's record of trajectories over bus.max_staleness (bus/staleness.py; in bus.stale_log_dir)."""
CHECKPOINTS_DIR = "checkpoints"
"""The learner's checkpoints unless learner.save_dir says otherwise."""


def rollout_metrics_file(worker_id: str) -> str:
    """A rollout worker's records (files/metrics_schema.py, record "rollout")."""
    return f"rollout_metrics_{worker_id}.jsonl"


__all__ = ["CHECKPOINTS_DIR", "METRICS_FILE", "SAMPLES_FILE", "STALE_FILE", "STOP_FILE", "TRAJECTORIES_FILE",
           "DiskFull", "JsonlAppender", "is_disk_full", "no_space", "read_records", "rollout_metrics_file"]  # fmt: skip

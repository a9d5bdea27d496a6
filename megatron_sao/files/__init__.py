"""Files every stage writes, kept whole: append-only JSON-lines logs and a full disk named (jsonl.py). The lowest
layer beside config/: no torch, no megatron."""

from megatron_sao.files.jsonl import DiskFull, JsonlAppender, is_disk_full, no_space, read_records

STOP_FILE = "STOP"
"""<run_dir>/STOP: a request that the learner finish its step, checkpoint and stop (written by the Slurm launcher, the
local run's supervisor, or a user); removed by the learner once it stopped."""

__all__ = ["STOP_FILE", "DiskFull", "JsonlAppender", "is_disk_full", "no_space", "read_records"]

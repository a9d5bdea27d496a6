"""Files every stage writes, kept whole: append-only JSON-lines logs and a full disk named (jsonl.py). The lowest
layer beside config/: no torch, no megatron."""

from megatron_sao.files.jsonl import DiskFull, JsonlAppender, is_disk_full, no_space, read_records

__all__ = ["DiskFull", "JsonlAppender", "is_disk_full", "no_space", "read_records"]

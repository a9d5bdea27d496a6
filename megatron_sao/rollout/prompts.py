"""Prompt records from JSONL files and a resumable cursor over them (owned by rollout/; the worker takes prompts
from it, tools/make_prompts.py writes the files).

A record is one JSON object per line with a unique "id" and what its environment needs: "messages" (a chat),
"prompt" / "question" text, or "input_ids" (token-in/token-out, used as is), plus task fields (e.g. "answer").
The cursor hands out (key, record) pairs epoch after epoch and remembers which were handed out but not completed;
`state_dict()` / `save()` capture that, and a cursor loaded from it re-issues the pending prompts first, then
continues where it stopped, so a restarted worker neither skips a prompt nor repeats one completed in the saved
state (the worker saves it whenever a prompt completes; docs/rollout.md says what a restart can repeat).
"""

from __future__ import annotations

import json
import os
import random
import threading
from pathlib import Path
from typing import Any

from megatron_sao.files.jsonl import FULL_ERRNOS, DiskFull, no_space


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    records = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e})") from e
            if not isinstance(rec, dict) or "id" not in rec:
                raise ValueError(f"{path}:{lineno}: each line must be an object with an 'id'")
            records.append(rec)
    ids = [str(r["id"]) for r in records]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate prompt ids")
    if not records:
        raise ValueError(f"{path}: no prompts")
    return records


TRAINING_PROMPTS = 10_000
"""Prompts a rollout worker makes with its environment (seed 0) when rollout.env.prompts names no file."""


def training_prompts(env: Any, prompts_file: str | None) -> list[dict[str, Any]]:
    """The prompts training draws from: rollout.env.prompts, else TRAINING_PROMPTS made by the environment."""
    return read_jsonl(prompts_file) if prompts_file else env.make_prompts(TRAINING_PROMPTS)


def write_jsonl(path: str | Path, records: list[dict[str, Any]]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")


class PromptCursor:
    """Thread-safe cursor: `take()` -> (key, record) or None when `epochs` are exhausted; `complete(key)`."""

    def __init__(self, records: list[dict[str, Any]], *, epochs: int | None = 1, shuffle_seed: int | None = None):
        if not records:
            raise ValueError("PromptCursor needs at least one prompt")
        self.records = records
        self.epochs = epochs
        self.shuffle_seed = shuffle_seed
        self._lock = threading.Lock()
        self._epoch, self._index = 0, 0
        self._pending: dict[str, None] = {}  # handed out, not completed (insertion ordered)
        self._redo: list[str] = []  # pending keys restored from a saved state, handed out first
        self.completed = 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle_seed is not None:
            random.Random(self.shuffle_seed + epoch).shuffle(order)
        return order

    def record(self, key: str) -> dict[str, Any]:
        """The record for a key "epoch:position"; its id gets "@epoch" after the first epoch (unique group ids)."""
        epoch, pos = (int(x) for x in key.split(":"))
        rec = dict(self.records[self._order(epoch)[pos]])
        if epoch:
            rec["id"] = f"{rec['id']}@{epoch}"
        return rec

    def take(self) -> tuple[str, dict[str, Any]] | None:
        with self._lock:
            if self._redo:
                key = self._redo.pop(0)
            else:
                if self._index >= len(self.records):
                    self._epoch, self._index = self._epoch + 1, 0
                if self.epochs is not None and self._epoch >= self.epochs:
                    return None
                key = f"{self._epoch}:{self._index}"
                self._index += 1
            self._pending[key] = None
            return key, self.record(key)

    def complete(self, key: str) -> None:
        with self._lock:
            del self._pending[key]
            self.completed += 1

    def reopen(self, key: str) -> None:
        """A completed prompt whose trajectory was lost after all (a damaged spool file): hand it out again."""
        with self._lock:
            if key not in self._pending and key not in self._redo:
                self._redo.append(key)
                self.completed -= 1

    def state_dict(self, not_durable: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
        """`not_durable`: completed keys whose trajectories could still be lost (sent without a spool, not yet
        committed by the learner): saved as pending, so a crash re-issues them instead of marking them done."""
        with self._lock:
            pending = [*self._redo, *self._pending]
            redo = [k for k in not_durable if k not in self._pending and k not in self._redo]
            return {
                "epoch": self._epoch,
                "index": self._index,
                "pending": [*pending, *sorted(redo)],
                "completed": self.completed - len(redo),
                "num_records": len(self.records),
                "shuffle_seed": self.shuffle_seed,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_records"] != len(self.records) or state.get("shuffle_seed") != self.shuffle_seed:
            raise ValueError("saved cursor state belongs to another prompt file or shuffle seed; delete it to restart")
        with self._lock:
            self._epoch, self._index = int(state["epoch"]), int(state["index"])
            self._redo = list(state["pending"])
            self._pending = {}
            self.completed = int(state["completed"])

    def save(self, path: str | Path, not_durable: set[str] | frozenset[str] = frozenset()) -> None:
        tmp = Path(f"{path}.tmp")
        try:
            tmp.write_text(json.dumps(self.state_dict(not_durable)))
            os.replace(tmp, path)
        except OSError as e:  # the saved cursor stays as it was
            tmp.unlink(missing_ok=True)
            if e.errno in FULL_ERRNOS:
                raise DiskFull(e.errno, no_space(Path(path).parent, "launch.run_dir", Path(path).name)) from e
            raise

    def load(self, path: str | Path) -> bool:
        """Restore from `path` when it exists; returns whether it did."""
        if not Path(path).is_file():
            return False
        self.load_state_dict(json.loads(Path(path).read_text()))
        return True

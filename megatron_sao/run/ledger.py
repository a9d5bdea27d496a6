"""The trajectory ledger's check: `python -m megatron_sao ledger RUN_DIR` proves that nothing was lost or trained
twice. Its sources, all under the run dir:

    ledger/<worker>.jsonl   each rollout worker: sending (written before the bus takes it), produced (taken),
                            undelivered, failed, dropped_group, prompt_done, rejected (refused by the receiver
                            for good, or lost from a damaged spool file: then its prompt is generated again)
    trajectories.jsonl      the learner: one line per trajectory a step consumed, and a `start` mark each time a
                            learner (re)starts -- what was consumed after the checkpoint it starts from is void
                            (those trajectories come again and are trained then)
    stale.jsonl             the bus: trajectories dropped as too stale (bus.stale_log_dir)
    spool/<worker>/*.traj   what producers hold uncommitted: sent, not yet covered by a checkpoint (resent next run)
    (trajectories.jsonl)    `held` marks: what the last checkpoint holds for groups not yet whole (trained on resume)

Every produced id must be consumed exactly once (after replaying the restarts), or dropped as stale, or still
pending in a spool or held in the last checkpoint, or -- lost with a worker that had no spool -- its prompt generated
again later (the worker's cursor keeps such prompts pending until the learner commits their trajectories). An id
only `sending` when its worker died never reached the bus (its prompt was not marked done). Every consumed id must
have been sent; every prompt a worker marked done must have a trajectory or a failure on record. Anything else is a
violation: the command prints the counts and the first violations and exits 1.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPOOL_MAGIC = b"SAOSPOOL1\n"  # bus/spool.py's file layout: MAGIC | u64 seq | u32 n_frames | u32 id_len | id ...
_SPOOL_FIXED = struct.Struct("<QII")


@dataclass
class LedgerReport:
    produced: int = 0
    consumed: int = 0
    voided: int = 0  # consumed after the checkpoint a later start resumed from (trained again after it)
    stale_dropped: int = 0
    pending: int = 0
    failed_episodes: int = 0
    dropped_groups: int = 0
    undelivered: int = 0
    prompts_done: int = 0
    regenerated: int = 0  # lost with a spool-less worker's crash; their prompts were generated again
    cut: int = 0  # its worker died while handing it to the bus (never sent; the prompt stayed pending)
    rejected: int = 0  # refused by the receiver for good (invalid)
    spool_lost: int = 0  # lost from a damaged spool file (their prompts must have been generated again)
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def describe(self, limit: int = 20) -> str:
        lines = [
            f"produced {self.produced}, consumed {self.consumed} (+{self.voided} voided by restarts), dropped as "
            f"stale {self.stale_dropped}, pending in spools {self.pending}; failed episodes {self.failed_episodes}, "
            f"dropped groups {self.dropped_groups}, undelivered at a stop {self.undelivered} (prompts left pending), "
            f"prompts done {self.prompts_done}; lost in a crash and generated again {self.regenerated}, cut before "
            f"the bus took them {self.cut}; refused by the receiver {self.rejected}, lost from a damaged spool "
            f"{self.spool_lost}",
            f"{'OK' if self.ok else 'VIOLATIONS'}: {len(self.violations)} violation(s)",
        ]
        lines += [f"  {v}" for v in self.violations[:limit]]
        if len(self.violations) > limit:
            lines.append(f"  ... and {len(self.violations) - limit} more")
        return "\n".join(lines)


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:  # a line cut by a crash mid-write: only the last one can be
                out.append({"event": "unreadable", "where": f"{path}:{n}"})
    return out


def consumed_ids(learner_lines: list[dict[str, Any]]) -> tuple[list[str], int]:
    """(ids consumed, in order, after replaying every start mark; how many were voided)."""
    kept: list[tuple[tuple[int, int], str]] = []
    voided = 0
    for line in learner_lines:
        if line.get("event") == "start":
            at = (int(line["version"]), int(line.get("pretrain_steps", 0)))
            before = len(kept)
            kept = [(k, i) for k, i in kept if k <= at]
            voided += before - len(kept)
        elif "id" in line:
            kept.append(((int(line["step_version"]), int(line.get("pretrain_steps", 0))), str(line["id"])))
    return [i for _, i in kept], voided


def spooled_ids(spool_dir: Path) -> set[str]:
    ids = set()
    for f in spool_dir.glob("*/*.traj") if spool_dir.is_dir() else []:
        with f.open("rb") as h:
            head = h.read(len(SPOOL_MAGIC) + _SPOOL_FIXED.size)
            if not head.startswith(SPOOL_MAGIC) or len(head) < len(SPOOL_MAGIC) + _SPOOL_FIXED.size:
                continue
            _, _, id_len = _SPOOL_FIXED.unpack(head[len(SPOOL_MAGIC) :])
            ids.add(h.read(id_len).decode(errors="replace"))
    return ids


def check_ledger(
    run_dir: str | Path, spool_dir: str | Path | None = None, stale_log: str | Path | None = None
) -> LedgerReport:
    run = Path(run_dir)
    report = LedgerReport()
    worker_lines = [line for f in sorted((run / "ledger").glob("*.jsonl")) for line in _lines(f)]
    learner_lines = _lines(run / "trajectories.jsonl")
    for line in (*worker_lines, *learner_lines):
        if line.get("event") == "unreadable":
            report.violations.append(f"unreadable ledger line {line['where']}")
    produced: dict[str, dict[str, Any]] = {}
    sending: dict[str, dict[str, Any]] = {}
    refused: set[str] = set()
    last_try: dict[tuple[str, str], float] = {}  # (worker, prompt) -> time of its latest sample on record
    accounted_prompts: set[tuple[str, str]] = set()
    done_prompts: list[tuple[str, str]] = []
    for line in worker_lines:
        event = line.get("event")
        if event in ("sending", "produced", "failed"):
            key = (str(line["worker"]), str(line["prompt"]))
            last_try[key] = max(last_try.get(key, 0.0), float(line.get("time", 0.0)))
        if event == "sending":
            sending[line["id"]] = line
        elif event == "produced":
            if line["id"] in produced:
                report.violations.append(f"trajectory {line['id']} produced twice (workers {line['worker']} and "
                                         f"{produced[line['id']]['worker']})")  # fmt: skip
            produced[line["id"]] = line
            accounted_prompts.add((line["worker"], line["prompt"]))
        elif event == "failed":
            report.failed_episodes += 1
            accounted_prompts.add((line["worker"], line["prompt"]))
        elif event == "undelivered":  # given up by the sink while stopping: its prompt stays pending
            report.undelivered += 1
        elif event == "dropped_group":
            report.dropped_groups += 1
            accounted_prompts.add((line["worker"], line["prompt"]))
        elif event == "prompt_done":
            done_prompts.append((line["worker"], line["prompt"]))
        elif event == "rejected":
            if line.get("reason") == "spool_corrupt":
                report.spool_lost += 1
            else:
                report.rejected += 1
                refused.add(str(line["id"]))
    consumed, report.voided = consumed_ids(learner_lines)
    helds = [line for line in learner_lines if line.get("event") == "held"]
    held = set(helds[-1]["ids"]) if helds else set()  # in the last checkpoint, for groups not yet whole
    counts = Counter(consumed)
    stale = {str(x["trajectory_id"]) for x in _lines(Path(stale_log) if stale_log else run / "stale.jsonl")
             if x.get("action") == "dropped"}  # fmt: skip
    pending = spooled_ids(Path(spool_dir) if spool_dir else run / "spool")
    report.produced, report.consumed = len(produced), len(consumed)
    report.stale_dropped, report.pending, report.prompts_done = len(stale), len(pending | held), len(done_prompts)
    workers_with_ledgers = {line["worker"] for line in worker_lines}
    for tid, n in counts.items():
        if n > 1:
            report.violations.append(f"trajectory {tid} trained {n} times")
    for line in learner_lines:
        tid = line.get("id")
        known = tid in produced or tid in sending
        if tid is not None and not known and line.get("worker") in workers_with_ledgers:
            report.violations.append(f"trajectory {tid} was trained but its worker never sent it")
    fate = set(counts) | stale | pending | held | refused
    report.cut = sum(1 for tid in sending if tid not in produced and tid not in fate)
    for tid, line in produced.items():
        if tid in fate:
            continue
        if last_try.get((line["worker"], line["prompt"]), 0.0) > float(line.get("time", 0.0)):
            report.regenerated += 1
            continue
        where = f"prompt {line['prompt']}, worker {line['worker']}"
        report.violations.append(f"trajectory {tid} ({where}) was produced and then lost: not trained, not "
                                 "dropped as stale, not in a spool, its prompt not generated again")  # fmt: skip
    for worker, prompt in done_prompts:
        if (worker, prompt) not in accounted_prompts:
            report.violations.append(f"prompt {prompt} marked done by {worker} without a trajectory or a failure")
    return report

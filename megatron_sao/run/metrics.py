"""What the learner records: its metrics (<run_dir>/metrics.jsonl, TensorBoard events under <run_dir>/tensorboard,
wandb when enabled; the keys are files/metrics_schema.py's) and the trajectory ledger (<run_dir>/trajectories.jsonl)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_sao.bus.schema import Trajectory
from megatron_sao.files import METRICS_FILE, DiskFull, JsonlAppender, is_disk_full, no_space

log = logging.getLogger(__name__)


def batch_metrics(batch: Sequence[Trajectory]) -> dict[str, float]:
    """Per-step facts of the trajectories themselves: reward, its components, success, token counts."""
    n = max(len(batch), 1)
    out = {
        "reward/mean": sum(t.header.reward for t in batch) / n,
        "tokens/generated": float(sum(int(t.action_mask.sum()) for t in batch)),
        "step/tokens": float(sum(t.header.num_tokens for t in batch)),
    }
    success = [t.header.metadata["success"] for t in batch if "success" in t.header.metadata]
    if success:
        out["reward/success_rate"] = sum(bool(s) for s in success) / len(success)
    components: dict[str, list[float]] = {}
    for t in batch:
        for k, v in t.header.metadata.items():
            if k.startswith("reward/") and isinstance(v, (int, float)):
                components.setdefault(k, []).append(float(v))
    out.update({k: sum(v) / len(v) for k, v in components.items()})
    return out


class MetricsLog:
    """Where rank 0's records go: one JSON line each in <run_dir>/metrics.jsonl, every numeric value as a TensorBoard
    scalar at global step `step` (launch.tensorboard), and to wandb (launch.wandb)."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, wandb: str | None = None, config: Any = None,
                 resumed_at: int | None = None) -> None:  # fmt: skip
        """`resumed_at`: the step of the checkpoint a run resumed from; what an earlier run recorded past it (steps it
        trained after its last checkpoint, trained again now) is dropped from metrics.jsonl and TensorBoard, so every
        step is recorded once."""
        if resumed_at is not None:
            drop_after(run_dir / METRICS_FILE, resumed_at)
        self.file = JsonlAppender(run_dir / METRICS_FILE, "launch.run_dir")
        self.tb = None
        self.tb_dir = run_dir / "tensorboard"
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            try:  # purge_step: TensorBoard drops the earlier runs' events from that step on
                purge = None if resumed_at is None else resumed_at + 1
                self.tb = SummaryWriter(log_dir=str(self.tb_dir), purge_step=purge)
            except OSError as e:
                raise self._tb_failed(e) from e
        self.wandb = None
        if wandb:
            self.wandb = _start_wandb(run_dir, wandb, config)

    def write(self, record: Mapping[str, Any]) -> None:
        self.file.write(record, sort_keys=True)
        scalars = {k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
        step = int(record.get("step", 0))
        if self.tb is not None:
            try:
                for k, v in scalars.items():
                    self.tb.add_scalar(k, v, global_step=step, walltime=record.get("time"))
                self.tb.flush()
            except OSError as e:
                raise self._tb_failed(e) from e
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def samples(self, step: int, records: list[dict[str, Any]]) -> None:
        """A step's decoded samples (run/samples.py): TensorBoard's text tab, a wandb table."""
        if self.tb is not None:
            fence = "```"
            text = "\n\n".join(f"**reward {r['reward']:g}**, {r['turns']} turns, versions {r['versions']}, "
                                 f"{r['finish_reason']}\n\n{fence}text\n{r['prompt']}\n----\n{r['response']}\n{fence}"
                                 for r in records)  # fmt: skip
            try:
                self.tb.add_text("samples", text, global_step=step)
            except OSError as e:
                raise self._tb_failed(e) from e
        if self.wandb is not None:
            import wandb

            columns = ["step", "reward", "turns", "prompt", "response"]
            self.wandb.log({"samples": wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in records])},
                           step=step)  # fmt: skip

    def _tb_failed(self, e: OSError) -> OSError:
        """TensorBoard's writer thread fails later than the write that filled the disk; the error is named here and
        the writer dropped (metrics.jsonl stays whole and is the record of truth)."""
        tb, self.tb = self.tb, None
        if tb is not None:
            with contextlib.suppress(OSError):
                tb.close()
        if is_disk_full(e):
            return DiskFull(e.errno, no_space(self.tb_dir.parent, "launch.run_dir", "tensorboard events"))
        return e

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            try:
                self.tb.close()
            except OSError as e:
                raise self._tb_failed(e) from e
        if self.wandb is not None:
            self.wandb.finish()


def drop_after(path: Path, step: int) -> None:
    """Rewrite a per-step JSON-lines file (metrics, samples) without the records of steps after `step` (a line that
    does not parse is kept)."""
    if not path.is_file():
        return
    kept, dropped = [], 0
    for line in path.read_text().splitlines(keepends=True):
        try:
            late = int(json.loads(line).get("step", 0)) > step
        except (ValueError, AttributeError, TypeError):
            late = False
        if late:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
        log.info("resumed at step %d: dropped %d records of later steps from %s (they are trained again)", step,
                 dropped, path)  # fmt: skip


def _start_wandb(run_dir: Path, mode: str, config: Any) -> Any:
    try:
        import wandb
    except ImportError:
        log.warning("launch.wandb=%s but wandb is not installed (pip install wandb); not logging to wandb", mode)
        return None
    return wandb.init(dir=str(run_dir), mode=mode, project="megatron-sao", name=run_dir.name,
                      config=config.model_dump() if config is not None else None, resume="allow")  # fmt: skip


class TrajectoryLedger:
    """One JSON line per trajectory a step trained on, in <run_dir>/trajectories.jsonl (rank 0): which step (the
    version after it), its weight versions, tokens, turns and timings (start, finish, generation and tool seconds,
    arrival at the learner). What the pipeline-efficiency benchmark and the cluster simulator read."""

    def __init__(self, path: Path, start_version: int, pretrain_steps: int) -> None:
        self.file = JsonlAppender(path, "launch.run_dir")
        # A learner (re)starting from a checkpoint voids what it consumed after that checkpoint: it trains on those
        # trajectories again (the bus resends them). The ledger check (run/ledger.py) replays these marks.
        self.file.write({"event": "start", "version": start_version, "pretrain_steps": pretrain_steps,
                         "time": time.time()})  # fmt: skip

    def write(
        self, batch: Sequence[Trajectory], version: int, pretrain: bool, pretrain_steps: int = 0,
        first_values: dict[str, float] | None = None,
    ) -> None:  # fmt: skip
        """`first_values`: the critic's value at each trajectory's first action token (arms with a critic)."""
        now = time.time()
        first_values = first_values or {}
        lines = []
        for t in batch:
            h = t.header
            acted = t.weight_versions[t.action_mask]
            extra: dict[str, Any] = {"metadata": dict(h.metadata)} if h.metadata else {}
            if h.trajectory_id in first_values:
                extra["value_first"] = first_values[h.trajectory_id]
            lines.append({
                "id": h.trajectory_id, "prompt_id": h.prompt_id, "sample": h.sample_index, "worker": h.worker_id,
                "step_version": version, "pretrain": pretrain, "pretrain_steps": pretrain_steps,
                "versions": [int(acted.min()), int(acted.max())] if acted.size else None,
                "tokens": h.num_tokens, "action_tokens": int(t.action_mask.sum()), "turns": len(h.turns),
                "reward": h.reward, "started_at": h.timings.started_at, "finished_at": h.timings.finished_at,
                "sent_at": h.timings.sent_at, "trained_at": now, "gen_s": sum(turn.generate_s for turn in h.turns),
                "tool_s": sum(turn.tool_s for turn in h.turns), **extra,
            })  # fmt: skip
        self.file.write_many(lines)  # a step's lines whole, or none (a full disk: DiskFull)

    def held(self, ids: list[str], version: int, pretrain_steps: int) -> None:
        """At a checkpoint: the trajectories it holds for groups not yet whole (trained after a resume from it)."""
        self.file.write({"event": "held", "ids": ids, "version": version, "pretrain_steps": pretrain_steps,
                         "time": time.time()})  # fmt: skip

    def close(self) -> None:
        self.file.close()

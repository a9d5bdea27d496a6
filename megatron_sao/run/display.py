"""The learner's progress as a person watches it (rank 0): a live rich view on an interactive terminal -- step of
max_steps with a bar and ETA, reward, tokens/s, weight version, staleness, DIS masked fraction -- or one plain line
per step when stdout is not a TTY, under CI or inside a Slurm job (launch.display). While the live view runs, log
lines and warnings print above it instead of breaking through it."""

from __future__ import annotations

import os
import sys
from typing import Any, Literal

Mode = Literal["auto", "rich", "plain"]


def live_display_wanted(mode: Mode) -> bool:
    if mode != "auto":
        return mode == "rich"
    return sys.stdout.isatty() and not os.environ.get("CI") and not os.environ.get("SLURM_JOB_ID")


class StepDisplay:
    def __init__(self, max_steps: int, start: int, mode: Mode = "auto") -> None:
        self.progress: Any = None
        if live_display_wanted(mode):
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("[bold]learner[/] step {task.completed:.0f}/{task.total:.0f}"),
                BarColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[facts]}"),
            )
            self.task = self.progress.add_task("train", total=max_steps, completed=start, facts="waiting")
            self.progress.start()
            self._route_logs()

    def _route_logs(self) -> None:
        """Log lines and warnings go above the live view (rich's handler on its console), not through it; the
        handlers they replace come back at close()."""
        import logging

        from rich.logging import RichHandler

        root = logging.getLogger()
        self._replaced = [h for h in root.handlers if isinstance(h, logging.StreamHandler)
                          and getattr(h, "stream", None) in (sys.stderr, sys.stdout)]  # fmt: skip
        level = min((h.level for h in self._replaced), default=logging.NOTSET)
        for h in self._replaced:
            root.removeHandler(h)
        self._rich = RichHandler(console=self.progress.console, show_path=False, level=level)
        root.addHandler(self._rich)
        logging.captureWarnings(True)  # FutureWarnings and the like: as log lines, above the view

    def step(self, record: dict[str, Any], line: str) -> None:
        """One step's record (run/metrics.py keys) and its plain line."""
        if self.progress is None:
            print(f"[learner] {line}", flush=True)
            return
        facts = [
            f"reward {record.get('reward/mean', 0.0):.3f}",
            f"{record.get('throughput/tokens_per_s', 0.0):.0f} tok/s",
            f"v{record.get('weight_version', 0)}",
        ]
        if "staleness/mean" in record:
            facts.append(f"stale {record['staleness/mean']:.2f}")
        if "dis/masked_frac" in record:
            facts.append(f"masked {record['dis/masked_frac']:.3f}")
        if "pretrain/samples" in record:
            facts.append(f"value pre-training {record['pretrain/samples']:.0f} samples")
        self.progress.update(self.task, completed=record.get("weight_version", 0), facts=" | ".join(facts))

    def note(self, line: str) -> None:
        """A line that is not a step (printed above the live view)."""
        if self.progress is None:
            print(line, flush=True)
        else:
            self.progress.console.print(line)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            import logging

            root = logging.getLogger()
            root.removeHandler(self._rich)
            for h in self._replaced:
                root.addHandler(h)
            logging.captureWarnings(False)

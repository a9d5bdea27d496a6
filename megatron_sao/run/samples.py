"""What the model writes, step by step, for a person to read (owned by run/; run/learn.py writes them on rank 0):
`launch.samples_per_step` trajectories of each trained batch, decoded with the model's tokenizer, into
<run_dir>/samples.jsonl (files.SAMPLES_FILE), TensorBoard's text tab and a wandb table.

The samples are spread over the batch sorted by reward (the best and the worst first), so a step's two show what
earns reward and what does not. A record: step, weight_version, trajectory_id, reward, turns, finish_reason, the
versions that generated it, the environment, the prompt and what followed it (the model's turns and the tools'
observations, as one text). Without a tokenizer (a model directory that has none) the token ids are written instead.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_sao.bus.schema import Trajectory
from megatron_sao.files import SAMPLES_FILE, JsonlAppender
from megatron_sao.run.metrics import MetricsLog, drop_after

log = logging.getLogger(__name__)

TEXT_CHARS = 2000
"""Each text is cut to its last this many characters (a long episode's end is what decided its reward)."""


def spread(batch: Sequence[Trajectory], k: int) -> list[Trajectory]:
    """`k` trajectories spread over the batch sorted by reward, best first then worst, then between."""
    ranked = sorted(batch, key=lambda t: -t.header.reward)
    if k >= len(ranked):
        return ranked
    if k == 1:
        return ranked[:1]
    picks = sorted({round(i * (len(ranked) - 1) / (k - 1)) for i in range(k)})
    order = [picks[0], picks[-1], *picks[1:-1]]
    return [ranked[i] for i in order]


class SampleLog:
    """Rank 0's samples: appended per step; a resumed run drops the records past its checkpoint, as metrics do."""

    def __init__(self, run_dir: Path, hf_path: str | None, per_step: int, metrics: MetricsLog | None = None,
                 resumed_at: int | None = None) -> None:  # fmt: skip
        self.per_step, self.metrics, self.hf_path = per_step, metrics, hf_path
        if resumed_at is not None:
            drop_after(run_dir / SAMPLES_FILE, resumed_at)
        self.file = JsonlAppender(run_dir / SAMPLES_FILE, "launch.run_dir") if per_step else None
        self._tokenizer: Any = None
        self._loaded = False

    def tokenizer(self) -> Any:
        """The model's tokenizer, loaded once (None when the model directory has none)."""
        if not self._loaded:
            self._loaded = True
            if self.hf_path:
                try:
                    from transformers import AutoTokenizer

                    self._tokenizer = AutoTokenizer.from_pretrained(self.hf_path)
                except (OSError, ValueError) as e:
                    log.warning("samples: no tokenizer in %s (%s); writing token ids", self.hf_path, e)
        return self._tokenizer

    def decode(self, tokens: Any) -> str:
        ids = [int(t) for t in tokens]
        tok = self.tokenizer()
        text = tok.decode(ids, skip_special_tokens=False) if tok is not None else " ".join(map(str, ids))
        return text if len(text) <= TEXT_CHARS else "..." + text[-TEXT_CHARS:]

    def record(self, step: int, version: int, t: Trajectory) -> dict[str, Any]:
        h = t.header
        generated = t.weight_versions[t.action_mask]
        return {
            "step": step, "weight_version": version, "trajectory_id": h.trajectory_id, "reward": h.reward,
            "turns": len(h.turns), "finish_reason": str(h.finish_reason), "env": h.metadata.get("env"),
            "versions": [int(generated.min()), int(generated.max())] if generated.size else [],
            "prompt": self.decode(t.tokens[: h.prompt_len]), "response": self.decode(t.tokens[h.prompt_len :]),
        }  # fmt: skip

    def write(self, step: int, version: int, batch: Sequence[Trajectory]) -> None:
        if self.file is None or not batch:
            return
        records = [self.record(step, version, t) for t in spread(batch, self.per_step)]
        for r in records:
            self.file.write(r)
        if self.metrics is not None:
            self.metrics.samples(step, records)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()

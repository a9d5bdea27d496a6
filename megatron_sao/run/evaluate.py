"""Evaluations in a run and of checkpoints (owned by run/; the measuring itself is rollout/evaluate.py).

- `EvalSchedule` (the learner's rank 0, eval.interval > 0): an evaluation of version v starts in a thread once the
  engines hold v (the first version, every eval.interval versions, the last); the learner trains on, and its next
  push waits for the evaluation (`hold`), so the evaluation measures v alone. Each evaluation is a record in
  metrics.jsonl (run/metrics.py: eval/*).
- `evaluate_checkpoint` (`python -m megatron_sao eval CONFIG --checkpoint PATH|RUN_DIR`): the checkpoint's policy
  converted to HF, served by engines started here (the config's engine kind), evaluated with a progress bar; a table.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_sao.config.tree import SAOConfig
from megatron_sao.files import CHECKPOINTS_DIR, METRICS_FILE, read_records
from megatron_sao.rollout.evaluate import Evaluation, Evaluator

log = logging.getLogger(__name__)


def make_evaluator(cfg: SAOConfig, engine_urls: list[str]) -> Evaluator:
    """An Evaluator on the engines at `engine_urls` with the config's environment and the model's chat template."""
    from transformers import AutoTokenizer

    from megatron_sao.engines.client import EngineRouter, RetryPolicy, SGLangClient
    from megatron_sao.rollout.agent_loop import ChatTemplateCodec
    from megatron_sao.rollout.envs import make_env

    r = cfg.rollout
    if cfg.model.hf_path is None:
        raise ValueError("model.hf_path is not set: evaluation needs the model's tokenizer and chat template")
    clients = [SGLangClient(u, timeout_s=r.request_timeout_s, retry=RetryPolicy(r.max_retries)) for u in engine_urls]
    codec = ChatTemplateCodec(AutoTokenizer.from_pretrained(cfg.model.hf_path))
    return Evaluator(cfg, make_env(r.env.name, r.env.options), codec, EngineRouter(clients))


def evaluated_versions(run_dir: Path, up_to: int) -> set[int]:
    """Versions up to `up_to` (the version a run resumes at) its metrics.jsonl already holds a finished evaluation of:
    a resumed run does not measure them again (later ones belonged to steps the resume discards)."""
    out = set()
    for record in read_records(run_dir / METRICS_FILE):  # a torn last line (a run that died mid-write) left out
        version = record.get("eval/weight_version")
        if version is not None and not record.get("eval/given_up") and int(version) <= up_to:
            out.add(int(version))
    return out


class EvalSchedule:
    """When to evaluate during training and the evaluation in flight (rank 0 of the learner)."""

    GRACE_S = 30.0
    """How long past eval.timeout_s a push waits for a cancelled evaluation's last requests before going out."""

    def __init__(self, cfg: SAOConfig, evaluator: Evaluator, write: Callable[[dict[str, Any]], None],
                 done: set[int] | None = None, should_stop: Callable[[], bool] = lambda: False) -> None:  # fmt: skip
        self.interval, self.timeout_s = cfg.eval.interval, cfg.eval.timeout_s
        self.evaluator, self.write, self.should_stop = evaluator, write, should_stop
        self.done = set(done or ())
        self._thread: threading.Thread | None = None
        self._results: dict[int, Evaluation] = {}  # by version: the thread's outcome
        self._version = -1
        self._started = 0.0

    def due(self, version: int, final: bool = False) -> bool:
        return version not in self.done and version != self._version and (final or version % self.interval == 0)

    def start(self, version: int, final: bool = False) -> None:
        """Evaluate `version` (which the engines hold now) in the background, if due."""
        if not self.due(version, final):
            return
        self.hold()
        self._version, self._started = version, time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(version,), name=f"eval-v{version}", daemon=True)
        self._thread.start()

    def _run(self, version: int) -> None:
        try:
            result = self.evaluator.run(version)
        except Exception as e:  # an evaluation must never take training down with it
            log.error("evaluation of version %d failed: %r", version, e)
            result = Evaluation(version, self.evaluator.k, given_up=True, errors=1)
        self._results[version] = result

    def hold(self) -> float:
        """Wait for the evaluation in flight (before a push: it measures the weights the engines hold now) and write
        its record; the seconds waited. A stop request, or eval.timeout_s (+ GRACE_S) passing, cancels it: the push
        never waits longer than that (other learner ranks wait for this one inside the push)."""
        if self._thread is None:
            return 0.0
        t0 = time.monotonic()
        limit = self._started + self.timeout_s
        while self._thread.is_alive():
            if self.should_stop() or time.monotonic() > limit:
                self.evaluator.cancel_now()
                if time.monotonic() > limit + self.GRACE_S:
                    break  # its last requests end on their own timeouts; the record says given up
            self._thread.join(0.5)
        self._thread = None
        self._finish()
        return time.monotonic() - t0

    def poll(self) -> None:
        """Write the record of an evaluation that finished meanwhile (after each step)."""
        if self._thread is not None and not self._thread.is_alive():
            self.hold()

    def _finish(self) -> None:
        version, self._version = self._version, -1
        result = self._results.pop(version, None) or Evaluation(version, self.evaluator.k, given_up=True)
        record = result.as_record()
        if not result.given_up:
            self.done.add(result.version)
        self.write(record)
        if "eval/reward/mean" in record:
            k = result.k
            log.info("eval of version %d: reward %.3f, pass@1 %.3f, pass@%d %.3f (%d prompts, %.1f s)",
                     result.version, record["eval/reward/mean"], record["eval/pass@1"], k, record[f"eval/pass@{k}"],
                     int(record["eval/prompts"]), result.seconds)  # fmt: skip


def checkpoint_to_evaluate(path: str | Path) -> Path:
    """A run dir (its checkpoints' `latest`), a save dir holding `latest`, or one checkpoint directory; ValueError
    naming the path otherwise."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"--checkpoint {p}: no such file or directory")
    for save_dir in (p / CHECKPOINTS_DIR, p / CHECKPOINTS_DIR / "policy", p):
        latest = save_dir / "latest"
        if latest.is_file():
            target = save_dir / latest.read_text().strip()
            if not target.is_dir():
                raise ValueError(f"--checkpoint {p}: {latest} names {target.name}, which is missing")
            return target
    if (p / "metadata.json").is_file() or (p / ".metadata").is_file():
        return p
    raise ValueError(f"--checkpoint {p}: neither a run dir (checkpoints/latest), a save dir (latest) nor a "
                     "checkpoint (metadata.json)")  # fmt: skip


def checkpoint_version(ckpt: Path) -> int:
    """iter_0000040 -> 40 (pretrain_* and other names: 0)."""
    name = ckpt.name
    return int(name.split("_", 1)[1]) if name.startswith("iter_") and name.split("_", 1)[1].isdigit() else 0


def evaluate_checkpoint(cfg: SAOConfig, checkpoint: str | None) -> tuple[Evaluation, str]:
    """Evaluate a checkpoint's policy (None: model.hf_path as it is, version 0) on engines started for it; (what it
    measured, what was evaluated). The HF conversion is kept under <run_dir>/eval/<checkpoint name>/hf."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from megatron_sao.convert.megatron_to_hf import convert_megatron_to_hf
    from megatron_sao.engines import sglang_launcher as engines
    from megatron_sao.engines.client import SGLangClient
    from megatron_sao.models.tiny import make_configured

    make_configured(cfg.model)
    if cfg.model.hf_path is None or not (Path(cfg.model.hf_path) / "config.json").is_file():
        raise ValueError(f"model.hf_path={cfg.model.hf_path!r} holds no HF model: the config's model is needed for "
                         "its tokenizer and config.json")  # fmt: skip
    version, served, what = 0, cfg.model.hf_path, f"{cfg.model.hf_path} (no checkpoint: the initial weights)"
    if checkpoint is not None:
        ckpt = checkpoint_to_evaluate(checkpoint)
        version, what = checkpoint_version(ckpt), str(ckpt)
        stamp = int((ckpt / "metadata.json").stat().st_mtime) if (ckpt / "metadata.json").is_file() else 0
        hf = Path(cfg.launch.run_dir) / "eval" / f"{ckpt.name}-{stamp}" / "hf"  # a rewritten checkpoint: a new one
        if not (hf / "config.json").is_file():
            print(f"[eval] converting {ckpt} to HF in {hf}", flush=True)
            convert_megatron_to_hf(ckpt, hf, cfg.model.hf_path, force=True, progress=False)
        served = str(hf)
    logs = Path(cfg.launch.run_dir) / "eval" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    from megatron_sao.distributed.spawn import find_free_port

    # its own port: never the config's, where a live run's engines may answer (and be relabelled by this)
    rollout = cfg.rollout.model_copy(update={"engine_urls": [], "model_path": served, "num_engines": 1,
                                             "base_port": find_free_port()})  # fmt: skip
    if rollout.api_key:  # its engines answer only to this run too (engines/auth.py)
        from megatron_sao.engines.auth import API_KEY_FILE_ENV, ensure_key

        os.environ[API_KEY_FILE_ENV] = str(ensure_key(cfg.launch.run_dir))
    commands = engines.engine_commands(rollout, served, cfg.launch.gpus_per_node or 0)
    urls = [url for url, _ in commands]
    print(f"[eval] starting {len(commands)} {rollout.engine} engine(s) on {served}: {', '.join(urls)}", flush=True)
    procs = engines.launch(commands, logs)
    try:
        engines.wait_healthy(procs, rollout.health_timeout_s)
        for url in urls:  # label the weights with the checkpoint's version: every sample must carry it
            SGLangClient(url).update_weight_version(version)
        evaluator = make_evaluator(cfg, urls)
        total = len(evaluator.prompts) * evaluator.k
        columns = (TextColumn("[eval] version {task.fields[version]}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn())  # fmt: skip
        with Progress(*columns, transient=False) as bar:
            task = bar.add_task("eval", total=total, version=version)
            result = evaluator.run(version, progress=lambda done, _: bar.update(task, completed=done))
    finally:
        engines.stop(procs)
    return result, what


def table(result: Evaluation, what: str) -> str:
    """The evaluation as a rich table (rendered to text)."""
    from rich.console import Console
    from rich.table import Table

    record = result.as_record()
    t = Table(title=f"held-out evaluation of {what}", min_width=72)
    t.add_column("metric")
    t.add_column("value", justify="right")
    for key in sorted(k for k in record if k.startswith("eval/")):
        value = record[key]
        t.add_row(key, f"{value:.4g}" if isinstance(value, float) and not value.is_integer() else f"{value:g}")
    console = Console(width=100, record=True)
    with console.capture() as cap:
        console.print(t)
    return cap.get()

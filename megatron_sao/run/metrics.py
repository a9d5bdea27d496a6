"""What a run records, in one place: the metrics schema (every key a record may hold, what it means, when it is
there) of the learner's records (<run_dir>/metrics.jsonl, TensorBoard events under <run_dir>/tensorboard, wandb when
enabled) and of each rollout worker's, engines included (<run_dir>/rollout_metrics_<worker>.jsonl, written by
rollout/worker.py); and the trajectory ledger (<run_dir>/trajectories.jsonl). docs/run.md's metrics tables are
schema_table()'s output; tests/run/test_metrics.py checks that runs write every key listed and nothing unlisted."""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_sao.bus.schema import Trajectory
from megatron_sao.files import METRICS_FILE, DiskFull, JsonlAppender, is_disk_full, no_space

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Metric:
    key: str  # exact, or a pattern with * (fnmatch)
    when: str  # a key of WHEN
    meaning: str
    record: str = "learner"  # a key of RECORDS: which file holds it


RECORDS = {
    "learner": "the learner's records: <run_dir>/metrics.jsonl, TensorBoard, wandb",
    "rollout": "each rollout worker's records, every rollout.log_interval_s: <run_dir>/rollout_metrics_<worker>.jsonl",
}

WHEN = {
    "step": "every step record",
    "ppo": "grpo arms with algo.grpo.policy_loss: ppo_clip (the default is dis)",
    "worker": "every worker record",
    "engine": "every worker record, one key per engine its router knows (* = the engine's URL)",
    "policy": "policy steps",
    "critic": "arms with a critic (sao; value pre-training)",
    "group": "grpo, grpo_async",
    "push": "a record whose iteration pushed weights (steps, and pushes between steps)",
    "env": "environments that report it",
    "pretrain": "value pre-training steps",
    "moe": "learner.moe_aux_loss_coeff > 0",
    "routes": "policy steps with rollout.return_routed_experts (on with learner.routing_replay)",
    "skipped": "steps with nothing trainable",
    "eval": "evaluation records (eval.interval > 0): the first version, every eval.interval versions, the last",
    "eval_wait": "a record whose push waited for an evaluation in flight",
    "separate": "policy steps with learner.value_on_separate_ranks (the critic in a value job of its own)",
}

SCHEMA: tuple[Metric, ...] = (
    Metric("step", "step", "learner steps so far in the run (value pre-training and policy steps; survives resume)"),
    Metric("time", "step", "unix time of the record"),
    Metric("weight_version", "step", "policy version after the step (the version engines get next)"),
    Metric("reward/mean", "step", "mean reward of the step's trajectories"),
    Metric("reward/success_rate", "env", "fraction of the step's trajectories whose environment reported success"),
    Metric("reward/*", "env", "mean of a reward component the environment reports (metadata reward/<name>)"),
    Metric("trajectories/consumed", "step", "trajectories trained on so far (cumulative; survives resume)"),
    Metric("tokens/consumed", "step", "tokens (prompt, actions, observations) trained on so far (cumulative)"),
    Metric("tokens/generated", "step", "action tokens of the step's trajectories: what the engines generated"),
    Metric("step/tokens", "step", "all tokens of the step's trajectories"),
    Metric("throughput/tokens_per_s", "step", "tokens/generated / time/step"),
    Metric("throughput/trajectories_per_s", "step", "step/trajectories / time/step"),
    Metric("step/trajectories", "step", "trajectories in the step"),
    Metric("step/action_tokens", "step", "action tokens the learner trained on (after dropping invalid ones)"),
    Metric("step/invalid_trajectories", "step", "trajectories dropped as untrainable (logged with the reason)"),
    Metric("step/microbatches", "step", "micro-batches per rank"),
    Metric("step/version", "step", "the policy version after the step (what the progress line shows)"),
    Metric("step/skipped", "skipped", "1 when nothing in the step was trainable (the version does not move)"),
    Metric("step/groups", "group", "prompt groups in the step"),
    Metric("step/partial_groups", "group", "groups missing samples (always 0: steps take whole groups)"),
    Metric("staleness/mean", "step", "mean over trajectories of (version - oldest token version)"),
    Metric("staleness/max", "step", "largest staleness in the step"),
    Metric("staleness/min", "step", "smallest staleness in the step"),
    Metric("staleness/versions_in_step", "step", "distinct weight versions among the step's action tokens"),
    Metric("loss/policy", "policy", "policy loss (DIS: -sum m r A / N)"),
    Metric("loss/value", "critic", "value loss after the last of the K critic updates"),
    Metric(
        "loss/value_first",
        "critic",
        "value loss of the first critic update, before the critic trained on the "
        "batch (what pre-training's stopping rule watches)",
    ),  # fmt: skip
    Metric("dis/*", "policy", "DIS diagnostics: masked fractions (low / high), ratio mean / max, mismatch KL"),
    Metric(
        "ppo/*",
        "ppo",
        "PPO-clip diagnostics: clipfrac (tokens whose ratio left [1 - clip_eps, 1 + clip_eps_high]), ratio "
        "mean / max, approx_kl (k3), logprob_abs_diff, num_action_tokens",
    ),  # fmt: skip
    Metric("policy/*", "policy", "policy optimizer: grad norm, lr, update_ok"),
    Metric(
        "value/explained_variance",
        "critic",
        "1 - Var(returns - values) / Var(returns) of the values GAE used, "
        "before the critic trained on the batch (honest: what decisions read)",
    ),
    Metric(
        "value/explained_variance_first_token",
        "critic",
        "the same on each trajectory's first action token (the critic's estimate of the episode from the prompt alone)",
    ),
    Metric(
        "value/explained_variance_post",
        "critic",
        "the same in the last critic update's forward, after K - 1 "
        "updates on the batch (optimistic: the critic has seen these returns)",
    ),  # fmt: skip
    Metric("value/*", "critic", "critic diagnostics: clipfrac, returns and value means, grad norm, lr, updates"),
    Metric("gae/*", "critic", "GAE over action tokens: lambda_policy mean, advantages mean / std, returns mean"),
    Metric(
        "routing/mismatch_frac",
        "routes",
        "share of (token, layer) routing decisions where the policy's own router picks another top-k set than the "
        "engine did, in the policy update's forward, over the positions the engines routed (replayed or not)",
    ),  # fmt: skip
    Metric("routing/replayed", "routes", "1 when the policy routed by the engines' routes (learner.routing_replay)"),
    Metric(
        "routing/critic_mismatch_frac",
        "routes",
        "with learner.critic_routing_replay: the same share for the critic's own router (frozen in training) against "
        "the engines', over the critic's forwards of the step, which all replayed the engines' routes",
    ),  # fmt: skip
    Metric("moe/*", "moe", "MoE router losses per layer (load-balancing aux loss, z-loss), as megatron tracks them"),
    Metric(
        "pretrain/*",
        "pretrain",
        "value pre-training progress: samples (new trajectories), steps, critic_steps "
        "(critic steps of the step: the new batch, then passes over the buffer), done",
    ),  # fmt: skip
    Metric(
        "sync/reason",
        "push",
        "why weights were pushed: interval, retry, engines_changed, deferred, resync, resume, final",
    ),  # fmt: skip
    Metric(
        "sync/*",
        "push",
        "the push: engines, bytes, buckets, tensors, seconds and time_* phases, failed, peak_mb, "
        "unverified (samples an engine showed neither by checksum nor by rows)",
    ),  # fmt: skip
    Metric("bus/*", "step", "the trajectory bus: sessions, accepted, rejected by reason, stale dropped, staleness"),
    Metric("time/step", "step", "wall time of the iteration, waiting included"),
    Metric("time/wait", "step", "waiting for the step's trajectories"),
    Metric("time/critic", "critic", "the K critic updates"),
    Metric("time/policy", "policy", "the policy update"),
    Metric("time/critic_wait", "separate", "the policy job waiting for the value job's advantages"),
    Metric("time/critic_tail", "separate", "from the policy update's end to the end of the critic's K updates"),
    Metric(
        "step/critic_ahead",
        "separate",
        "1 when the step's batch reached the value job during the step before (its values were ready sooner)",
    ),  # fmt: skip
    Metric("time/sync", "step", "weight pushes in the iteration"),
    Metric("time/checkpoint", "step", "saving a checkpoint in the iteration"),
    Metric("time/eval_wait", "eval_wait", "the push waiting for the evaluation of the weights the engines held"),
    Metric("eval/weight_version", "eval", "the one weight version every sample of the evaluation came from"),
    Metric("eval/reward/mean", "eval", "mean reward of the held-out samples (eval.samples_per_prompt per prompt)"),
    Metric(
        "eval/success_rate",
        "eval",
        "share of the held-out samples solved (success, else reward >= eval.success_reward)",
    ),  # fmt: skip
    Metric("eval/pass@*", "eval", "unbiased pass@k over the held-out prompts, for k = 1 and eval.samples_per_prompt"),
    Metric("eval/avg@*", "eval", "mean share of solved samples per prompt, k = eval.samples_per_prompt"),
    Metric("eval/prompts", "eval", "held-out prompts evaluated"),
    Metric("eval/samples", "eval", "samples evaluated"),
    Metric("eval/time", "eval", "seconds the evaluation took"),
    Metric("eval/discarded", "eval", "samples that came back from another weight version and were run again"),
    Metric("eval/restarts", "eval", "times the evaluation started over on the version the engines moved to"),
    Metric(
        "eval/given_up",
        "eval",
        "1 when it was given up (eval.timeout_s, eval.max_restarts, a stop, or an error); then it records no scores",
    ),  # fmt: skip
    Metric("eval/errors", "eval", "samples that failed (an engine error, a prompt too long): the first gives it up"),
    # a rollout worker's records (cumulative since the worker started)
    Metric("time", "worker", "unix time of the record", "rollout"),
    Metric("worker", "worker", "the worker's id (rollout-0, ...)", "rollout"),
    Metric("rollout/trajectories", "worker", "trajectories finished and handed to the bus", "rollout"),
    Metric("rollout/prompts_done", "worker", "prompts all of whose samples were pushed", "rollout"),
    Metric("rollout/trajectories_per_s", "worker", "rollout/trajectories per second since the start", "rollout"),
    Metric("rollout/action_tokens_per_s", "worker", "generated (action) tokens per second since the start", "rollout"),
    Metric("rollout/mean_reward", "worker", "mean reward of the trajectories pushed", "rollout"),
    Metric("rollout/reissued", "worker", "episodes re-issued after an engine failed them", "rollout"),
    Metric("rollout/failed", "worker", "episodes given up (re-issue budget spent)", "rollout"),
    Metric(
        "rollout/dropped_groups", "worker", "prompt groups dropped because a sample failed (group arms)", "rollout"
    ),  # fmt: skip
    Metric("rollout/episode_tokens_mean", "worker", "tokens per episode (prompt, actions, observations)", "rollout"),
    Metric("rollout/turns_mean", "worker", "generation turns per episode", "rollout"),
    Metric("rollout/tool_calls_mean", "worker", "tool calls per episode", "rollout"),
    Metric("rollout/engine_latency_s_mean", "worker", "seconds per turn from request to last token", "rollout"),
    Metric("rollout/tool_s_mean", "worker", "seconds per tool call", "rollout"),
    Metric("engine/*/requests", "engine", "requests the router sent to the engine", "rollout"),
    Metric(
        "engine/*/failures",
        "engine",
        "requests that failed on it (connection, timeout, error status); each marks it unhealthy",
        "rollout",
    ),  # fmt: skip
    Metric("engine/*/tokens", "engine", "tokens it generated for this worker", "rollout"),
    Metric("engine/*/outstanding", "engine", "requests in flight on it at the record", "rollout"),
)


def schema_entry(key: str, record: str = "learner") -> Metric | None:
    """The schema entry a written key of a `record` (RECORDS) falls under (exact keys first)."""
    entries = [m for m in SCHEMA if m.record == record]
    for m in entries:
        if m.key == key:
            return m
    return next((m for m in entries if "*" in m.key and fnmatch.fnmatchcase(key, m.key)), None)


def schema_table(record: str = "learner") -> str:
    """The schema of a record (RECORDS) as the markdown table docs/run.md shows."""
    rows = ["| key | when | meaning |", "|---|---|---|"]
    rows += [f"| `{m.key}` | {WHEN[m.when]} | {m.meaning} |" for m in SCHEMA if m.record == record]
    return "\n".join(rows)


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
            _drop_after(run_dir / METRICS_FILE, resumed_at)
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


def _drop_after(path: Path, step: int) -> None:
    """Rewrite metrics.jsonl without the records of steps after `step` (a line that does not parse is kept)."""
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

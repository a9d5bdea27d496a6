"""The metrics schema, in one place below every stage: every key a record may hold, what it means and when it is
there, for the learner's records (<run_dir>/metrics.jsonl, TensorBoard, wandb; written by run/metrics.py) and each
rollout worker's (<run_dir>/rollout_metrics_<worker>.jsonl, written by rollout/worker.py, which checks its keys
here). docs/run.md's metrics tables are schema_table()'s output; tests/run/test_metrics.py checks that runs write
every key listed and nothing unlisted."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass


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


def unlisted_keys(keys: Iterable[str], record: str = "learner") -> list[str]:
    """The keys of a `record` (RECORDS) the schema does not list, sorted."""
    return sorted(k for k in keys if schema_entry(k, record) is None)

"""The SAO learner: a policy and a value model on megatron-core, and the step that trains them on a batch of
finished trajectories.

    values_old = V(trajectories)                         forward only, value model
    A, R = GAE(rewards, values_old; lambda_policy / 1)   algo.compute_step_targets
    K times: value optimizer step on v_loss(V, values_old, R)     K = algo.value.updates_per_policy_step
    once:    policy optimizer step on DIS(logp, logp_rollout, A)
The critic-free arms (grpo, grpo_async, running_mean) replace the first three lines with sequence-level baselines.
Built by the training entry point; checkpointed by learner/checkpoint.py.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_sao.algo import (
    KeyedRunningMeanBaseline,
    RunningMeanBaseline,
    StateValueTable,
    compute_step_targets,
    gae_span,
    grpo_advantages,
    sequence_to_token_advantages,
    token_rewards,
    turn_to_token_advantages,
)
from megatron_sao.bus.schema import Routes, Trajectory
from megatron_sao.config.learner import Routing
from megatron_sao.config.parallel import ParallelConfig
from megatron_sao.config.tree import SAOConfig
from megatron_sao.distributed.bootstrap import DistContext
from megatron_sao.distributed.collectives import gather_to_rank0
from megatron_sao.learner.batch import StepBatch, check_trainable, make_step_batch, select, shard_for_data_parallel
from megatron_sao.learner.errors import NonFiniteTraining
from megatron_sao.learner.forward import collect_values
from megatron_sao.learner.metrics import all_reduce_scalar, explained_variance, reduce_metrics
from megatron_sao.learner.packing import MicroBatch, check_eager_attention_memory, pack_microbatches, plan_microbatches
from megatron_sao.learner.roles import RoleModel, build_role
from megatron_sao.learner.step import ev_totals, first_action_tokens, policy_update, value_update
from megatron_sao.models.builder import ModelSpec, uses_transformer_engine
from megatron_sao.models.checkpoint import hf_source_record
from megatron_sao.models.weights import TIED_LM_HEAD, HFCheckpoint, load_hf_weights

logger = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """One step's share of work on this rank."""

    num_trajectories: int
    mine: list[int]  # indices of this data-parallel rank's trajectories
    batch: StepBatch
    mbs: list[MicroBatch]
    metrics: dict[str, float]
    sequence_advantages: torch.Tensor | None  # critic-free arms: [num_trajectories]


def check_learner_parallelism(parallel: ParallelConfig) -> None:
    """Refuse layouts the learner does not implement yet, instead of training on wrong numbers."""
    if parallel.context > 1:
        raise ValueError(
            f"parallel.context = {parallel.context}: the learner does not split packed sequences across "
            "context-parallel ranks yet; set parallel.context=1 (long trajectories: raise parallel.tensor with "
            "sequence parallelism, or lower learner.max_tokens_per_microbatch)"
        )
    if parallel.virtual_pipeline is not None:
        raise ValueError(
            f"parallel.virtual_pipeline = {parallel.virtual_pipeline}: the learner builds one model chunk per "
            "pipeline stage (no interleaved schedule yet); remove parallel.virtual_pipeline"
        )


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _reward_sums(rewards: torch.Tensor, mask: torch.Tensor, algo: Any) -> torch.Tensor:
    """The critic's targets when lambda_critic = 1: discounted reward sums, whatever the values (GAE with lambda 1
    telescopes to them), so they exist before any value is computed."""
    return compute_step_targets(rewards, torch.zeros_like(rewards), mask, algo.gae).returns


def _first_values(batch: StepBatch, values: torch.Tensor) -> dict[str, float]:
    """{trajectory id: value at its first action position} of this rank's rows."""
    first = first_action_tokens(batch.action_mask)
    out = {}
    for row, traj_id in enumerate(batch.trajectory_ids):
        cols = first[row].nonzero()
        if cols.numel():
            out[traj_id] = float(values[row, int(cols[0])])
    return out


def _data_parallel_sum(stats: torch.Tensor, group: Any) -> torch.Tensor:
    """algo.Moments over this stage's data-parallel ranks: whitening sees the whole step, not this rank's shard."""
    out = stats.to(_device())
    dist.all_reduce(out, group=group)
    return out.cpu()


class Learner:
    """Owns the roles on this rank, the policy weight version and the critic-free baselines' state."""

    def __init__(self, cfg: SAOConfig, spec: ModelSpec | None = None, roles: Collection[str] | None = None, *,
                 layout: DistContext) -> None:  # fmt: skip
        """`roles`: the models built on these ranks; default: those of the learner job (config.roles.Jobs: both, the
        critic only for algo.name=sao; with a value job of its own the learner job (run/learn.py) builds {"policy"}
        and the value job (run/critic.py) {"value"}, and each passes its own). `layout`: what init_distributed
        returned."""
        jobs = cfg.jobs
        if roles is None and jobs.value is not None:
            raise ValueError(
                "learner.value_on_separate_ranks=true: this learner needs roles={'policy'} or roles={'value'} "
                "(one per job: run/learn.py and run/critic.py), or set learner.value_on_separate_ranks=false"
            )
        roles = set(jobs.learner.roles if roles is None else roles)
        self.job = jobs.job_for(roles)
        """The job this learner belongs to (config.roles): where it saves its checkpoints."""
        check_learner_parallelism(cfg.parallel)
        self.cfg = cfg
        self.layout = layout
        self.spec = spec or ModelSpec.from_config(cfg.model)
        self.use_thd = uses_transformer_engine(self.spec)  # the same decision build_role's layer specs follow
        if not self.use_thd:
            arch = self.spec.family.architecture(self.spec.hf)
            warning = check_eager_attention_memory(cfg.learner.max_tokens_per_microbatch, arch["num_layers"],
                                                   arch["num_attention_heads"], cfg.parallel)  # fmt: skip
            if warning and layout.is_rank0:
                logger.warning(warning)
        learner, algo = cfg.learner, cfg.algo
        self.routes: Routes | None = None
        """The routes trajectories must carry (rollout.return_routed_experts): the policy replays or measures them."""
        routing: Routing = "off"
        if cfg.rollout.return_routed_experts and "policy" in roles:
            num_experts = self.spec.family.architecture(self.spec.hf).get("num_moe_experts")
            if not num_experts:
                raise ValueError("rollout.return_routed_experts / learner.routing_replay need a MoE model; "
                                 f"{self.spec.family.name} at {cfg.model.hf_path} has no routed experts")  # fmt: skip
            self.routes = Routes.of_model(self.spec.hf, num_experts)
            routing = "replay" if learner.routing_replay else "measure"
        self.policy: RoleModel | None = None
        if "policy" in roles:
            self.policy = build_role(
                self.spec, cfg.parallel, "policy", learner.policy, tp_rank=layout.tp_rank,
                total_steps=learner.max_steps, use_distributed_optimizer=learner.use_distributed_optimizer,
                moe_aux_loss_coeff=learner.moe_aux_loss_coeff, recompute=learner.recompute, routing=routing,
            )  # fmt: skip
        self.value: RoleModel | None = None
        if "value" in roles:
            self.value = build_role(
                self.spec, cfg.parallel, "value", learner.value, tp_rank=layout.tp_rank,
                total_steps=learner.max_steps * algo.value.updates_per_policy_step,
                use_distributed_optimizer=learner.use_distributed_optimizer,
                recompute=learner.recompute, routing="replay" if learner.critic_routing_replay else "off",
            )  # fmt: skip
        self.hf_source: dict[str, Any] | None = None
        """Where the weights came from (models.checkpoint.hf_source_record: HF config, each tensor's HF dtype, tied
        lm_head), set by every load and written into every checkpoint, so the reverse conversion restores dtypes."""
        self.version = 0
        """Policy weight version: the number of policy optimizer steps taken (engines tag tokens with it)."""
        self.trajectories_trained = 0
        self.loaded_from: Path | None = None
        """The checkpoint directory the last load_checkpoint restored (after a fall-back: the one it fell back to)."""
        self.first_values: dict[str, float] = {}
        """Rank 0, after a critic step: each trajectory's value at its first action token (the critic's estimate of
        the episode from the prompt alone), by id; the run loop writes it into the trajectory ledger."""
        self.value_head_fitted = False
        """Whether the critic's head bias was set from a first batch (_fit_value_bias); checkpointed. A head loaded
        fresh (HF weights, a weights-only checkpoint) is not."""
        self.nonfinite_total: dict[str, int] = {}  # optimizer steps skipped for NaN/Inf gradients, per model
        self.nonfinite_in_a_row: dict[str, int] = {}
        self.running_mean: RunningMeanBaseline | KeyedRunningMeanBaseline | None = None
        if algo.name == "running_mean":
            rm = algo.running_mean
            self.running_mean = (KeyedRunningMeanBaseline(rm.window) if rm.group_by else
                                 RunningMeanBaseline(rm.window))  # fmt: skip
        self.state_values = None  # the oracle_value arm's table of state values
        if algo.name == "oracle_value":
            self.state_values = StateValueTable(algo.oracle_value.window, algo.oracle_value.lambda_turn)
        if self.layout.is_rank0:
            for role in (self.policy, self.value):
                if role is not None:
                    logger.info(role.report.summary(role.role))

    # ------------------------------------------------------------------ weights

    def load_hf(self, hf_dir: str) -> None:
        """Initialize both models from an HF checkpoint (the value backbone starts from the policy's weights)."""
        hf = HFCheckpoint(hf_dir)
        tied_lm_head = self.spec.tie_embeddings and TIED_LM_HEAD in hf.names()
        self.hf_source = hf_source_record(self.spec, {name: hf.dtype(name) for name in hf.names()}, tied_lm_head)
        for role in (self.policy, self.value):
            if role is not None:
                load_hf_weights(role.model, self.spec, hf, role=role.role)
                role.reload_main_params()
        self.value_head_fitted = False

    # ------------------------------------------------------------------ the step

    def train_step(self, trajectories: Sequence[Trajectory], update_policy: bool = True) -> dict[str, float]:
        """One SAO step on `trajectories` (the same list on every rank). update_policy=False runs the critic
        only (value pre-training on rollouts of the frozen initial policy). Returns step metrics."""
        plan = self._plan(trajectories)
        if plan is None or isinstance(plan, dict):
            return plan or {}
        t0 = time.monotonic()
        if self.value is not None:
            advantages = self._critic_updates(plan)
            plan.metrics["time/critic"] = time.monotonic() - t0
        else:
            assert plan.sequence_advantages is not None
            mine, mask = plan.sequence_advantages[plan.mine], plan.batch.action_mask
            advantages = (turn_to_token_advantages(mine, plan.batch.turn_index, mask) if mine.dim() == 2
                          else sequence_to_token_advantages(mine, mask))  # fmt: skip
        t1 = time.monotonic()
        if update_policy:
            self._policy_update(plan, advantages)
            plan.metrics["time/policy"] = time.monotonic() - t1
        plan.metrics["step/version"] = float(self.version)
        return plan.metrics

    # The two halves of a step, for a value model on its own ranks (learner.value_on_separate_ranks): the value
    # job runs critic_step, hands the advantages to the policy job (learner/value_job.py's bridge), which runs
    # policy_step on the same trajectories. Both split them over data-parallel ranks the same way.

    def critic_step(
        self,
        trajectories: Sequence[Trajectory],
        publish: Callable[[dict[str, np.ndarray]], None] | None = None,
        update_version: bool = True,
    ) -> dict[str, float]:
        """Value job: advantages from the values before this step, then K critic updates.

        `publish(advantages_by_id)` is called on every rank right after the advantages exist and before the
        critic updates, so the policy job can update while the critic trains: float32 [T - 1] per trajectory
        (shifted layout), filled on the ranks that hold them (last stage, TP rank 0), {} elsewhere.
        `update_version=False` (value pre-training): no policy step follows, the version stays.
        """
        if self.value is None:
            raise ValueError("critic_step needs the value role on this learner (roles={'value'} and algo.name=sao)")
        plan = self._plan(trajectories)
        if plan is None or isinstance(plan, dict):
            if publish is not None:
                publish({})
            return plan or {}
        self._critic_updates(plan, publish)
        self.version += int(update_version)
        plan.metrics["step/version"] = float(self.version)
        return plan.metrics

    def policy_step(self, trajectories: Sequence[Trajectory], advantages: dict[str, np.ndarray]) -> dict[str, float]:
        """Policy job: one policy update with advantages computed by the value job (by trajectory id; every rank
        of the last pipeline stage needs those of its data-parallel shard: learner/value_job.py gives every rank all
        of them)."""
        if self.policy is None:
            raise ValueError("policy_step needs the policy role on this learner (roles={'policy'})")
        plan = self._plan(trajectories)
        if plan is None or isinstance(plan, dict):
            return plan or {}
        adv = torch.zeros_like(plan.batch.rollout_logprobs)
        if self.layout.is_last_stage():  # every TP rank of the last stage computes the loss
            for row, traj_id in enumerate(plan.batch.trajectory_ids):
                if traj_id not in advantages:
                    raise ValueError(f"no advantages for trajectory {traj_id}: the value job did not send them")
                values = torch.from_numpy(np.asarray(advantages[traj_id], dtype=np.float32))
                if values.numel() != plan.batch.lengths[row]:
                    raise ValueError(f"advantages of {traj_id} have {values.numel()} positions, expected "
                                     f"{plan.batch.lengths[row]}")  # fmt: skip
                adv[row, : values.numel()] = values
        self._policy_update(plan, adv)
        plan.metrics["step/version"] = float(self.version)
        return plan.metrics

    def _plan(self, trajectories: Sequence[Trajectory]) -> StepPlan | dict[str, float] | None:
        """Shard, tensorize and pack; returns the step's metrics alone when it has nothing to train on."""
        if not trajectories:
            raise ValueError("a learner step needs at least one trajectory")
        layout = self.layout
        trajectories, invalid = self._trainable(trajectories)
        if not trajectories:
            return {"step/invalid_trajectories": float(invalid), "step/skipped": 1.0}
        seq_adv = self._sequence_advantages(trajectories)
        shards = shard_for_data_parallel([t.header.num_tokens for t in trajectories], layout.dp)
        mine = shards[layout.dp_rank]
        batch = make_step_batch(select(trajectories, mine), self.cfg.model.max_seq_len, checked=True)
        mbs = self._microbatches(batch)
        total_actions = all_reduce_scalar(batch.num_action_tokens(), group=layout.dp_group)
        metrics: dict[str, float] = {
            "step/trajectories": float(len(trajectories)),
            "step/action_tokens": total_actions,
            "step/microbatches": float(len(mbs)),
            "step/invalid_trajectories": float(invalid),
            **self._staleness(trajectories),
            **self._groups(trajectories),
        }
        if total_actions == 0:
            logger.warning("step skipped: its %d trajectories hold no generated tokens", len(trajectories))
            return {**metrics, "step/skipped": 1.0}
        return StepPlan(len(trajectories), mine, batch, mbs, metrics, seq_adv)

    def _policy_update(self, plan: StepPlan, advantages: torch.Tensor) -> None:
        assert self.policy is not None
        results, ok, grad_norm = policy_update(
            self.policy, plan.mbs, plan.batch, advantages, self.cfg.algo, self.cfg.rollout.sampling.temperature,
            self.spec.vocab_size,
        )  # fmt: skip
        plan.metrics.update(reduce_metrics(results, self.layout))
        plan.metrics.update(self._nonfinite("policy", ok))
        if self.policy.routing is not None:
            mismatched, decisions = self.policy.routing.take_stats()
            mismatched, decisions = all_reduce_scalar(mismatched), all_reduce_scalar(decisions)
            plan.metrics["routing/mismatch_frac"] = mismatched / decisions if decisions else 0.0
            plan.metrics["routing/replayed"] = float(self.policy.routing.replay)
        plan.metrics.update(
            {
                "policy/grad_norm": grad_norm,
                "policy/update_ok": float(ok),
                "policy/lr": self.policy.applied_lr,
                **self._moe_metrics(len(plan.mbs)),
            }
        )
        self.version += 1
        self.trajectories_trained += plan.num_trajectories

    def _critic_updates(
        self, plan: StepPlan, publish: Callable[[dict[str, np.ndarray]], None] | None = None
    ) -> torch.Tensor:
        """values_old, GAE, then K critic updates; returns the policy's advantages [B, L] (zeros off the last
        pipeline stage). `value/explained_variance` is the honest one: the values GAE used, before the critic
        trained on this batch (the one a decision may rest on); `value/explained_variance_post` is measured in the
        last update's forward, after K - 1 updates on the same batch.

        values_old come from the first update's own forward when the critic's targets do not depend on them
        (lambda_critic = 1: returns are reward sums) -- the same numbers a separate forward would give, one pass
        fewer. Not when the advantages go to a policy job that would wait for that update and K = 1 (it could not
        overlap anything then): values_old come first from a forward-only pass, as with lambda_critic < 1."""
        assert self.value is not None
        algo = self.cfg.algo
        k_updates = algo.value.updates_per_policy_step
        batch, mbs, metrics = plan.batch, plan.mbs, plan.metrics
        gae_mask = batch.action_mask if algo.gae.skip_observations else gae_span(batch.action_mask)
        on_last_stage = self.layout.is_last_stage()
        rewards = None
        if on_last_stage:
            rewards = token_rewards(batch.action_mask, batch.rewards, batch.turn_rewards, batch.turn_index)
        fused = algo.gae.lambda_critic == 1.0 and (publish is None or k_updates > 1)
        old_values = torch.zeros_like(batch.rollout_logprobs)
        updates = 0
        if fused:
            returns = _reward_sums(rewards, gae_mask, algo) if rewards is not None else None
            if not self.value_head_fitted:
                self._fit_value_bias(plan, returns, gae_mask)
            self._value_update(plan, returns, old_values, gae_mask, 0, record=True)  # fills old_values
            updates = 1
        else:
            with torch.no_grad():
                collect_values(self.value.ddp, mbs, old_values, self.value.routing)
            if not self.value_head_fitted:
                returns = _reward_sums(rewards, gae_mask, algo) if rewards is not None else None
                self._fit_value_bias(plan, returns, gae_mask)
                with torch.no_grad():
                    collect_values(self.value.ddp, mbs, old_values, self.value.routing)
        advantages = returns = None
        stats: list[dict[str, tuple[float, float]]] = []
        if on_last_stage:
            assert rewards is not None
            moments = functools.partial(_data_parallel_sum, group=self.layout.dp_group)
            targets = compute_step_targets(rewards, old_values, gae_mask, algo, policy_mask=batch.action_mask,
                                           moments=moments)  # fmt: skip
            advantages, returns = targets.advantages, targets.returns
            tokens = float(batch.action_mask.sum())  # gae/*: token-weighted over the ranks that hold outputs
            stats = [{name: (float(v) * tokens, tokens) for name, v in targets.metrics.items()}] if tokens else []
            first = first_action_tokens(batch.action_mask)
            stats.append(ev_totals("value/ev_", old_values, returns, gae_mask))
            stats.append(ev_totals("value/ev_first_", old_values, returns, first))
        holds_outputs = self.layout.holds_outputs
        self.first_values = gather_to_rank0(_first_values(batch, old_values) if holds_outputs else {}) or {}
        reduced = reduce_metrics(stats, self.layout)
        explained_variance(reduced, "value/ev_", "value/explained_variance")
        explained_variance(reduced, "value/ev_first_", "value/explained_variance_first_token")
        metrics.update(reduced)
        if publish is not None:
            by_id = {}
            if advantages is not None and holds_outputs:
                for row, traj_id in enumerate(batch.trajectory_ids):
                    by_id[traj_id] = advantages[row, : batch.lengths[row]].numpy().copy()
            publish(by_id)
        for k in range(updates, k_updates):
            self._value_update(plan, returns, old_values, gae_mask, k)
        metrics["value/updates"] = float(k_updates)
        metrics["value/lr"] = self.value.applied_lr
        if self.value.routing is not None:  # learner.critic_routing_replay: its frozen router against the engine's
            mismatched, decisions = self.value.routing.take_stats()
            mismatched, decisions = all_reduce_scalar(mismatched), all_reduce_scalar(decisions)
            metrics["routing/critic_mismatch_frac"] = mismatched / decisions if decisions else 0.0
        return advantages if advantages is not None else torch.zeros_like(old_values)

    def _value_update(
        self, plan: StepPlan, returns: torch.Tensor | None, old_values: torch.Tensor, mask: torch.Tensor, k: int,
        record: bool = False,
    ) -> None:  # fmt: skip
        """Critic update k of the step, its metrics into the plan's (`record`: old_values are this update's own
        forward, written into `old_values`)."""
        assert self.value is not None
        clip = self.cfg.algo.value.clip
        results, ok, grad_norm = value_update(self.value, plan.mbs, plan.batch, returns, old_values, clip,
                                              value_mask=mask, record_values=record)  # fmt: skip
        reduced = explained_variance(reduce_metrics(results, self.layout), "value/ev_",
                                     "value/explained_variance_post")  # fmt: skip
        if k == 0:
            plan.metrics["loss/value_first"] = reduced["loss/value"]
        plan.metrics.update(reduced)
        plan.metrics.update(
            {"value/grad_norm": grad_norm, "value/update_ok": float(ok), **self._nonfinite("value", ok)}
        )

    def _fit_value_bias(self, plan: StepPlan, returns: torch.Tensor | None, mask: torch.Tensor) -> None:
        """Collective, once per critic: a new head (models/value_head.py: zero) predicts 0 everywhere; set its bias
        to the mean critic target of this first batch (token-weighted over `mask`, every data-parallel rank), so
        the critic starts at the best constant instead of an arbitrary one. `returns` exist on the last pipeline
        stage (where the head lives), None elsewhere."""
        assert self.value is not None
        if returns is not None:
            sums = torch.tensor([float(returns[mask].double().sum()), float(mask.sum())], dtype=torch.float64)
            sums = sums.to(_device())
            dist.all_reduce(sums, group=self.layout.dp_group)
            mean = float(sums[0] / sums[1]) if sums[1] > 0 else 0.0
            with torch.no_grad():
                self.value.model.output_layer.bias.fill_(mean)
            if self.layout.is_rank0 or self.layout.holds_outputs:
                logger.info("value head: bias set to %.4f, the mean return of the first batch", mean)
        self.value.reload_main_params()
        self.value_head_fitted = True

    # ------------------------------------------------------------------ helpers

    def _nonfinite(self, role: str, ok: bool) -> dict[str, float]:
        """Count optimizer steps megatron skipped for NaN/Inf gradients; too many in a row is an error."""
        self.nonfinite_total[role] = self.nonfinite_total.get(role, 0) + (not ok)
        self.nonfinite_in_a_row[role] = 0 if ok else self.nonfinite_in_a_row.get(role, 0) + 1
        limit = self.cfg.learner.max_nonfinite_updates
        if self.nonfinite_in_a_row[role] >= limit:
            raise NonFiniteTraining(
                f"{limit} {role} updates in a row had NaN/Inf gradients (learner.max_nonfinite_updates={limit}); the "
                f"{role} weights have not changed since: lower learner.{role}.lr, check the rewards, or resume from "
                "the last checkpoint"
            )
        return {f"{role}/nonfinite_updates": float(self.nonfinite_total[role])}

    def _microbatches(self, batch: StepBatch) -> list[MicroBatch]:
        """Pack this rank's shard; every rank runs as many micro-batches as the busiest one (EP all-to-alls)."""
        budget = self.cfg.learner.max_tokens_per_microbatch
        mine = len(plan_microbatches([int(t.numel()) for t in batch.tokens], budget)) or 1
        count = int(all_reduce_scalar(float(mine), op="max"))
        pad = self.cfg.parallel.tensor
        routing = self.policy.routing if self.policy is not None else None
        layers = tuple(routing.layers) if routing is not None else ()
        k = self.routes.top_k if self.routes is not None else 0
        return pack_microbatches(batch, budget, pad, self.use_thd, min_count=count, route_layers=layers, top_k=k)

    def _trainable(self, trajectories: Sequence[Trajectory]) -> tuple[list[Trajectory], int]:
        """Drop (and log) trajectories the learner cannot train on; one bad episode never stops a step. Every rank
        sees the same list, so every rank drops the same ones."""
        kept: list[Trajectory] = []
        for t in trajectories:
            try:
                check_trainable(t, self.cfg.model.max_seq_len, self.spec.vocab_size)
                if self.routes is not None and t.header.routes != self.routes:
                    raise ValueError(f"trajectory {t.trajectory_id} carries routes {t.header.routes}, the policy "
                                     f"routes as {self.routes}: every trajectory needs the engines' routes of this "
                                     "model (rollout.return_routed_experts on every worker)")  # fmt: skip
            except ValueError as e:
                if self.layout.is_rank0:
                    logger.error("dropping a trajectory: %s", e)
                continue
            kept.append(t)
        return kept, len(trajectories) - len(kept)

    def _sequence_advantages(self, trajectories: Sequence[Trajectory]) -> torch.Tensor | None:
        """Critic-free arms: one advantage per trajectory, computed on the whole step before sharding."""
        rewards = torch.tensor([t.header.reward for t in trajectories], dtype=torch.float32)
        if self.cfg.algo.grouped:
            groups = [f"{t.header.worker_id}/{t.header.prompt_id}" for t in trajectories]
            return grpo_advantages(rewards, groups, normalize_std=self.cfg.algo.grpo.normalize_std)
        if isinstance(self.running_mean, KeyedRunningMeanBaseline):
            key = self.cfg.algo.running_mean.group_by
            return self.running_mean.advantages(rewards, [str(t.header.metadata.get(key)) for t in trajectories])
        if self.running_mean is not None:
            return self.running_mean.advantages(rewards)
        if self.state_values is not None:
            return self.state_values.turn_advantages(rewards.tolist(), [_turn_states(t) for t in trajectories])
        return None

    def _groups(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """Group arms: how many prompt groups the step holds and how many of them are not whole (never expected: the
        run loop takes whole groups only; a partial group's baseline would be wrong)."""
        if not self.cfg.algo.grouped:
            return {}
        sizes: dict[str, int] = {}
        for t in trajectories:
            key = f"{t.header.worker_id}/{t.header.prompt_id}"
            sizes[key] = sizes.get(key, 0) + 1
        g = self.cfg.algo.grpo.group_size
        return {"step/groups": float(len(sizes)), "step/partial_groups": float(sum(n != g for n in sizes.values()))}

    def _staleness(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        oldest = [t.oldest_version() for t in trajectories]
        # never negative: tokens of a version abandoned by a resume from an older checkpoint count as fresh
        lag = np.array([max(self.version - v, 0) for v in oldest if v is not None], dtype=np.float64)
        versions = {int(v) for t in trajectories for v in np.unique(t.weight_versions[t.action_mask])}
        if lag.size == 0:
            return {}
        return {
            "staleness/mean": float(lag.mean()),
            "staleness/min": float(lag.min()),
            "staleness/max": float(lag.max()),
            "staleness/versions_in_step": float(len(versions)),
        }

    def _moe_metrics(self, num_microbatches: int) -> dict[str, float]:
        from megatron.core.transformer.moe.moe_utils import (
            clear_aux_losses_tracker,
            get_moe_layer_wise_logging_tracker,
            reduce_aux_losses_tracker_across_ranks,
        )

        tracker = get_moe_layer_wise_logging_tracker()
        if not tracker:
            return {}
        reduce_aux_losses_tracker_across_ranks()
        out: dict[str, Any] = {}
        for name, entry in tracker.items():
            values = entry["values"].float()
            layers = int((values != 0).sum()) or 1
            out[f"moe/{name}"] = float(values.sum()) / layers / max(num_microbatches, 1)
        clear_aux_losses_tracker()
        return out


def _turn_states(t: Trajectory) -> list[str]:
    """The states the environment named for a trajectory's turns (metadata turn_states: one per turn, comma-separated,
    since metadata values are scalars)."""
    named = t.header.metadata.get("turn_states")
    states = named.split(",") if isinstance(named, str) and named else None
    if states is None or len(states) != len(t.header.turns):
        raise ValueError(f"algo.name=oracle_value needs each trajectory's metadata turn_states, one state per turn; "
                         f"trajectory {t.trajectory_id} has {named!r} for {len(t.header.turns)} turns: use an "
                         "environment that names them (key_chain with hops: fixed and decoys: true)")  # fmt: skip
    return states

"""The SAO learner: a policy and a value model on megatron-core, and the step that trains them on a batch of
finished trajectories.

    values_old = V(trajectories)                         forward only, value model
    A, R = GAE(rewards, values_old; lambda_policy / 1)   algo.compute_step_targets
    K times: value optimizer step on v_loss(V, values_old, R)     K = algo.value.updates_per_policy_step
    once:    policy optimizer step on DIS(logp, logp_rollout, A)
The critic-free arms (grpo, running_mean) replace the first three lines with sequence-level baselines.
Built by the training entry point; checkpointed by learner/checkpoint.py.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_sao.algo import (
    RunningMeanBaseline,
    compute_step_targets,
    grpo_advantages,
    sequence_to_token_advantages,
    token_rewards,
)
from megatron_sao.bus.schema import Trajectory
from megatron_sao.config.tree import SAOConfig
from megatron_sao.learner.batch import StepBatch, make_step_batch, select, shard_for_data_parallel
from megatron_sao.learner.forward import collect_values
from megatron_sao.learner.metrics import all_reduce_scalar, explained_variance, reduce_metrics
from megatron_sao.learner.packing import MicroBatch, pack_microbatches, plan_microbatches
from megatron_sao.learner.roles import RoleModel, build_role
from megatron_sao.learner.step import policy_update, value_update
from megatron_sao.models.builder import ModelSpec, transformer_engine_available
from megatron_sao.models.weights import HFCheckpoint, load_hf_weights

logger = logging.getLogger(__name__)


class Learner:
    """Owns both roles, the policy weight version and the critic-free baselines' state."""

    def __init__(self, cfg: SAOConfig, spec: ModelSpec | None = None) -> None:
        if cfg.learner.value_on_separate_ranks:
            raise ValueError(
                "learner.value_on_separate_ranks=true is not supported yet: policy and value share ranks; set it "
                "to false"
            )
        self.use_thd = transformer_engine_available()
        if cfg.parallel.context > 1 and not self.use_thd:
            raise ValueError("parallel.context > 1 needs Transformer Engine attention (GPU); set parallel.context=1")
        self.cfg = cfg
        self.spec = spec or ModelSpec.from_config(cfg.model)
        learner, algo = cfg.learner, cfg.algo
        self.policy: RoleModel = build_role(
            self.spec, cfg.parallel, "policy", learner.policy, total_steps=learner.max_steps,
            use_distributed_optimizer=learner.use_distributed_optimizer, moe_aux_loss_coeff=learner.moe_aux_loss_coeff,
        )  # fmt: skip
        self.value: RoleModel | None = None
        if algo.uses_critic:
            self.value = build_role(
                self.spec, cfg.parallel, "value", learner.value,
                total_steps=learner.max_steps * algo.value.updates_per_policy_step,
                use_distributed_optimizer=learner.use_distributed_optimizer, seed=learner.seed,
            )  # fmt: skip
        self.hf_dtypes: dict[str, torch.dtype] = {}
        """dtypes of the HF tensors the weights came from (recorded in checkpoints for the reverse conversion)."""
        self.version = 0
        """Policy weight version: the number of policy optimizer steps taken (engines tag tokens with it)."""
        self.trajectories_trained = 0
        self.running_mean = RunningMeanBaseline(algo.running_mean.window) if algo.name == "running_mean" else None
        if dist.get_rank() == 0:
            for role in (self.policy, self.value):
                if role is not None:
                    logger.info(role.report.summary(role.role))

    # ------------------------------------------------------------------ weights

    def load_hf(self, hf_dir: str) -> None:
        """Initialize both models from an HF checkpoint (the value backbone starts from the policy's weights)."""
        hf = HFCheckpoint(hf_dir)
        self.hf_dtypes = {name: hf.dtype(name) for name in hf.names()}
        load_hf_weights(self.policy.model, self.spec, hf, role="policy")
        self.policy.reload_main_params()
        if self.value is not None:
            load_hf_weights(self.value.model, self.spec, hf, role="value")
            self.value.reload_main_params()

    # ------------------------------------------------------------------ the step

    def train_step(self, trajectories: Sequence[Trajectory], update_policy: bool = True) -> dict[str, float]:
        """One SAO step on `trajectories` (the same list on every rank). update_policy=False runs the critic
        only (value pre-training on rollouts of the frozen initial policy). Returns step metrics."""
        if not trajectories:
            raise ValueError("train_step needs at least one trajectory")
        from megatron.core import parallel_state as ps

        algo = self.cfg.algo
        seq_adv = self._sequence_advantages(trajectories)
        shards = shard_for_data_parallel([t.header.num_tokens for t in trajectories], ps.get_data_parallel_world_size())
        mine = shards[ps.get_data_parallel_rank()]
        batch = make_step_batch(select(trajectories, mine), self.cfg.model.max_seq_len)
        mbs = self._microbatches(batch)
        total_actions = all_reduce_scalar(batch.num_action_tokens(), group=ps.get_data_parallel_group())
        metrics: dict[str, float] = {
            "step/trajectories": float(len(trajectories)),
            "step/action_tokens": total_actions,
            "step/microbatches": float(len(mbs)),
            **self._staleness(trajectories),
        }
        if total_actions == 0:
            logger.warning("step skipped: its %d trajectories hold no generated tokens", len(trajectories))
            return {**metrics, "step/skipped": 1.0}
        if self.value is not None:
            advantages = self._critic_updates(batch, mbs, metrics)
        else:
            assert seq_adv is not None
            advantages = sequence_to_token_advantages(seq_adv[mine], batch.action_mask)
        if update_policy:
            results, ok, grad_norm = policy_update(
                self.policy, mbs, batch, advantages, algo, self.cfg.rollout.sampling.temperature, self.spec.vocab_size
            )
            metrics.update(reduce_metrics(results))
            metrics.update(
                {
                    "policy/grad_norm": grad_norm,
                    "policy/update_ok": float(ok),
                    "policy/lr": self.policy.current_lr(),
                    **self._moe_metrics(len(mbs)),
                }
            )
            self.version += 1
            self.trajectories_trained += len(trajectories)
        metrics["step/version"] = float(self.version)
        return metrics

    def _critic_updates(self, batch: StepBatch, mbs: list[MicroBatch], metrics: dict[str, float]) -> torch.Tensor:
        assert self.value is not None
        algo = self.cfg.algo
        old_values = torch.zeros_like(batch.rollout_logprobs)
        with torch.no_grad():
            on_last_stage = collect_values(self.value.ddp, mbs, old_values)
        advantages = returns = None
        if on_last_stage:
            rewards = token_rewards(batch.action_mask, batch.rewards, batch.turn_rewards, batch.turn_index)
            targets = compute_step_targets(rewards, old_values, batch.action_mask, algo)
            advantages, returns = targets.advantages, targets.returns
        for k in range(algo.value.updates_per_policy_step):
            results, ok, grad_norm = value_update(self.value, mbs, batch, returns, old_values, algo.value.clip)
            reduced = explained_variance(reduce_metrics(results))
            if k == 0:
                metrics.update({f"{name}_first": v for name, v in reduced.items() if name.endswith("v_loss")})
            metrics.update(reduced)
            metrics.update({"value/grad_norm": grad_norm, "value/update_ok": float(ok)})
        metrics["value/updates"] = float(algo.value.updates_per_policy_step)
        metrics["value/lr"] = self.value.current_lr()
        return advantages if advantages is not None else torch.zeros_like(old_values)

    # ------------------------------------------------------------------ helpers

    def _microbatches(self, batch: StepBatch) -> list[MicroBatch]:
        """Pack this rank's shard; every rank runs as many micro-batches as the busiest one (EP all-to-alls)."""
        budget = self.cfg.learner.max_tokens_per_microbatch
        mine = len(plan_microbatches([int(t.numel()) for t in batch.tokens], budget)) or 1
        count = int(all_reduce_scalar(float(mine), op="max"))
        pad = self.cfg.parallel.tensor * (2 * self.cfg.parallel.context if self.cfg.parallel.context > 1 else 1)
        return pack_microbatches(batch, budget, pad, self.use_thd, min_count=count)

    def _sequence_advantages(self, trajectories: Sequence[Trajectory]) -> torch.Tensor | None:
        """Critic-free arms: one advantage per trajectory, computed on the whole step before sharding."""
        rewards = torch.tensor([t.header.reward for t in trajectories], dtype=torch.float32)
        if self.cfg.algo.name == "grpo":
            groups = [t.header.prompt_id for t in trajectories]
            return grpo_advantages(rewards, groups, normalize_std=self.cfg.algo.grpo.normalize_std)
        if self.running_mean is not None:
            return self.running_mean.advantages(rewards)
        return None

    def _staleness(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        oldest = [t.oldest_version() for t in trajectories]
        lag = np.array([self.version - v for v in oldest if v is not None], dtype=np.float64)
        versions = {int(v) for t in trajectories for v in np.unique(t.weight_versions[t.action_mask])}
        if lag.size == 0:
            return {}
        return {
            "staleness/mean": float(lag.mean()),
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

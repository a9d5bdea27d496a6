"""The root of the config tree and the checks that span sections. One source of truth for every setting."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from megatron_sao.config.algo import AlgoConfig
from megatron_sao.config.base import Section
from megatron_sao.config.bus import BusConfig
from megatron_sao.config.eval import EvalConfig
from megatron_sao.config.launch import LaunchConfig
from megatron_sao.config.learner import LearnerConfig
from megatron_sao.config.model import ModelConfig
from megatron_sao.config.parallel import ParallelConfig
from megatron_sao.config.roles import Jobs
from megatron_sao.config.rollout import RolloutConfig
from megatron_sao.config.weight_sync import WeightSyncConfig


class SAOConfig(Section):
    """Everything one SAO run needs; `python -m megatron_sao config show FILE` prints the resolved tree."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    bus: BusConfig = Field(default_factory=BusConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)

    @property
    def jobs(self) -> Jobs:
        """Which jobs the run starts and what each holds (config/roles.py): the one answer to whether the critic has
        ranks of its own. Derived on each call, so a config changed in place answers for its current values."""
        return Jobs.of(self.parallel, self.algo, self.learner, self.rollout, self.launch)

    @property
    def engine_model_path(self) -> str | None:
        """The checkpoint the engines serve: rollout.model_path, else model.hf_path."""
        return self.rollout.model_path or self.model.hf_path

    @model_validator(mode="after")
    def _check_across_sections(self) -> SAOConfig:
        if "spool_dir" not in self.bus.model_fields_set:  # unset (an explicit null stays: no spool)
            self.bus.spool_dir = str(Path(self.launch.run_dir) / "spool")
        if "stale_log_dir" not in self.bus.model_fields_set:  # the trajectory ledger reads <run_dir>/stale.jsonl
            self.bus.stale_log_dir = str(self.launch.run_dir)
        self.bus.with_run_keys(self.launch.run_dir)
        self.parallel.check_world_size(self.launch.learner_world_size)
        if self.eval.interval and self.eval.interval % self.weight_sync.interval:
            raise ValueError(
                f"eval.interval={self.eval.interval} is no multiple of weight_sync.interval="
                f"{self.weight_sync.interval}: the engines never hold the versions it names; make it one"
            )
        if self.eval.interval and self.launch.learner_world_size > 1 and self.eval.timeout_s >= 540:
            raise ValueError(f"eval.timeout_s={self.eval.timeout_s:g} with {self.launch.learner_world_size} learner "
                             "ranks: the other ranks wait for rank 0's evaluation inside the next push, whose "
                             "collective timeout is 600 s; set eval.timeout_s below 540")  # fmt: skip
        steps = min(self.learner.save_interval, self.learner.max_steps)  # the last step always checkpoints
        held = self.learner.trajectories_per_step * steps * (self.learner.fallback_checkpoints + 1)
        if held > self.bus.max_uncommitted:  # a producer keeps each trajectory until that many steps are covered
            raise ValueError(
                f"bus.max_uncommitted={self.bus.max_uncommitted} is below what one producer may hold before a "
                f"checkpoint covers it: learner.trajectories_per_step ({self.learner.trajectories_per_step}) x "
                f"min(learner.save_interval, learner.max_steps) ({steps}) x (learner.fallback_checkpoints + 1) "
                f"({self.learner.fallback_checkpoints + 1}) = {held}; its sends would block and the run stall. "
                f"Raise bus.max_uncommitted to at least {held} or lower learner.save_interval"
            )
        if self.launch.gpus_per_node is None:
            needs_gpus = self.rollout.engine == "sglang" or self.weight_sync.backend == "nccl"
            self.launch.gpus_per_node = 8 if needs_gpus else 0
        value_job = self.jobs.value
        if value_job is not None:
            if not self.algo.uses_critic:
                raise ValueError(f"learner.value_on_separate_ranks=true but algo.name={self.algo.name} has no critic; "
                                 "set learner.value_on_separate_ranks=false (or algo.name=sao)")  # fmt: skip
            try:
                value_job.parallel.check_world_size(value_job.world_size)
            except ValueError as e:
                raise ValueError(f"the value job ({value_job.world_size} ranks: launch.value_nproc_per_node x "
                                 f"max(launch.value_nnodes, 1)) with its layout (learner.value_parallel, else "
                                 f"parallel): {e}") from None  # fmt: skip
        hf = self.model.hf_config_dict()
        context = (hf or {}).get("max_position_embeddings")
        if context and self.rollout.max_total_tokens > int(context):
            raise ValueError(
                f"rollout.max_total_tokens={self.rollout.max_total_tokens} exceeds the model's context "
                f"({context} tokens, max_position_embeddings of {self.model.hf_path}/config.json): the "
                "engines refuse a turn that would pass it (SGLang's rule); lower rollout.max_total_tokens"
            )
        if hf is not None and hf.get("num_attention_heads"):
            mla = "kv_lora_rank" in hf  # multi-latent attention: no key/value head groups to split
            kv = None if mla else int(hf.get("num_key_value_heads") or hf["num_attention_heads"])
            self.parallel.check_attention_heads(int(hf["num_attention_heads"]), kv)
        num_experts = self.model.resolved_num_experts()
        if self.learner.routing_replay:
            if hf is not None and not num_experts:
                raise ValueError(f"learner.routing_replay=true but {self.model.hf_path} is a dense model (no routed "
                                 "experts): set learner.routing_replay=false")  # fmt: skip
            self.rollout.return_routed_experts = True
        if self.learner.critic_routing_replay:
            if not self.learner.routing_replay:
                raise ValueError("learner.critic_routing_replay=true needs learner.routing_replay=true (the engines' "
                                 "routes reach the learner only then); set both or neither")  # fmt: skip
            if not self.algo.uses_critic:
                raise ValueError(f"learner.critic_routing_replay=true but algo.name={self.algo.name} has no critic; "
                                 "set learner.critic_routing_replay=false")  # fmt: skip
            if value_job is not None:
                raise ValueError("learner.critic_routing_replay=true with learner.value_on_separate_ranks=true: the "
                                 "value job receives no routes; set one of them false")  # fmt: skip
        layouts = [self.parallel] + ([self.learner.value_parallel] if self.learner.value_parallel else [])
        for layout in layouts[1:]:
            if hf is not None and hf.get("num_attention_heads"):
                layout.check_attention_heads(int(hf["num_attention_heads"]), kv)
        if num_experts is not None:
            for layout in layouts:
                layout.check_num_experts(num_experts)
        if self.algo.grouped and self.learner.trajectories_per_step % self.algo.grpo.group_size:
            n, g = self.learner.trajectories_per_step, self.algo.grpo.group_size
            raise ValueError(
                f"algo.name={self.algo.name} steps on whole groups: learner.trajectories_per_step={n} is not a "
                f"multiple of algo.grpo.group_size={g}; set learner.trajectories_per_step to {max(g, n // g * g)} "
                f"or {(n // g + 1) * g}"
            )
        if self.algo.grouped and self.weight_sync.interval != 1:
            raise ValueError(
                f"algo.name={self.algo.name} generates each batch on the weights of the step before (lockstep): "
                f"weight_sync.interval={self.weight_sync.interval} would stall it; set weight_sync.interval to 1"
            )
        if self.rollout.max_total_tokens > self.model.max_seq_len:
            raise ValueError(
                f"rollout.max_total_tokens={self.rollout.max_total_tokens} exceeds model.max_seq_len="
                f"{self.model.max_seq_len}; the learner could not take such episodes: raise model.max_seq_len "
                f"or lower rollout.max_total_tokens"
            )
        return self

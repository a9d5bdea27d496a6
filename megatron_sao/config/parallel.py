"""`parallel` section: megatron-core model-parallel sizes of the learner. DP is derived from the world size.

Also the layout record both the planner and the runtime hold: `ParallelSizes` (every size of a layout on a number of
ranks), made by `ParallelConfig.sizes`; distributed.DistContext extends it with this rank's place, plan/memory.py's
Layout with the layers of each pipeline stage."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from megatron_sao.config.base import Section


@dataclass(frozen=True)
class ParallelSizes:
    """A learner layout on `world_size` ranks under megatron's sizes (DP derived). The one record of them: the
    runtime's distributed.DistContext and the planner's plan.memory.Layout are both one."""

    world_size: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    vpp: int | None  # virtual pipeline stages per PP rank; None: no interleaving
    sequence_parallel: bool

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the ranks that share one routed expert's shard."""
        return self.world_size // (self.ep * self.etp * self.pp)

    def model_parallel_sizes(self) -> dict[str, int]:
        """The model-parallel sizes a checkpoint records (tp, pp, ep, etp, cp)."""
        return {"tp": self.tp, "pp": self.pp, "ep": self.ep, "etp": self.etp, "cp": self.cp}


class ParallelConfig(Section):
    tensor: int = Field(default=1, ge=1)
    """Tensor-parallel size (TP)."""

    pipeline: int = Field(default=1, ge=1)
    """Pipeline-parallel size (PP)."""

    virtual_pipeline: int | None = Field(default=None, ge=1)
    """Virtual pipeline stages per PP rank (interleaved 1F1B); None disables interleaving."""

    context: int = Field(default=1, ge=1)
    """Context-parallel size (CP)."""

    expert: int = Field(default=1, ge=1)
    """Expert-parallel size (EP). Must divide the routed-expert count."""

    expert_tensor: int | None = Field(default=None, ge=1)
    """Tensor-parallel size inside each expert (ETP); None uses `tensor` (megatron's default)."""

    sequence_parallel: bool | None = None
    """Sequence parallelism; None turns it on whenever tensor > 1 (megatron requires it for MoE + TP)."""

    first_stage_layers: int | None = Field(default=None, ge=1)
    """Transformer layers on the first pipeline stage (uneven PP). None with last_stage_layers None: an even
    split, or a balanced uneven one when `pipeline` does not divide the layer count (see stage_layers)."""

    last_stage_layers: int | None = Field(default=None, ge=1)
    """Transformer layers on the last pipeline stage (uneven PP); see first_stage_layers."""

    @property
    def model_parallel_size(self) -> int:
        """TP * PP * CP: ranks that hold one copy of the dense part of the model."""
        return self.tensor * self.pipeline * self.context

    @property
    def use_sequence_parallel(self) -> bool:
        return self.tensor > 1 if self.sequence_parallel is None else self.sequence_parallel

    @property
    def resolved_expert_tensor(self) -> int:
        return self.tensor if self.expert_tensor is None else self.expert_tensor

    def megatron_sizes(self) -> dict[str, int | None]:
        """The layout under megatron-core's names, as both parallel_state.initialize_model_parallel and
        TransformerConfig take it (the one place they are spelled)."""
        return {
            "tensor_model_parallel_size": self.tensor,
            "pipeline_model_parallel_size": self.pipeline,
            "virtual_pipeline_model_parallel_size": self.virtual_pipeline,
            "context_parallel_size": self.context,
            "expert_model_parallel_size": self.expert,
            "expert_tensor_parallel_size": self.resolved_expert_tensor,
        }

    def sizes(self, world_size: int) -> ParallelSizes:
        """This layout on `world_size` ranks; raises ValueError naming the fix when the sizes do not fit."""
        return ParallelSizes(
            world_size=world_size,
            tp=self.tensor,
            pp=self.pipeline,
            cp=self.context,
            ep=self.expert,
            etp=self.resolved_expert_tensor,
            dp=self.data_parallel_size(world_size),
            vpp=self.virtual_pipeline,
            sequence_parallel=self.use_sequence_parallel,
        )

    def data_parallel_size(self, world_size: int) -> int:
        """DP for `world_size` ranks; raises ValueError naming the fix when the sizes do not fit."""
        self.check_world_size(world_size)
        return world_size // self.model_parallel_size

    def check_world_size(self, world_size: int) -> None:
        """The one place that says whether `world_size` ranks can hold this layout."""
        mp = self.model_parallel_size
        if world_size % mp:
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.tensor * parallel.pipeline * "
                f"parallel.context = {self.tensor}*{self.pipeline}*{self.context} = {mp}; "
                f"choose sizes whose product divides {world_size}, or change the number of learner ranks "
                f"(launch.nnodes * launch.nproc_per_node)"
            )
        expert_mp = self.expert * self.resolved_expert_tensor * self.pipeline
        if world_size % expert_mp:
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.expert * parallel.expert_tensor * "
                f"parallel.pipeline = {self.expert}*{self.resolved_expert_tensor}*{self.pipeline} = {expert_mp}; "
                f"lower parallel.expert or parallel.expert_tensor"
            )
        if self.sequence_parallel and self.tensor == 1:
            raise ValueError("parallel.sequence_parallel=true needs parallel.tensor > 1; set it to null or false")

    def stage_layers(self, num_layers: int) -> tuple[int | None, int | None]:
        """(layers on the first stage, layers on the last stage) for megatron's uneven pipeline split, or
        (None, None) for an even split. Unset and `pipeline` not dividing `num_layers`: the middle stages get
        m = ceil(L / PP) layers each and the first and last stage share the rest (each at most m: they also hold
        the embedding and the loss), e.g. GLM-5's 78 layers on PP=8 -> 9, 6 x 10, 9. Raises ValueError naming
        the fields when no split fits."""
        pp = self.pipeline
        first, last = self.first_stage_layers, self.last_stage_layers
        if pp == 1:
            if first is not None or last is not None:
                raise ValueError("parallel.first_stage_layers / last_stage_layers need parallel.pipeline > 1")
            return None, None
        if first is None and last is None:
            if num_layers % pp == 0:
                return None, None
            for middle in range(-(-num_layers // pp), num_layers):
                rest = num_layers - (pp - 2) * middle
                first, last = rest // 2, rest - rest // 2
                if first >= 1 and last <= middle:
                    return first, last
            raise ValueError(
                f"{num_layers} layers cannot be split over parallel.pipeline={pp} stages; lower parallel.pipeline"
            )
        middle_layers = num_layers - (first or 0) - (last or 0)
        middle_stages = pp - (first is not None) - (last is not None)
        if (
            middle_layers < 0
            or bool(middle_layers) != bool(middle_stages)
            or (middle_stages and middle_layers % middle_stages)
        ):
            raise ValueError(
                f"parallel.first_stage_layers={first} / last_stage_layers={last} leave {middle_layers} of the "
                f"model's {num_layers} layers for {middle_stages} other pipeline stage(s); they must divide evenly "
                f"(or unset both for an automatic split)"
            )
        return first, last

    def check_attention_heads(self, heads: int, kv_heads: int | None) -> None:
        """Tensor parallelism splits attention heads and, for GQA, the key/value heads: both must divide by it."""
        for name, n in (("attention heads (num_attention_heads)", heads), ("key/value heads (num_key_value_heads)",
                                                                          kv_heads)):  # fmt: skip
            if n is not None and n % self.tensor:
                fits = [d for d in range(1, n + 1) if n % d == 0]
                raise ValueError(f"parallel.tensor={self.tensor} does not divide the model's {n} {name}; use one of "
                                 f"{fits}")  # fmt: skip

    def check_num_experts(self, num_experts: int) -> None:
        """`num_experts`: the model's routed experts (0: a dense model, which takes no expert parallelism)."""
        if not num_experts:
            if self.expert > 1 or self.expert_tensor not in (None, 1):
                raise ValueError(f"parallel.expert={self.expert} (expert_tensor={self.expert_tensor}): the model is "
                                 "dense (no experts); set parallel.expert 1 and leave parallel.expert_tensor "
                                 "unset")  # fmt: skip
            return
        if num_experts % self.expert:
            divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
            raise ValueError(
                f"parallel.expert={self.expert} does not divide the model's {num_experts} routed experts; "
                f"use one of {divisors[:12]}"
            )

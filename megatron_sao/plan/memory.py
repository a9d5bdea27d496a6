"""Bytes per GPU: the learner's policy and critic on each pipeline stage (parameters, gradients, distributed
optimizer state, activations of the micro-batches in flight, weight-sync staging) and an SGLang engine's weights
and KV cache. Accounting follows megatron-core's mixed precision: bf16 parameters, fp32 gradient buffers
(learner/roles.py: grad_reduce_in_fp32), fp32 main parameters and two Adam moments sharded over data-parallel
ranks (expert-data-parallel ranks for routed experts). tests/plan/test_memory.py checks it against a tiny model's
measured tensors on CPU."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from megatron_sao.config.parallel import ParallelConfig, ParallelSizes
from megatron_sao.models.builder import Role
from megatron_sao.plan.tensors import Architecture, TensorSpec, model_tensors

GB = 1e9


@dataclass(frozen=True)
class Layout(ParallelSizes):
    """The learner's parallel layout on `world_size` ranks: the sizes the runtime's distributed.DistContext holds too
    (config.parallel.ParallelSizes, one record for both) and the transformer layers of each pipeline stage."""

    stage_layers: tuple[int, ...] = ()

    @classmethod
    def of(cls, parallel: ParallelConfig, world: int, num_layers: int) -> Layout:
        """Raises ValueError naming the field when the sizes do not fit (ParallelConfig's own checks)."""
        sizes = parallel.sizes(world)
        first, last = parallel.stage_layers(num_layers)
        pp = parallel.pipeline
        if first is None and last is None:
            layers = (num_layers // pp,) * pp
        else:
            ends = (first is not None) + (last is not None)
            middle = (num_layers - (first or 0) - (last or 0)) // max(pp - ends, 1)
            layers = tuple([first or middle] + [middle] * (pp - 2) + [last or middle]) if pp > 1 else (num_layers,)
        return cls(**{f.name: getattr(sizes, f.name) for f in fields(ParallelSizes)}, stage_layers=layers)

    def stage_range(self, stage: int) -> range:
        start = sum(self.stage_layers[:stage])
        return range(start, start + self.stage_layers[stage])


def stage_tensors(tensors: list[TensorSpec], layout: Layout, stage: int, tied_policy: bool) -> list[TensorSpec]:
    """The tensors pipeline stage `stage` holds (a tied output layer keeps its own copy of the embedding on the
    last stage when PP > 1, as megatron does)."""
    layers, last = layout.stage_range(stage), layout.pp - 1
    out = []
    for t in tensors:
        if t.layer is not None:
            keep = t.layer in layers
        elif t.name.startswith("embedding."):
            keep = stage == 0 or (tied_policy and stage == last)
        else:
            keep = stage == last
        if keep:
            out.append(t)
    return out


def local_numel(t: TensorSpec, layout: Layout, ep_rank: int = 0, num_experts: int = 0) -> int:
    """Elements of `t` on one rank (EP rank `ep_rank`)."""
    if t.split == "tensor":
        return t.numel // layout.tp
    if t.split == "expert":
        per_rank = num_experts // layout.ep
        mine = ep_rank * per_rank <= (t.expert or 0) < (ep_rank + 1) * per_rank
        return t.numel // layout.etp if mine else 0
    return t.numel


@dataclass
class RoleMemory:
    """One role's bytes on one GPU of one pipeline stage."""

    role: Role
    params: int = 0
    trainable_dense: int = 0
    trainable_expert: int = 0
    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: Activations | None = None

    @property
    def static(self) -> float:
        return self.weights + self.grads + self.optimizer


def role_memory(arch: Architecture, role: Role, layout: Layout, stage: int, *, dtype: str, distributed_optimizer: bool,
                tokens: int, recompute: str = "none", flash_attention: bool = True,
                te_layout: bool = True, microbatches: int | None = None,
                tensors: list[TensorSpec] | None = None) -> RoleMemory:  # fmt: skip
    """`tokens`: the largest packed micro-batch; `microbatches`: the most one step runs per rank (None: enough to
    fill the pipeline); `tensors`: the role's model_tensors when the caller has them already."""
    if tensors is None:
        tensors = model_tensors(arch, role, tensor_parallel=layout.tp, te_layout=te_layout)
    held = stage_tensors(tensors, layout, stage, tied_policy=arch.tied and role == "policy")
    mem = RoleMemory(role)
    buffers = 0
    for t in held:
        n = local_numel(t, layout, 0, arch.experts)
        if t.buffer:
            buffers += n
            continue
        mem.params += n
        if t.trainable(role):
            if t.split == "expert":
                mem.trainable_expert += n
            else:
                mem.trainable_dense += n
    param_bytes = 2 if dtype == "bf16" else 4
    state_bytes = 12 if dtype == "bf16" else 8  # fp32 main copy (bf16 only) + Adam's two moments
    trainable = mem.trainable_dense + mem.trainable_expert
    mem.weights = mem.params * param_bytes + buffers * 4
    mem.grads = trainable * 4
    dp, edp = (layout.dp, layout.edp) if distributed_optimizer else (1, 1)
    mem.optimizer = state_bytes * (mem.trainable_dense / dp + mem.trainable_expert / edp)
    mem.activations = activation_bytes(arch, role, layout, stage, tokens=tokens, dtype=dtype, recompute=recompute,
                                       flash_attention=flash_attention, microbatches=microbatches)  # fmt: skip
    return mem


def in_flight_microbatches(layout: Layout, stage: int, microbatches: int | None = None) -> float:
    """Micro-batches whose activations a stage holds at once under 1F1B: PP - stage (the first stage the most), or
    all of the step's when it has fewer; interleaving adds megatron's (PP-1)/(PP*VP) penalty."""
    base = layout.pp - stage if microbatches is None else min(layout.pp - stage, microbatches)
    if layout.vpp:
        base *= 1 + (layout.pp - 1) / (layout.pp * layout.vpp)
    return base


def layer_activation_elems(arch: Architecture, layer: int, layout: Layout, tokens: int, flash_attention: bool,
                           act_bytes: int, attention: bool = True) -> float:  # fmt: skip
    """Activation elements one decoder layer keeps for backward on one rank, per micro-batch of `tokens` tokens
    (sequence parallel: the hidden-sized ones are split over TP; attention and expert internals always are).
    attention=False: the layer's attention keeps nothing (the critic's first layer: nothing below it trains, so
    autograd saves nothing for its frozen attention)."""
    s = tokens / layout.cp
    sp = layout.tp if layout.sequence_parallel else 1
    tp, h = layout.tp, arch.hidden
    fp32 = 4 / act_bytes  # an fp32 tensor in units of the activation dtype
    per_token = 2 * h / sp  # the input norm's input and the attention's input (the norm's output)
    if not attention:
        per_token = 0.0
    elif arch.mla is None:
        q, kv = arch.heads * arch.head_dim / tp, arch.kv_heads * arch.head_dim / tp
        per_token += q + 2 * kv  # linear_qkv's output
        per_token += (q + kv) * (2 if arch.qk_norm else 1)  # q/k norms' inputs; rotated q, k
        per_token += kv + 2 * q  # v; the attention output; linear_proj's input
        heads = arch.heads / tp
    else:
        m = arch.mla
        q_head = m["qk_head_dim"] + m["qk_pos_emb_head_dim"]
        heads = arch.heads / tp
        latent = m["q_lora_rank"] + m["kv_lora_rank"] + m["qk_pos_emb_head_dim"]
        per_token += 2 * latent  # the down-projections' outputs and the latent norms' outputs
        per_token += heads * q_head * 2  # q before and after RoPE
        per_token += heads * (m["qk_head_dim"] + m["v_head_dim"])  # kv up-projection output
        per_token += heads * q_head + heads * m["v_head_dim"]  # k (with the shared rope part), v
        per_token += 2 * heads * m["v_head_dim"]  # the attention output; linear_proj's input
    if not attention:
        pass
    elif flash_attention:
        per_token += heads * fp32  # softmax log-sum-exp
    else:
        per_token += heads * s  # the unfused softmax's probabilities (kept for both of its backward matmuls)
    per_token += 2 * h / sp  # pre-MLP norm's input and the MLP's input
    if arch.moe_layers[layer]:
        per_token += h / sp * fp32 + arch.experts / sp * fp32 * 3  # fp32 router input, logits, scores, probs
        routed = arch.topk * (2 * h + 3 * arch.moe_ffn / layout.etp) / sp  # per routed copy: in, fc1 out, act, out
        per_token += routed + arch.topk / sp * fp32  # the routing weights of each copy
        if arch.shared_ffn:
            per_token += h / sp + 3 * arch.shared_ffn / tp
    else:
        per_token += 3 * arch.ffn / tp  # linear_fc1's output (gate and up), the activation's output
    return per_token * s


@dataclass(frozen=True)
class Activations:
    saved: float
    """Bytes autograd holds for backward when the forward of the in-flight micro-batches is done."""
    transient: float
    """Bytes that live for a moment on top: the logits in the compute dtype and their gradient (policy), one layer's
    recomputed activations during its backward (full recompute)."""

    @property
    def peak(self) -> float:
        return self.saved + self.transient


def activation_bytes(arch: Architecture, role: Role, layout: Layout, stage: int, *, tokens: int, dtype: str,
                     recompute: str = "none", flash_attention: bool = True,
                     microbatches: int | None = None) -> Activations:  # fmt: skip
    """Activations of one stage during a role's forward + backward: the in-flight micro-batches' saved tensors
    (the embedding output on the first stage, the fp32 softmax of the logits on the last) and what lives briefly."""
    act = 2 if dtype == "bf16" else 4
    sp = layout.tp if layout.sequence_parallel else 1
    s = tokens / layout.cp
    layers = layout.stage_range(stage)
    per_layer = [layer_activation_elems(arch, i, layout, tokens, flash_attention, act,
                                        attention=not (role == "value" and i == 0)) for i in layers]  # fmt: skip
    transient = 0.0
    if recompute == "full":  # only each layer's input is kept; one layer's activations live during its backward
        kept = len(layers) * s * arch.hidden / sp
        transient += max(per_layer) * act
    else:
        kept = sum(per_layer)
    saved = kept * in_flight_microbatches(layout, stage, microbatches) * act
    if stage == layout.pp - 1:
        saved += s * arch.hidden / sp * act * 2  # the final norm's input and the output layer's input
        if role == "policy":  # the fp32 softmax of vocab-parallel cross-entropy; the logits and their gradient
            vocab = -(-arch.vocab // 128) * 128 / layout.tp
            saved += s * vocab * 4
            transient += s * vocab * (act + 4)
    return Activations(saved=saved, transient=transient)


@dataclass
class EngineMemory:
    """One SGLang engine GPU."""

    weights: float
    kv_bytes_per_token: float
    pool: float
    """mem_fraction_static x GPU memory - weights: what SGLang gives the KV cache."""
    demand_tokens: int
    """concurrency per engine x max_total_tokens: every in-flight episode at full length."""
    notes: list[str] = field(default_factory=list)

    @property
    def capacity_tokens(self) -> float:
        return max(self.pool, 0.0) / self.kv_bytes_per_token


def engine_memory(arch: Architecture, *, tp: int, gpu_mem: float, mem_fraction: float, concurrency: int,
                  max_total_tokens: int, weight_bytes: int = 2, kv_bytes: int = 2) -> EngineMemory:  # fmt: skip
    """Weights split over the engine's TP GPUs (routed experts over EP inside them: the same share); the KV cache
    per token: GQA's K and V of the KV heads a GPU holds (replicated when TP exceeds them), MLA's compressed latent
    (the same on every TP GPU) plus the DSA indexer's fp8 keys."""
    from megatron_sao.plan.tensors import hf_counts

    counts = hf_counts(arch)
    weights = counts.total * weight_bytes / tp
    layers = arch.num_layers
    if arch.mla is None:
        kv_heads = -(-arch.kv_heads // tp)
        per_token = 2 * layers * kv_heads * arch.head_dim * kv_bytes
    else:
        per_token = layers * (arch.mla["kv_lora_rank"] + arch.mla["qk_pos_emb_head_dim"]) * kv_bytes
        if arch.indexer:
            per_token += layers * (arch.indexer["index_head_dim"] + 4)  # fp8 key and its fp32 scale
    pool = mem_fraction * gpu_mem - weights
    return EngineMemory(weights=weights, kv_bytes_per_token=per_token, pool=pool,
                        demand_tokens=concurrency * max_total_tokens)  # fmt: skip

"""Every megatron tensor of a model, from its architecture alone: canonical name, full shape, how megatron splits
it over ranks, and which pipeline stage holds it. The planner counts parameters, bytes and shards from this table.

The architecture is what the family turns config.json into (`ModelFamily.architecture`, the same keyword
arguments the builder hands megatron's TransformerConfig), so the table follows the built model without building
it; tests/plan/test_tensors.py checks it name by name and rank by rank against real megatron models.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from megatron_sao.models.builder import ModelSpec, Role, padded_vocab_size

Split = Literal["replicated", "tensor", "expert"]
"""replicated: every TP rank holds it whole (norms, router, MLA down-projections under TE); tensor: divided over
TP (row or column parallel, vocab-parallel embeddings); expert: one routed expert's tensor, divided over ETP,
the experts spread over EP."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    """Canonical megatron name (models/mapping.py: global layer and expert indices)."""
    shape: tuple[int, ...]
    split: Split
    layer: int | None
    """Decoder layer; None: the embedding (first stage) or final norm / output layer (last stage)."""
    expert: int | None = None
    trainable_in_critic: bool = True
    buffer: bool = False
    """A buffer, not a parameter (the router's expert bias: fp32, updated by its own rule, never by Adam)."""

    def trainable(self, role: Role) -> bool:
        return not self.buffer and (role == "policy" or self.trainable_in_critic)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Architecture:
    """The numbers the tables are built from (a view of the family's TransformerConfig arguments)."""

    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    moe_layers: tuple[int, ...]
    """1 per MoE layer, 0 per dense layer."""
    experts: int
    topk: int
    moe_ffn: int
    shared_ffn: int
    qkv_bias: bool
    qk_norm: bool
    expert_bias: bool
    mla: dict[str, int] | None
    """q_lora_rank (0: no q LoRA), kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim."""
    indexer: dict[str, int] | None = None
    """The DSA indexer (GLM-5): engines run it, the dense-MLA learner does not build it. index_n_heads,
    index_head_dim, q_lora_rank."""

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> Architecture:
        arch: dict[str, Any] = spec.family.architecture(spec.hf)
        layers = int(arch["num_layers"])
        heads = int(arch["num_attention_heads"])
        freq = arch.get("moe_layer_freq") or [0] * layers
        mla = None
        if spec.family.multi_latent_attention:
            mla = {k: int(arch.get(k) or 0) for k in ("q_lora_rank", "kv_lora_rank", "qk_head_dim",
                                                     "qk_pos_emb_head_dim", "v_head_dim")}  # fmt: skip
        indexer = None
        if spec.hf.get("index_n_heads"):
            indexer = {"index_n_heads": int(spec.hf["index_n_heads"]), "index_head_dim": int(spec.hf["index_head_dim"]),
                       "q_lora_rank": int(spec.hf.get("q_lora_rank") or 0)}  # fmt: skip
        return cls(
            num_layers=layers,
            hidden=int(arch["hidden_size"]),
            heads=heads,
            kv_heads=int(arch.get("num_query_groups") or heads),
            head_dim=int(arch.get("kv_channels") or int(arch["hidden_size"]) // heads),
            ffn=int(arch["ffn_hidden_size"]),
            vocab=spec.vocab_size,
            tied=spec.tie_embeddings,
            moe_layers=tuple(int(x) for x in freq),
            experts=int(arch.get("num_moe_experts") or 0),
            topk=int(arch.get("moe_router_topk") or 0),
            moe_ffn=int(arch.get("moe_ffn_hidden_size") or 0),
            shared_ffn=int(arch.get("moe_shared_expert_intermediate_size") or 0),
            qkv_bias=bool(arch.get("add_qkv_bias")),
            qk_norm=bool(arch.get("qk_layernorm")),
            expert_bias=bool(arch.get("moe_router_enable_expert_bias")),
            mla=mla,
            indexer=indexer,
        )


def model_tensors(arch: Architecture, role: Role = "policy", *, tensor_parallel: int = 1,
                  te_layout: bool = True) -> list[TensorSpec]:  # fmt: skip
    """The model's tensors as megatron builds them. `te_layout`: Transformer Engine specs (GPU bf16), whose MLA
    down-projections are duplicated over TP; the local spec (CPU) splits them like any column-parallel linear."""
    h = arch.hidden
    out = [TensorSpec("embedding.word_embeddings.weight", (padded_vocab_size(arch.vocab, tensor_parallel), h),
                      "tensor", None, trainable_in_critic=False)]  # fmt: skip
    for layer in range(arch.num_layers):
        out += _layer(arch, layer, te_layout)
    out.append(TensorSpec("decoder.final_layernorm.weight", (h,), "replicated", None, trainable_in_critic=False))
    if role == "value":
        out += [TensorSpec("output_layer.weight", (1, h), "replicated", None),
                TensorSpec("output_layer.bias", (1,), "replicated", None)]  # fmt: skip
    elif not arch.tied:
        out.append(TensorSpec("output_layer.weight", (padded_vocab_size(arch.vocab, tensor_parallel), h), "tensor",
                              None))  # fmt: skip
    return out


def _layer(arch: Architecture, layer: int, te_layout: bool) -> Iterator[TensorSpec]:
    """One decoder layer. The critic trains the MLPs (learner.value.trainable's default); attention, norms and the
    router are frozen."""
    h, p = arch.hidden, f"decoder.layers.{layer}"

    def frozen(name: str, shape: tuple[int, ...], split: Split) -> TensorSpec:
        return TensorSpec(f"{p}.{name}", shape, split, layer, trainable_in_critic=False)

    def mlp(name: str, shape: tuple[int, ...], split: Split, expert: int | None = None) -> TensorSpec:
        return TensorSpec(f"{p}.{name}", shape, split, layer, expert)

    yield frozen("input_layernorm.weight", (h,), "replicated")
    if arch.mla is None:
        d = arch.head_dim
        yield frozen("self_attention.linear_qkv.weight", ((arch.heads + 2 * arch.kv_heads) * d, h), "tensor")
        if arch.qkv_bias:
            yield frozen("self_attention.linear_qkv.bias", ((arch.heads + 2 * arch.kv_heads) * d,), "tensor")
        if arch.qk_norm:
            yield frozen("self_attention.q_layernorm.weight", (d,), "replicated")
            yield frozen("self_attention.k_layernorm.weight", (d,), "replicated")
        yield frozen("self_attention.linear_proj.weight", (h, arch.heads * d), "tensor")
    else:
        m = arch.mla
        down: Split = "replicated" if te_layout else "tensor"
        q_head = m["qk_head_dim"] + m["qk_pos_emb_head_dim"]
        if m["q_lora_rank"]:
            yield frozen("self_attention.linear_q_down_proj.weight", (m["q_lora_rank"], h), down)
            yield frozen("self_attention.q_layernorm.weight", (m["q_lora_rank"],), "replicated")
            yield frozen("self_attention.linear_q_up_proj.weight", (arch.heads * q_head, m["q_lora_rank"]), "tensor")
        else:
            yield frozen("self_attention.linear_q_proj.weight", (arch.heads * q_head, h), "tensor")
        yield frozen("self_attention.linear_kv_down_proj.weight", (m["kv_lora_rank"] + m["qk_pos_emb_head_dim"], h),
                     down)  # fmt: skip
        yield frozen("self_attention.kv_layernorm.weight", (m["kv_lora_rank"],), "replicated")
        yield frozen("self_attention.linear_kv_up_proj.weight",
                     (arch.heads * (m["qk_head_dim"] + m["v_head_dim"]), m["kv_lora_rank"]), "tensor")  # fmt: skip
        yield frozen("self_attention.linear_proj.weight", (h, arch.heads * m["v_head_dim"]), "tensor")
    yield frozen("pre_mlp_layernorm.weight", (h,), "replicated")
    if not arch.moe_layers[layer]:
        yield mlp("mlp.linear_fc1.weight", (2 * arch.ffn, h), "tensor")
        yield mlp("mlp.linear_fc2.weight", (h, arch.ffn), "tensor")
        return
    yield frozen("mlp.router.weight", (arch.experts, h), "replicated")
    if arch.expert_bias:
        yield TensorSpec(
            f"{p}.mlp.router.expert_bias", (arch.experts,), "replicated", layer, buffer=True, trainable_in_critic=False
        )
    for e in range(arch.experts):
        yield mlp(f"mlp.experts.local_experts.{e}.linear_fc1.weight", (2 * arch.moe_ffn, h), "expert", e)
        yield mlp(f"mlp.experts.local_experts.{e}.linear_fc2.weight", (h, arch.moe_ffn), "expert", e)
    if arch.shared_ffn:
        yield mlp("mlp.shared_experts.linear_fc1.weight", (2 * arch.shared_ffn, h), "tensor")
        yield mlp("mlp.shared_experts.linear_fc2.weight", (h, arch.shared_ffn), "tensor")


@dataclass(frozen=True)
class Counts:
    """Parameters as the HF model card counts them (no vocab padding, one lm_head)."""

    total: int
    active: int
    """Per token: every dense tensor, `topk` of the routed experts."""
    embeddings: int
    routed: int = 0
    """The routed experts' parameters (all of them)."""

    @property
    def active_without_embeddings(self) -> int:
        return self.active - self.embeddings


def hf_counts(arch: Architecture) -> Counts:
    """Parameter counts of the HF checkpoint's network (the DSA indexer included, MTP layers not)."""
    tensors = model_tensors(arch, "policy", te_layout=True)
    h, pad = arch.hidden, padded_vocab_size(arch.vocab, 1) - arch.vocab
    total = routed = 0
    for t in tensors:
        n = t.numel - (pad * h if t.name.startswith(("embedding.", "output_layer.")) else 0)
        total += n
        routed += n if t.split == "expert" else 0
    total += indexer_params(arch) * arch.num_layers
    embeddings = arch.vocab * h * (1 if arch.tied else 2)
    active = total - routed + (routed * arch.topk // arch.experts if arch.experts else 0)
    return Counts(total=total, active=active, embeddings=embeddings, routed=routed)


def indexer_params(arch: Architecture) -> int:
    """One layer's DSA indexer (q up-projection, k projection + its LayerNorm, per-head weights)."""
    if arch.indexer is None:
        return 0
    ix, h = arch.indexer, arch.hidden
    return (ix["index_n_heads"] * ix["index_head_dim"] * ix["q_lora_rank"] + ix["index_head_dim"] * h
            + 2 * ix["index_head_dim"] + ix["index_n_heads"] * h)  # fmt: skip

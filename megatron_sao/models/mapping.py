"""HF <-> megatron weight mapping: the one source of truth for names, shapes and layout transforms.

Three name spaces meet here:
  * HF on-disk names (`model.layers.3.mlp.experts.7.gate_proj.weight`: experts stored per expert);
  * canonical megatron names: local-spec parameter names with *global* layer and expert indices
    (`decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight`);
  * megatron's own names on a rank (PP-local layer numbers, EP-local experts, TE fused-norm and grouped-GEMM
    spellings) and dist-checkpoint keys (layers and experts stacked into leading axes).
Each family module lists its `Rule`s (canonical name <- HF names + a transform); `WeightMapping` expands them
for one config. The conversion tools, the learner's HF loading and the weight sync to engines all use it. A fourth,
transformers' in-memory names (MoE experts fused), is what the embedded engine holds: resolve_in_memory /
on_disk_names at the end relate it to the on-disk names.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

Transform = Literal["copy", "qkv", "glu", "vocab"]
"""copy: same tensor; qkv: q/k/v fused per query group; glu: [gate; up] stacked; vocab: rows padded."""


@dataclass(frozen=True)
class Rule:
    megatron: str
    """Canonical megatron name."""
    hf: tuple[str, ...]
    """HF on-disk names that together make the megatron tensor (order matters for qkv/glu)."""
    transform: Transform = "copy"


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def q_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


# ---------------------------------------------------------------- transforms


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: AttentionShape) -> torch.Tensor:
    """HF q [nh*d, ...], k/v [ng*d, ...] -> megatron linear_qkv [ng*(q_per_group+2)*d, ...], grouped per KV head."""
    ng, d = shape.num_kv_heads, shape.head_dim
    rest = q.shape[1:]
    qg = q.reshape(ng, shape.q_per_group * d, *rest)
    fused = torch.cat([qg, k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)], dim=1)
    return fused.reshape(ng * (shape.q_per_group + 2) * d, *rest)


def split_qkv(qkv: torch.Tensor, shape: AttentionShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ng, d, qpg = shape.num_kv_heads, shape.head_dim, shape.q_per_group
    rest = qkv.shape[1:]
    grouped = qkv.reshape(ng, (qpg + 2) * d, *rest)
    q, k, v = torch.split(grouped, [qpg * d, d, d], dim=1)
    return q.reshape(ng * qpg * d, *rest), k.reshape(ng * d, *rest), v.reshape(ng * d, *rest)


def pad_vocab(t: torch.Tensor, padded_rows: int) -> torch.Tensor:
    if t.shape[0] > padded_rows:
        raise ValueError(f"vocab tensor has {t.shape[0]} rows, more than megatron's {padded_rows}")
    if t.shape[0] == padded_rows:
        return t
    return torch.cat([t, t.new_zeros(padded_rows - t.shape[0], *t.shape[1:])], dim=0)


# ---------------------------------------------------------------- rules shared by the families


def embedding_rules(tied: bool) -> list[Rule]:
    rules = [
        Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
        Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    ]
    if not tied:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), "vocab"))
    return rules


def norm_rules(layer: int) -> list[Rule]:
    m, h = f"decoder.layers.{layer}", f"model.layers.{layer}"
    return [
        Rule(f"{m}.input_layernorm.weight", (f"{h}.input_layernorm.weight",)),
        Rule(f"{m}.pre_mlp_layernorm.weight", (f"{h}.post_attention_layernorm.weight",)),
    ]


def gqa_attention_rules(layer: int, qkv_bias: bool, qk_norm: bool) -> list[Rule]:
    m, h = f"decoder.layers.{layer}.self_attention", f"model.layers.{layer}.self_attn"
    rules = [
        Rule(f"{m}.linear_qkv.weight", (f"{h}.q_proj.weight", f"{h}.k_proj.weight", f"{h}.v_proj.weight"), "qkv"),
        Rule(f"{m}.linear_proj.weight", (f"{h}.o_proj.weight",)),
    ]
    if qkv_bias:
        rules.append(Rule(f"{m}.linear_qkv.bias", (f"{h}.q_proj.bias", f"{h}.k_proj.bias", f"{h}.v_proj.bias"), "qkv"))
    if qk_norm:
        rules += [
            Rule(f"{m}.q_layernorm.weight", (f"{h}.q_norm.weight",)),
            Rule(f"{m}.k_layernorm.weight", (f"{h}.k_norm.weight",)),
        ]
    return rules


def mla_attention_rules(layer: int, q_lora: bool) -> list[Rule]:
    """DeepSeek-style MLA. megatron's q/kv up-projections keep HF's per-head [nope | rope] and [nope | v] order,
    and megatron de-interleaves the rope dims for MLA exactly as transformers' interleaved RoPE does."""
    m, h = f"decoder.layers.{layer}.self_attention", f"model.layers.{layer}.self_attn"
    rules = [
        Rule(f"{m}.linear_kv_down_proj.weight", (f"{h}.kv_a_proj_with_mqa.weight",)),
        Rule(f"{m}.kv_layernorm.weight", (f"{h}.kv_a_layernorm.weight",)),
        Rule(f"{m}.linear_kv_up_proj.weight", (f"{h}.kv_b_proj.weight",)),
        Rule(f"{m}.linear_proj.weight", (f"{h}.o_proj.weight",)),
    ]
    if q_lora:
        rules += [
            Rule(f"{m}.linear_q_down_proj.weight", (f"{h}.q_a_proj.weight",)),
            Rule(f"{m}.q_layernorm.weight", (f"{h}.q_a_layernorm.weight",)),
            Rule(f"{m}.linear_q_up_proj.weight", (f"{h}.q_b_proj.weight",)),
        ]
    else:
        rules.append(Rule(f"{m}.linear_q_proj.weight", (f"{h}.q_proj.weight",)))
    return rules


def dense_mlp_rules(layer: int) -> list[Rule]:
    m, h = f"decoder.layers.{layer}.mlp", f"model.layers.{layer}.mlp"
    return [
        Rule(f"{m}.linear_fc1.weight", (f"{h}.gate_proj.weight", f"{h}.up_proj.weight"), "glu"),
        Rule(f"{m}.linear_fc2.weight", (f"{h}.down_proj.weight",)),
    ]


def moe_mlp_rules(layer: int, num_experts: int, shared_experts: bool, expert_bias: bool) -> list[Rule]:
    m, h = f"decoder.layers.{layer}.mlp", f"model.layers.{layer}.mlp"
    rules = [Rule(f"{m}.router.weight", (f"{h}.gate.weight",))]
    if expert_bias:
        rules.append(Rule(f"{m}.router.expert_bias", (f"{h}.gate.e_score_correction_bias",)))
    for e in range(num_experts):
        me, he = f"{m}.experts.local_experts.{e}", f"{h}.experts.{e}"
        rules += [
            Rule(f"{me}.linear_fc1.weight", (f"{he}.gate_proj.weight", f"{he}.up_proj.weight"), "glu"),
            Rule(f"{me}.linear_fc2.weight", (f"{he}.down_proj.weight",)),
        ]
    if shared_experts:
        ms, hs = f"{m}.shared_experts", f"{h}.shared_experts"
        rules += [
            Rule(f"{ms}.linear_fc1.weight", (f"{hs}.gate_proj.weight", f"{hs}.up_proj.weight"), "glu"),
            Rule(f"{ms}.linear_fc2.weight", (f"{hs}.down_proj.weight",)),
        ]
    return rules


# ---------------------------------------------------------------- canonical names

# Spellings of the same tensor in the TE spec / dist-checkpoint keys (left) and the canonical local names (right).
_SUFFIX_ALIASES = [
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
    ("self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.q_layernorm.weight"),
    ("self_attention.linear_kv_up_proj.layer_norm_weight", "self_attention.kv_layernorm.weight"),
]
_GROUPED_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.linear_fc([12])\.weight(\d+)$")


def canonical_suffix(rest: str) -> str:
    """Map a TE / checkpoint spelling of a layer-relative name onto the canonical (local-spec) one."""
    for alias, canonical in _SUFFIX_ALIASES:
        if rest == alias:
            return canonical
    return rest


Spec = Literal["canonical", "local", "te"]
_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(.*)$")


def _spec_suffix(rest: str, spec: Spec, moe_layer: bool, mla: bool) -> str:
    """Layer-relative canonical name -> how `spec`'s TransformerLayer.sharded_state_dict() spells it.

    local spec (megatron-core gpt_layer_specs): GQA layers rename both norms to TE's fused spelling through
    `sharded_state_dict_keys_map` (MoE layers too); MLA layers keep the module names. TE spec: the input norm is
    fused into linear_qkv (GQA) and the MLA latent norms into linear_q/kv_up_proj; the pre-MLP norm is fused into
    linear_fc1 in dense layers and a separate module (`pre_mlp_layernorm`) in MoE layers.
    """
    if spec == "canonical":
        return rest
    fused = {
        "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
        "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    }
    if spec == "local":
        return rest if mla else fused.get(rest, rest)
    if mla:
        fused = {
            "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
            "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
            "pre_mlp_layernorm.weight": fused["pre_mlp_layernorm.weight"],
        }
    if moe_layer:
        fused.pop("pre_mlp_layernorm.weight")
    return fused.get(rest, rest)


def checkpoint_key(
    canonical_name: str, spec: Spec = "canonical", *, moe_layer: bool = False, mla: bool = False
) -> tuple[str, tuple[int, ...]]:
    """Canonical name -> (dist-checkpoint key, indices of the leading stacked axes) as `spec` writes it.

    `spec="canonical"` is the project's on-disk key space (models/checkpoint.py writes and reads it): per-layer
    keys with global layer numbers, canonical (local-module) suffix spellings, experts stacked on one leading
    axis under `mlp.experts.experts.` exactly as megatron emits them for SequentialMLP and TE grouped GEMM alike.
    `"local"` / `"te"` give what a model of that spec emits from its own `sharded_state_dict()`; the layer kind
    (`moe_layer`, `mla`) decides the TE / local spellings of the norms. Keys carry no model prefix (`policy.`).
    """
    e = _EXPERT.match(canonical_name)
    if e is not None:
        return f"decoder.layers.{e.group(1)}.mlp.experts.experts.{e.group(3)}", (int(e.group(2)),)
    m = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", canonical_name)
    if m is None:
        return canonical_name, ()
    return f"decoder.layers.{m.group(1)}.{_spec_suffix(m.group(2), spec, moe_layer, mla)}", ()


def canonical_from_checkpoint_key(key: str, prepended: tuple[int, ...]) -> str:
    """Dist-checkpoint key + its leading (stacked) indices -> canonical name.

    Homogeneous blocks stack layers: `decoder.layers.mlp.experts.experts.linear_fc1.weight` with prepended
    (3, 7); heterogeneous ones (dense + MoE layers) name the layer: `decoder.layers.3.mlp.experts.experts.
    linear_fc1.weight` with prepended (7,). Both -> `decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight`.
    """
    explicit = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", key)
    if explicit is not None:
        layer, rest, axes = int(explicit.group(1)), explicit.group(2), list(prepended)
    elif key.startswith("decoder.layers.") and prepended:
        layer, rest, axes = prepended[0], key[len("decoder.layers.") :], list(prepended[1:])
    elif not prepended:
        return key
    else:
        raise ValueError(f"unexpected stacked checkpoint key {key!r} (leading indices {prepended})")
    if rest.startswith("mlp.experts.experts."):
        if len(axes) != 1:
            raise ValueError(f"expert checkpoint key {key!r} needs one expert index, got {axes}")
        return f"decoder.layers.{layer}.mlp.experts.local_experts.{axes[0]}.{rest[len('mlp.experts.experts.') :]}"
    if axes:
        raise ValueError(f"checkpoint key {key!r} has unexpected leading indices {axes}")
    return f"decoder.layers.{layer}.{canonical_suffix(rest)}"


def canonical_from_param_name(name: str, layer_offset: int, expert_offset: int) -> str:
    """A live parameter name on this rank (PP-local layer numbers, EP-local experts, TE spellings) -> canonical."""
    name = name.removeprefix("module.")
    m = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", name)
    if m is None:
        return name
    layer, rest = int(m.group(1)) + layer_offset, m.group(2)
    g = _GROUPED_EXPERT.match(f"x.{rest}")
    if g is not None:
        expert = int(g.group(3)) + expert_offset
        return f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc{g.group(2)}.weight"
    e = re.match(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$", rest)
    if e is not None:
        return f"decoder.layers.{layer}.mlp.experts.local_experts.{int(e.group(1)) + expert_offset}.{e.group(2)}"
    return f"decoder.layers.{layer}.{canonical_suffix(rest)}"


# ---------------------------------------------------------------- one config's mapping


class WeightMapping:
    """The expanded rules of one model config: canonical megatron name <-> HF names, with transforms."""

    def __init__(self, rules: Iterable[Rule], attention: AttentionShape | None, vocab_size: int) -> None:
        self.rules: dict[str, Rule] = {}
        self.hf_to_megatron: dict[str, str] = {}
        for rule in rules:
            if rule.megatron in self.rules:
                raise AssertionError(f"duplicate mapping rule for {rule.megatron}")
            self.rules[rule.megatron] = rule
            for h in rule.hf:
                self.hf_to_megatron[h] = rule.megatron
        self.attention = attention
        self.vocab_size = vocab_size

    def hf_names(self) -> list[str]:
        return list(self.hf_to_megatron)

    def rule(self, megatron_name: str) -> Rule:
        if megatron_name not in self.rules:
            raise KeyError(f"no HF mapping for megatron tensor {megatron_name!r}")
        return self.rules[megatron_name]

    def to_megatron(
        self, megatron_name: str, hf_tensor: Callable[[str], torch.Tensor], padded_vocab: int
    ) -> torch.Tensor:
        """Build the full (unsharded) megatron tensor from HF tensors fetched by name."""
        rule = self.rule(megatron_name)
        parts = [hf_tensor(h) for h in rule.hf]
        if rule.transform == "copy":
            return parts[0]
        if rule.transform == "vocab":
            return pad_vocab(parts[0], padded_vocab)
        if rule.transform == "glu":
            return torch.cat(parts, dim=0)
        assert self.attention is not None, "qkv rule without an attention shape"
        return fuse_qkv(*parts, self.attention)

    def to_hf(self, megatron_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Split a full megatron tensor into its HF tensors (names in rule order)."""
        rule = self.rule(megatron_name)
        if rule.transform == "copy":
            return [(rule.hf[0], tensor)]
        if rule.transform == "vocab":
            return [(rule.hf[0], tensor[: self.vocab_size])]
        if rule.transform == "glu":
            return list(zip(rule.hf, torch.chunk(tensor, 2, dim=0)))
        assert self.attention is not None
        return list(zip(rule.hf, split_qkv(tensor, self.attention)))

    def hf_shapes(self, megatron_name: str, megatron_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """Expected HF shapes of the tensors making up a full megatron tensor of `megatron_shape`."""
        dummy = torch.empty(megatron_shape, device="meta")
        return {name: tuple(t.shape) for name, t in self.to_hf(megatron_name, dummy)}


def attention_shape(hf: dict[str, Any]) -> AttentionShape:
    heads = int(hf["num_attention_heads"])
    return AttentionShape(
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
    )


# ---------------------------------------------------------------- HF on disk <-> transformers in memory
# HF checkpoints store MoE experts one by one (`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`, gate/up
# [I, H], down [H, I]). transformers 5 fuses them in memory: `...mlp.experts.gate_up_proj` [num_experts, 2I, H]
# (gate rows first, then up) and `...mlp.experts.down_proj` [num_experts, H, I]. Every other name is the same on
# disk and in memory. The embedded engine serves a transformers model and receives on-disk names (what the weight
# sync sends, whatever the engine's layout): resolve_in_memory maps one to its tensor and the slice it covers.

_HF_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class Target:
    """Where an on-disk tensor lives in memory: `tensors[key]`, optionally one expert and a row range of it."""

    key: str
    expert: int | None = None
    rows: tuple[int, int] | None = None  # [start, end) along dim 0 of the expert's matrix (gate/up halves)

    def view(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        t = tensors[self.key]
        if self.expert is not None:
            t = t[self.expert]
        if self.rows is not None:
            t = t[self.rows[0] : self.rows[1]]
        return t


def resolve_in_memory(name: str, tensors: dict[str, torch.Tensor]) -> Target:
    """The in-memory Target of on-disk `name`; KeyError (with the name) when the model has no such weight."""
    if name in tensors:
        return Target(name)
    m = _HF_EXPERT.match(name)
    if m is None:
        raise KeyError(name)
    prefix, expert, proj = m["prefix"], int(m["expert"]), m["proj"]
    if proj == "down_proj":
        key = f"{prefix}.down_proj"
        if key not in tensors or expert >= tensors[key].shape[0]:
            raise KeyError(name)
        return Target(key, expert)
    key = f"{prefix}.gate_up_proj"
    if key not in tensors or expert >= tensors[key].shape[0] or tensors[key].shape[1] % 2:
        raise KeyError(name)
    inter = tensors[key].shape[1] // 2
    rows = (0, inter) if proj == "gate_proj" else (inter, 2 * inter)
    return Target(key, expert, rows)


def on_disk_names(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every on-disk name the in-memory tensors cover, with its shape and dtype (the inverse of resolve_in_memory)."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for key, t in tensors.items():
        if key.endswith(".experts.gate_up_proj") and t.ndim == 3:
            prefix, inter = key[: -len(".gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                for proj in ("gate_proj", "up_proj"):
                    out[f"{prefix}.{e}.{proj}.weight"] = ((inter, t.shape[2]), t.dtype)
        elif key.endswith(".experts.down_proj") and t.ndim == 3:
            prefix = key[: -len(".down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = (tuple(t.shape[1:]), t.dtype)
        else:
            out[key] = (tuple(t.shape), t.dtype)
    return out

"""The project's megatron checkpoint format for model weights: one key space whatever the layer spec.

A megatron-core model emits dist-checkpoint keys in its spec's spelling: the local spec names norms after TE's
fused modules in GQA layers (`self_attention.linear_qkv.layer_norm_weight`) but not in MLA layers, and the TE
spec keeps the pre-MLP norm of MoE layers separate (`pre_mlp_layernorm.weight`) — so a checkpoint saved by a TE
model would not load into a local one. Every checkpoint this project writes therefore uses canonical keys:

* `{prefix}{key}` with `prefix` = `policy.` / `value.` (the learner checkpoint holds both models) and `key`
  = `mapping.checkpoint_key(name, "canonical")`: per-layer keys with global layer numbers, canonical suffix
  spellings (`input_layernorm.weight`, `pre_mlp_layernorm.weight`, `self_attention.q_layernorm.weight`, ...),
  experts stacked on one leading axis under `mlp.experts.experts.` as megatron emits them;
* weights only: no `_extra_state` objects (TE's FP8 metadata is not weights) and no optimizer state;
* HF tensors the model does not use (DSA indexer, MTP layers) as replicated tensors `passthrough.<hf name>`;
* a common (non-sharded) entry `hf_source` describing the HF model it came from (`hf_source_record`).

`canonicalize_sharded_keys` rewrites a model's `sharded_state_dict()` into this key space; the learner's
checkpointing, tools/convert_*.py and tools/check_parity.py all go through it (`model_sharded_state_dict`,
`load_model_weights`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from megatron_sao.models.builder import ModelSpec
from megatron_sao.models.mapping import canonical_suffix

POLICY_PREFIX = "policy."
PASSTHROUGH_PREFIX = "passthrough."
HF_SOURCE_KEY = "hf_source"
FORMAT_VERSION = 1

_LAYER_KEY = re.compile(r"^(.*?decoder\.layers\.\d+\.)(.*)$")


class CheckpointMismatchError(ValueError):
    """A megatron checkpoint does not fit the model it is loaded into or converted with; the message says how."""


def canonical_key(key: str) -> str:
    """One dist-checkpoint key (any spec's spelling, any prefix) -> the canonical on-disk key."""
    m = _LAYER_KEY.match(key)
    if m is None:
        return key
    return f"{m.group(1)}{canonical_suffix(m.group(2))}"


def canonicalize_sharded_keys(sharded_sd: dict[str, Any]) -> dict[str, Any]:
    """Rewrite, in place, the checkpoint keys of every ShardedTensor / factory / ShardedObject of a model's
    `sharded_state_dict()` into the canonical key space; returns `sharded_sd`. The dict keys (the model's own
    state-dict names, which `load_state_dict` needs) are left alone. Call it on the state dict passed to both
    `dist_checkpointing.save` and `dist_checkpointing.load`."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    for v in nested_values(sharded_sd):
        if isinstance(v, ShardedTensor | ShardedTensorFactory | ShardedObject):
            v.key = canonical_key(v.key)
    return sharded_sd


_EXTRA_STATE = re.compile(r"\._extra_state\d*$")


def is_extra_state(key: str) -> bool:
    """A module's `_extra_state` entry (TE FP8 metadata; TEGroupedLinear numbers its experts' `_extra_state1`, ...)."""
    return _EXTRA_STATE.search(key) is not None


def drop_extra_state(sharded_sd: dict[str, Any]) -> dict[str, Any]:
    """The weights of a flat model sharded state dict: without the modules' `_extra_state` objects."""
    return {k: v for k, v in sharded_sd.items() if not is_extra_state(k)}


def model_sharded_state_dict(model: Any, prefix: str = POLICY_PREFIX, per_layer: bool = False) -> dict[str, Any]:
    """This rank's weights of `model` as canonical-keyed sharded tensors under `prefix` (save or load these).
    per_layer: one key per decoder layer (`decoder.layers.<i>.…`, megatron's non-homogeneous layout) instead of the
    layers stacked along a leading axis; families with mixed layers (a leading dense layer) are per layer anyway."""
    metadata = {"non_homogeneous_layers": True} if per_layer else None
    return canonicalize_sharded_keys(drop_extra_state(model.sharded_state_dict(prefix=prefix, metadata=metadata)))


# ---------------------------------------------------------------- the record of the HF source


def hf_source_record(spec: ModelSpec, hf_dtypes: dict[str, torch.dtype], tied_lm_head: bool = False) -> dict:
    """What a converted checkpoint says about its HF origin: family, config.json, megatron dtype, and the HF
    tensors' dtypes (the most common one plus the exceptions, e.g. GLM's fp32 router in a bf16 checkpoint), so
    that the reverse conversion restores each tensor's dtype."""
    default = most_common_dtype(hf_dtypes)
    return {
        "format": FORMAT_VERSION,
        "family": spec.family.name,
        "hf_config": dict(spec.hf),
        "dtype": spec.dtype,
        "hf_dtype": dtype_name(default),
        "hf_dtype_exceptions": {n: dtype_name(d) for n, d in sorted(hf_dtypes.items()) if d != default},
        "tied_lm_head": tied_lm_head,
    }


def most_common_dtype(dtypes: dict[str, torch.dtype]) -> torch.dtype:
    counts: dict[torch.dtype, int] = {}
    for d in dtypes.values():
        counts[d] = counts.get(d, 0) + 1
    return max(counts, key=lambda d: counts[d]) if counts else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointMismatchError(f"unknown dtype {name!r} in the checkpoint's {HF_SOURCE_KEY} record")
    return dtype


def read_hf_source(ckpt_dir: str | Path) -> dict | None:
    """The checkpoint's `hf_source` record, or None when it has none (e.g. written by another tool)."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(str(ckpt_dir)).get(HF_SOURCE_KEY)


def check_hf_source(record: dict, spec: ModelSpec, what: str = "the model") -> None:
    """Raise CheckpointMismatchError naming every architecture field where the checkpoint's HF config and
    `spec` (the model it is loaded into / converted with) disagree."""
    if record.get("format") != FORMAT_VERSION:
        raise CheckpointMismatchError(
            f"checkpoint {HF_SOURCE_KEY} format {record.get('format')!r} is not {FORMAT_VERSION}; reconvert it"
        )
    if record["family"] != spec.family.name:
        raise CheckpointMismatchError(
            f"the checkpoint holds a {record['family']} model but {what} is {spec.family.name}; "
            f"use the HF config the checkpoint was converted from"
        )
    theirs, ours = _shape_fields(record["hf_config"], spec), _shape_fields(spec.hf, spec)
    diffs = [f"{k}: checkpoint {theirs.get(k)!r} vs {ours.get(k)!r}" for k in sorted(set(theirs) | set(ours))
             if theirs.get(k) != ours.get(k)]  # fmt: skip
    if diffs:
        raise CheckpointMismatchError(
            f"the checkpoint was converted from a different {spec.family.name} config than {what}: "
            + "; ".join(diffs)
            + ". Point --hf-config (or model.hf_path) at the HF config the checkpoint came from"
        )


def _shape_fields(hf: dict, spec: ModelSpec) -> dict[str, Any]:
    fields = spec.family.architecture(dict(hf))
    fields["vocab_size"] = hf.get("vocab_size")
    fields["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    return fields


# ---------------------------------------------------------------- loading weights into a live model


def load_model_weights(
    model: Any, ckpt_dir: str | Path, prefix: str = POLICY_PREFIX, spec: ModelSpec | None = None
) -> None:
    """Load this rank's shards of `model` (any TP/EP/PP, local or TE spec) from a canonical checkpoint.

    Collective over all ranks. With `spec`, the checkpoint's `hf_source` record (when present) is checked
    against it first. Raises CheckpointMismatchError for missing tensors or a different architecture.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    if spec is not None:
        record = read_hf_source(ckpt_dir)
        if record is not None:
            check_hf_source(record, spec)
    sharded = model_sharded_state_dict(model, prefix)
    try:
        state = dist_checkpointing.load(sharded, str(ckpt_dir))
    except (CheckpointingException, KeyError) as e:
        raise CheckpointMismatchError(f"cannot load {ckpt_dir} into this model ({prefix}*): {e}") from e
    weights = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not is_extra_state(k)]
    if missing or unexpected:
        raise CheckpointMismatchError(f"loading {ckpt_dir}: missing {missing[:8]}, unexpected {unexpected[:8]}")

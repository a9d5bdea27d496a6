"""Moving weights between Hugging Face checkpoints and live megatron-core models (any TP/EP/PP, local or TE spec).

`HFCheckpoint` reads a safetensors directory lazily; `load_hf_weights` fills this rank's shards through the
model's own `sharded_state_dict()` (which knows each shard's global offsets, including the gate/up split of
GLU weights), with names and transforms from models/mapping.py. Used by the learner (initial weights), the
conversion tools and the parity check.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from megatron_sao.models.builder import ModelSpec, Role, padded_vocab_size
from megatron_sao.models.mapping import WeightMapping, attention_shape, canonical_from_checkpoint_key

SAFETENSORS_INDEX = "model.safetensors.index.json"
MAX_OPEN_FILES = 2
"""Shard files kept open (memory-mapped) at once: touched pages of an open mapping count as resident memory, so
streaming readers close the shards they are done with."""

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


class WeightMismatchError(ValueError):
    """A checkpoint tensor is missing, unexpected, or has the wrong shape/dtype; the message names it."""


def _open(f: Path) -> Any:
    """safe_open, with an error that names the file (safetensors' own names none)."""
    if not f.is_file():
        raise WeightMismatchError(f"{f} is missing (named by {SAFETENSORS_INDEX}): re-download or re-convert it")
    try:
        return safe_open(str(f), framework="pt")
    except Exception as e:  # SafetensorError: header / size mismatch
        raise WeightMismatchError(f"{f} is not a readable safetensors file ({e}): truncated or damaged? re-download "
                                  "or re-convert it") from None  # fmt: skip


class HFCheckpoint:
    """Lazy, read-only view of an HF safetensors directory (one file or an index of shards)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index = self.path / SAFETENSORS_INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: self.path / f for name, f in weight_map.items()}
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{self.path} holds no *.safetensors files (nor {SAFETENSORS_INDEX})")
            self._file_of = {}
            for f in files:
                with _open(f) as h:
                    for name in h.keys():  # noqa: SIM118 - safe_open handles are not mappings
                        self._file_of[name] = f
        self._handles: OrderedDict[Path, Any] = OrderedDict()

    def names(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def _handle(self, name: str) -> Any:
        if name not in self._file_of:
            raise WeightMismatchError(f"HF checkpoint {self.path} has no tensor {name!r}")
        f = self._file_of[name]
        if f in self._handles:
            self._handles.move_to_end(f)
        else:
            while len(self._handles) >= MAX_OPEN_FILES:
                self._handles.popitem(last=False)
            self._handles[f] = _open(f)
        return self._handles[f]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype (from the file header; no data is read)."""
        code = self._handle(name).get_slice(name).get_dtype()
        if code not in _SAFETENSORS_DTYPES:
            raise WeightMismatchError(f"HF tensor {name!r} has safetensors dtype {code}, which torch cannot hold")
        return _SAFETENSORS_DTYPES[code]

    def close(self) -> None:
        """Release the open shard files (they reopen on the next access)."""
        self._handles.clear()

    def files(self) -> list[Path]:
        return sorted(set(self._file_of.values()))


def weight_mapping(spec: ModelSpec) -> WeightMapping:
    """The expanded HF<->megatron mapping of `spec`."""
    attn = None if spec.family.multi_latent_attention else attention_shape(spec.hf)
    return WeightMapping(spec.family.weight_rules(spec.hf), attn, spec.vocab_size)


TIED_LM_HEAD = "lm_head.weight"
"""With tie_word_embeddings=true megatron holds no output layer; a checkpoint that still stores lm_head.weight
(a copy of model.embed_tokens.weight) gets it rebuilt from the embedding on the way back."""


def is_passthrough(spec: ModelSpec, hf_name: str) -> bool:
    """HF tensors the megatron model does not hold but checkpoints carry unchanged (family-specific: DSA indexer,
    MTP layers)."""
    return spec.family.passthrough(spec.hf, hf_name)


def iter_sharded_tensors(model: Any) -> Iterator[Any]:
    """Every ShardedTensor of this rank's model, with GLU factories expanded into their gate/up halves."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for v in nested_values(model.sharded_state_dict()):
        if isinstance(v, ShardedTensorFactory):
            built = v.build()
            for sub in nested_values(built) if isinstance(built, dict | list) else [built]:
                if sub.key != v.key:
                    raise WeightMismatchError(f"unsupported sharded-tensor split {sub.key} (singleton local shards)")
                yield sub
        elif isinstance(v, ShardedTensor):
            yield v


def local_slice(full: torch.Tensor, sh: Any) -> torch.Tensor:
    """This shard's part of the unstacked full tensor (the leading stacked axes are already selected)."""
    p = sh.prepend_axis_num
    index = tuple(slice(o, o + n) for o, n in zip(sh.global_offset[p:], sh.data.shape))
    return full[index]


def load_hf_weights(model: Any, spec: ModelSpec, hf: HFCheckpoint, role: Role = "policy") -> list[str]:
    """Copy HF weights into this rank's shards of `model`; returns the canonical names loaded.

    The value role's head (output_layer) has no HF counterpart and keeps its initialization.
    """
    mapping = weight_mapping(spec)
    padded = padded_vocab_size(spec.vocab_size, model.config.tensor_model_parallel_size)
    cache: dict[str, torch.Tensor] = {}
    loaded: list[str] = []
    with torch.no_grad():
        for sh in iter_sharded_tensors(model):
            name = canonical_from_checkpoint_key(sh.key, tuple(sh.global_offset[: sh.prepend_axis_num]))
            if role == "value" and name.startswith("output_layer."):
                continue
            if name not in cache:  # the two GLU halves of one tensor arrive one after the other
                cache.clear()
                try:
                    cache[name] = mapping.to_megatron(name, hf.get, padded)
                except KeyError as e:
                    raise WeightMismatchError(f"megatron tensor {name} has no HF mapping ({e})") from None
            full = cache[name]
            expected = tuple(sh.global_shape[sh.prepend_axis_num :])
            if tuple(full.shape) != expected:
                raise WeightMismatchError(
                    f"{name}: HF tensors {mapping.rule(name).hf} give shape {tuple(full.shape)}, megatron expects "
                    f"{expected}; the HF config and checkpoint disagree"
                )
            sh.data.copy_(local_slice(full, sh).to(sh.data.dtype))
            loaded.append(name)
    return loaded

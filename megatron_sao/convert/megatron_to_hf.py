"""The project's megatron dist checkpoint -> HF safetensors directory, streamed. CLI: tools/convert_megatron_to_hf.py.

The expected tensors come from the HF config given with --hf-config (a megatron model built on the meta device)
and are checked against the checkpoint's metadata before anything is written: missing, unexpected, wrong shape
or dtype are errors that name the tensor. Then one decoder layer at a time is read with megatron's
`dist_checkpointing.load` (a sub-state-dict holding just that layer's tensors, whole, at world size 1), split
into HF tensors by models/mapping.py and appended to the current safetensors shard, which is written once it
reaches `max_shard_size`. Peak memory: about one shard plus one layer. config.json, generation_config.json and
the tokenizer files are copied from --hf-config.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from megatron_sao.config.model import read_hf_config_json
from megatron_sao.convert.common import (
    SUPPORTED_FLOAT_DTYPES,
    TensorInfo,
    check_output_dir,
    meta_sharded_state_dict,
    model_tensors,
    one_process_megatron,
    progress_bar,
    reset_output_dir,
    spec_dtype,
)
from megatron_sao.models.builder import ModelSpec
from megatron_sao.models.checkpoint import (
    PASSTHROUGH_PREFIX,
    POLICY_PREFIX,
    CheckpointMismatchError,
    check_hf_source,
    dtype_from_name,
    most_common_dtype,
    read_hf_source,
)
from megatron_sao.models.mapping import canonical_from_checkpoint_key
from megatron_sao.models.weights import SAFETENSORS_INDEX, TIED_LM_HEAD, WeightMapping, weight_mapping

DEFAULT_MAX_SHARD_SIZE = "5GB"
COPIED_FILES = (
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
)
COPIED_PATTERNS = ("tokenizer*", "*.tiktoken", "configuration_*.py", "modeling_*.py", "tokenization_*.py")
_MAX_NAMED = 12


def convert_megatron_to_hf(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    hf_config_dir: str | Path,
    *,
    dtype: str | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Write the policy weights of megatron checkpoint `ckpt_dir` as an HF model directory `out_dir`.

    `hf_config_dir` holds the HF config.json of the model (and tokenizer files to copy). Each HF tensor gets the
    dtype the HF source had (recorded at conversion), else config.json's dtype; `dtype` (bf16 | fp32) overrides.
    Raises ValueError subclasses (CheckpointMismatchError, UnsupportedModelError, OutputDirectoryError) naming
    what is wrong, before writing anything.
    """
    from megatron.core import dist_checkpointing

    ckpt, out, cfg_dir = Path(ckpt_dir), Path(out_dir), Path(hf_config_dir)
    check_output_dir(out, force)
    if not (ckpt / "metadata.json").is_file():
        raise CheckpointMismatchError(f"{ckpt} is not a megatron dist checkpoint (it has no metadata.json)")
    if dtype not in (None, "bf16", "fp32"):
        raise ValueError(f"dtype={dtype!r}: choose bf16 or fp32")
    probe = ModelSpec.from_hf_dir(cfg_dir)  # UnsupportedModelError lists the supported architectures
    record = read_hf_source(ckpt)
    if record is not None:
        check_hf_source(record, probe, what=f"--hf-config {cfg_dir}")
    metadata = dist_checkpointing.load_tensors_metadata(str(ckpt))
    stored = {k: (tuple(v.global_shape), v.dtype) for k, v in metadata.items()}
    policy_dtypes = {k: d for k, (_, d) in stored.items() if k.startswith(POLICY_PREFIX)}
    model_dtype = record["dtype"] if record else spec_dtype(most_common_dtype(policy_dtypes))
    spec = ModelSpec.from_hf_dir(cfg_dir, family=probe.family.name, dtype=model_dtype)
    mapping = weight_mapping(spec)
    override = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(dtype or "")
    with one_process_megatron():
        tensors = model_tensors(meta_sharded_state_dict(spec, POLICY_PREFIX), POLICY_PREFIX)
        _check_checkpoint(ckpt, stored, tensors, mapping, record)
        reset_output_dir(out)
        plan = _Plan(ckpt, stored, tensors, mapping, record, _output_dtypes(record, spec, override))
        plan.write(_ShardWriter(out, _parse_size(max_shard_size)), progress)
    _copy_side_files(cfg_dir, out, dtype and {"bf16": "bfloat16", "fp32": "float32"}[dtype])
    return out


class _Plan:
    """What to read (checkpoint key groups, one decoder layer each) and how to turn it into HF tensors."""

    def __init__(
        self,
        ckpt: Path,
        stored: dict[str, tuple[tuple[int, ...], torch.dtype]],
        tensors: dict[str, TensorInfo],
        mapping: WeightMapping,
        record: dict | None,
        out_dtype: Any,
    ) -> None:
        self.ckpt, self.stored, self.tensors, self.mapping, self.out_dtype = ckpt, stored, tensors, mapping, out_dtype
        self.tied_lm_head = bool(record and record["tied_lm_head"])
        self.passthrough = [k for k in stored if k.startswith(PASSTHROUGH_PREFIX)]

    def write(self, writer: _ShardWriter, progress: bool) -> None:
        with progress_bar(progress) as bar:
            groups = _layer_groups(list(self.tensors), self.passthrough)
            task = bar.add_task(f"megatron -> HF {writer.out.name}", total=len(groups))
            for keys in groups:
                loaded = _load_group(self.ckpt, keys, self.stored)
                for key in keys:
                    for name, t in self.to_hf(key, loaded.pop(key)):
                        writer.add(name, t if key in self.passthrough else t.to(self.out_dtype(name, t.dtype)))
                bar.advance(task)
            writer.finish()

    def to_hf(self, key: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if key.startswith(PASSTHROUGH_PREFIX):
            yield key.removeprefix(PASSTHROUGH_PREFIX), tensor
            return
        local = key.removeprefix(POLICY_PREFIX)
        if self.tensors[key].stacked:
            for e in range(tensor.shape[0]):
                yield from self.mapping.to_hf(canonical_from_checkpoint_key(local, (e,)), tensor[e])
            return
        name = canonical_from_checkpoint_key(local, ())
        yield from self.mapping.to_hf(name, tensor)
        if self.tied_lm_head and name == "embedding.word_embeddings.weight":
            yield TIED_LM_HEAD, self.mapping.to_hf(name, tensor)[0][1].clone()  # its own storage, not a view


def _named(items: list[str]) -> str:
    more = f" (and {len(items) - _MAX_NAMED} more)" if len(items) > _MAX_NAMED else ""
    return ", ".join(items[:_MAX_NAMED]) + more


def _check_checkpoint(
    ckpt: Path,
    stored: dict[str, tuple[tuple[int, ...], torch.dtype]],
    tensors: dict[str, TensorInfo],
    mapping: WeightMapping,
    record: dict | None,
) -> None:
    policy = {k for k in stored if k.startswith(POLICY_PREFIX)}
    missing = [k for k in tensors if k not in policy]
    if missing:
        raise CheckpointMismatchError(
            f"checkpoint {ckpt} lacks {len(missing)} tensor(s) the model of --hf-config holds: {_named(missing)}"
        )
    unexpected = [k for k in sorted(policy) if k not in tensors]
    if unexpected:
        raise CheckpointMismatchError(
            f"checkpoint {ckpt} has {len(unexpected)} tensor(s) the model of --hf-config does not hold: "
            f"{_named(unexpected)}; is --hf-config the config the checkpoint was trained from?"
        )
    bad_shapes = [f"{k}: {list(stored[k][0])}, expected {list(info.shape)}"
                  for k, info in tensors.items() if stored[k][0] != info.shape]  # fmt: skip
    if bad_shapes:
        raise CheckpointMismatchError(f"checkpoint tensor shape mismatch with --hf-config: {_named(bad_shapes)}")
    exceptions = {n: dtype_from_name(d) for n, d in (record or {}).get("hf_dtype_exceptions", {}).items()}
    bad_dtypes = []
    for key, info in tensors.items():
        got = stored[key][1]
        allowed = {info.dtype} | {exceptions[h] for n in info.names for h in mapping.rule(n).hf if h in exceptions}
        if got not in SUPPORTED_FLOAT_DTYPES or (record is not None and got not in allowed):
            bad_dtypes.append(f"{key}: {got}, expected {' or '.join(sorted(map(str, allowed)))}")
    if bad_dtypes:
        raise CheckpointMismatchError(
            f"checkpoint tensor dtype mismatch with the {record and record['dtype']} model it records: "
            f"{_named(bad_dtypes)}"
        )


def _output_dtypes(record: dict | None, spec: ModelSpec, override: torch.dtype | None) -> Any:
    """name, checkpoint dtype -> HF dtype: --dtype, else the recorded HF dtype, else config.json's, else as stored."""
    if override is not None:
        return lambda name, stored: override
    if record is not None:
        default = dtype_from_name(record["hf_dtype"])
        exceptions = {n: dtype_from_name(d) for n, d in record["hf_dtype_exceptions"].items()}
        return lambda name, stored: exceptions.get(name, default)
    configured = spec.hf.get("dtype") or spec.hf.get("torch_dtype")
    if isinstance(configured, str) and configured != "auto":
        return lambda name, stored: dtype_from_name(configured)
    return lambda name, stored: stored


def _layer_groups(policy_keys: list[str], passthrough_keys: list[str]) -> list[list[str]]:
    """Checkpoint keys in HF order, one group per decoder layer (the layer's passthrough tensors with it)."""

    def slot(key: str) -> float:
        m = re.search(r"layers\.(\d+)\.", key)
        if m is not None:
            return int(m.group(1))
        return -1 if "embedding" in key or "embed_tokens" in key else float("inf")

    groups: dict[float, list[str]] = {}
    for key in [*policy_keys, *passthrough_keys]:
        groups.setdefault(slot(key), []).append(key)
    return [groups[s] for s in sorted(groups)]


def _load_group(
    ckpt: Path, keys: list[str], stored: dict[str, tuple[tuple[int, ...], torch.dtype]]
) -> dict[str, torch.Tensor]:
    """Read whole tensors (all experts of a stacked key at once) with megatron's dist_checkpointing."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    request = {}
    for key in keys:
        shape, dtype = stored[key]
        request[key] = ShardedTensor.from_rank_offsets(key, torch.empty(shape, dtype=dtype), replica_id=0)
    loaded = dist_checkpointing.load(request, str(ckpt))
    return {k: loaded[k] for k in keys}


def _parse_size(size: str | int) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", size, flags=re.IGNORECASE)
    if m is None:
        raise ValueError(f"max_shard_size={size!r}: use bytes or a size like 5GB / 500MB / 2GiB")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return int(float(m.group(1)) * scale)


class _ShardWriter:
    """Accumulates HF tensors and writes a safetensors shard whenever the next tensor would overflow it; at the
    end names the shards model-0000i-of-0000n.safetensors and writes model.safetensors.index.json."""

    def __init__(self, out: Path, max_bytes: int) -> None:
        self.out, self.max_bytes = out, max_bytes
        self.buffer: dict[str, torch.Tensor] = {}
        self.size = self.total = 0
        self.shards: list[list[str]] = []
        self.written: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.written:
            raise AssertionError(f"HF tensor {name} produced twice")
        self.written.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if self.buffer and self.size + nbytes > self.max_bytes:
            self._flush()
        # Contiguous views (GLU halves, one expert of a stacked tensor) are stored as they are: safetensors accepts
        # non-overlapping views of one storage, and copying them would hold a layer twice.
        tensor = tensor.contiguous()
        self.buffer[name] = tensor
        self.size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self.buffer, str(self.out / f"shard-{len(self.shards)}.part"), metadata={"format": "pt"})
        self.shards.append(list(self.buffer))
        self.buffer, self.size = {}, 0

    def finish(self) -> None:
        if self.buffer or not self.shards:
            self._flush()
        n = len(self.shards)
        weight_map = {}
        for i, names in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.out / f"shard-{i}.part").rename(self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _copy_side_files(cfg_dir: Path, out: Path, dtype_name: str | None) -> None:
    config = read_hf_config_json(cfg_dir)
    if dtype_name is not None:
        config["dtype" if "dtype" in config or "torch_dtype" not in config else "torch_dtype"] = dtype_name
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    names = {n for n in COPIED_FILES if (cfg_dir / n).is_file()}
    names |= {p.name for pattern in COPIED_PATTERNS for p in cfg_dir.glob(pattern) if p.is_file()}
    for name in sorted(names):
        shutil.copy2(cfg_dir / name, out / name)

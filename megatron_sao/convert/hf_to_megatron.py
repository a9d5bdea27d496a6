"""HF safetensors directory -> the project's megatron dist checkpoint (torch_dist, canonical keys, `policy.` prefix),
streamed. CLI: tools/convert_hf_to_megatron.py.

How it streams: the model is built on the meta device at world size 1 (no weights in memory), its sharded state
dict gives every checkpoint key, shape and chunk, and megatron's `dist_checkpointing.save` runs with a sharded
strategy whose planner produces each chunk only when the writer asks for it (`resolve_data` reads the HF
tensors it needs through models/mapping.py). The writer puts one decoder layer (at most `MAX_FILE_BYTES`) in
each file and drops it once written, so peak memory is about one layer plus one open HF shard mapping
(docs/conversion.md has measurements). The checkpoint loads under any TP/EP/PP with `load_model_weights`.
"""

from __future__ import annotations

import functools
import queue
import re
from pathlib import Path
from typing import Any

import torch

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
from megatron_sao.models.builder import ModelSpec, padded_vocab_size
from megatron_sao.models.checkpoint import (
    HF_SOURCE_KEY,
    PASSTHROUGH_PREFIX,
    POLICY_PREFIX,
    hf_source_record,
    most_common_dtype,
)
from megatron_sao.models.weights import (
    TIED_LM_HEAD,
    HFCheckpoint,
    WeightMapping,
    WeightMismatchError,
    is_passthrough,
    weight_mapping,
)

MAX_FILE_BYTES = 1 << 30
"""Largest checkpoint file the streaming writer fills before starting the next (a layer that is bigger spans
several files); bounds the writer's memory."""

_MAX_NAMED = 12


def convert_hf_to_megatron(
    hf_dir: str | Path, out_dir: str | Path, *, dtype: str | None = None, force: bool = False, progress: bool = True
) -> Path:
    """Convert an HF checkpoint directory into a megatron dist checkpoint at `out_dir`; returns `out_dir`.

    `dtype` (bf16 | fp32) is the megatron model's dtype; default: the HF checkpoint's most common dtype (fp16
    becomes fp32). Tensors the HF checkpoint keeps in another dtype (e.g. GLM's fp32 router weight and expert
    bias in a bf16 checkpoint) keep theirs, so the reverse conversion is exact. Raises UnsupportedModelError,
    WeightMismatchError or OutputDirectoryError (all ValueError) with what to fix, before writing anything.
    """
    hf_dir, out = Path(hf_dir), Path(out_dir)
    check_output_dir(out, force)
    if dtype not in (None, "bf16", "fp32"):
        raise ValueError(f"dtype={dtype!r}: choose bf16 or fp32")
    probe = ModelSpec.from_hf_dir(hf_dir)  # UnsupportedModelError (lists the supported types) comes from here
    hf = HFCheckpoint(hf_dir)
    hf_dtypes = {name: hf.dtype(name) for name in hf.names()}
    spec = ModelSpec.from_hf_dir(hf_dir, family=probe.family.name, dtype=dtype or spec_dtype(_main_dtype(hf_dtypes)))
    mapping = weight_mapping(spec)
    passthrough = sorted((n for n in hf.names() if is_passthrough(spec, n)), key=_layer_order)
    tied_lm_head = _check_names(spec, mapping, hf, passthrough)
    _check_dtypes(mapping, hf_dtypes)
    with one_process_megatron():
        sharded = meta_sharded_state_dict(spec, POLICY_PREFIX)
        tensors = model_tensors(sharded, POLICY_PREFIX)
        _check_shapes(mapping, hf, tensors)
        _store_exceptions_in_their_dtype(sharded, tensors, mapping, hf_dtypes)
        sharded.update(_passthrough_tensors(hf, passthrough))
        sharded[HF_SOURCE_KEY] = hf_source_record(spec, hf_dtypes, tied_lm_head)
        reset_output_dir(out)
        source = _HFChunkSource(hf, mapping, padded_vocab_size(spec.vocab_size, 1), tensors)
        _save_streaming(sharded, out, source, progress)
    return out


def _main_dtype(hf_dtypes: dict[str, torch.dtype]) -> torch.dtype:
    return most_common_dtype({n: d for n, d in hf_dtypes.items() if d.is_floating_point})


def _layer_order(name: str) -> tuple[int, str]:
    m = re.search(r"\.layers\.(\d+)\.", name)
    return (int(m.group(1)) if m else -1, name)


def _named(names: list[str]) -> str:
    more = f" (and {len(names) - _MAX_NAMED} more)" if len(names) > _MAX_NAMED else ""
    return ", ".join(names[:_MAX_NAMED]) + more


def _check_names(spec: ModelSpec, mapping: WeightMapping, hf: HFCheckpoint, passthrough: list[str]) -> bool:
    """Every mapped HF tensor is present and every HF tensor is mapped or passed through; returns whether a tied
    model stores a (redundant, equal) lm_head.weight."""
    present = set(hf.names())
    missing = [n for n in mapping.hf_names() if n not in present]
    if missing:
        raise WeightMismatchError(
            f"HF checkpoint {hf.path} lacks {len(missing)} tensor(s) that its config.json implies: {_named(missing)}; "
            f"the checkpoint is incomplete or config.json does not describe it"
        )
    known = set(mapping.hf_names()) | set(passthrough)
    tied_lm_head = spec.tie_embeddings and TIED_LM_HEAD in present
    if tied_lm_head:
        if not torch.equal(hf.get(TIED_LM_HEAD), hf.get(mapping.rule("embedding.word_embeddings.weight").hf[0])):
            raise WeightMismatchError(
                f"config.json says tie_word_embeddings=true but {TIED_LM_HEAD} differs from the input embedding; "
                f"set tie_word_embeddings=false if the checkpoint has a separate output layer"
            )
        known.add(TIED_LM_HEAD)
    unexpected = sorted((n for n in present if n not in known), key=_layer_order)
    if unexpected:
        raise WeightMismatchError(
            f"HF checkpoint {hf.path} has {len(unexpected)} tensor(s) the {spec.family.name} mapping does not know: "
            f"{_named(unexpected)}; check that config.json matches the weights (layer and expert counts, "
            f"tie_word_embeddings, attention_bias) or add them to megatron_sao/models/families/{spec.family.name}.py"
        )
    return tied_lm_head


def _check_dtypes(mapping: WeightMapping, hf_dtypes: dict[str, torch.dtype]) -> None:
    bad = [f"{n} ({hf_dtypes[n]})" for n in mapping.hf_names() if hf_dtypes[n] not in SUPPORTED_FLOAT_DTYPES]
    if bad:
        raise WeightMismatchError(
            f"HF tensor(s) with unsupported dtype: {_named(bad)}; the converter reads fp32/bf16/fp16 weights "
            f"(dequantize FP8 or integer-quantized checkpoints first)"
        )


def _check_shapes(mapping: WeightMapping, hf: HFCheckpoint, tensors: dict[str, TensorInfo]) -> None:
    bad = []
    for info in tensors.values():
        for name in info.names:
            for h, want in mapping.hf_shapes(name, info.shape[info.stacked :]).items():
                got = hf.shape(h)
                if got != want:
                    bad.append(f"{h}: {list(got)}, expected {list(want)}")
    if bad:
        raise WeightMismatchError(
            f"HF tensor shape mismatch with config.json: {_named(bad)}; config.json does not describe these weights"
        )


def _store_exceptions_in_their_dtype(
    sharded: dict[str, Any], tensors: dict[str, TensorInfo], mapping: WeightMapping, hf_dtypes: dict[str, torch.dtype]
) -> None:
    """Tensors whose HF sources all share a dtype other than the checkpoint's main one are stored in it."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    main = _main_dtype(hf_dtypes)
    stored: dict[str, torch.dtype] = {}
    for key, info in tensors.items():
        sources = {hf_dtypes[h] for name in info.names for h in mapping.rule(name).hf}
        if len(sources) == 1 and (only := next(iter(sources))) != main:
            stored[key] = only
    for sh in nested_values(sharded):
        if sh.key in stored:
            sh.data = torch.empty(sh.data.shape, dtype=stored[sh.key], device="meta")
    for key, dtype in stored.items():
        tensors[key] = TensorInfo(tensors[key].shape, dtype, tensors[key].stacked, tensors[key].names)


def _passthrough_tensors(hf: HFCheckpoint, names: list[str]) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = {}
    for name in names:
        meta = torch.empty(hf.shape(name), dtype=hf.dtype(name), device="meta")
        out[PASSTHROUGH_PREFIX + name] = ShardedTensor.from_rank_offsets(PASSTHROUGH_PREFIX + name, meta, replica_id=0)
    return out


class _HFChunkSource:
    """Produces one checkpoint chunk (key, global offsets, sizes) from the HF tensors, on demand. Keeps the last
    full megatron tensor, since the chunks of one tensor (GLU halves) are requested one after the other."""

    def __init__(
        self, hf: HFCheckpoint, mapping: WeightMapping, padded_vocab: int, tensors: dict[str, TensorInfo]
    ) -> None:
        self.hf, self.mapping, self.padded_vocab, self.tensors = hf, mapping, padded_vocab, tensors
        self._last: tuple[str, torch.Tensor] | None = None

    def chunk(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if key.startswith(PASSTHROUGH_PREFIX):
            return self.hf.get(key.removeprefix(PASSTHROUGH_PREFIX)).to(dtype)
        from megatron_sao.models.mapping import canonical_from_checkpoint_key

        stacked = self.tensors[key].stacked
        name = canonical_from_checkpoint_key(key.removeprefix(POLICY_PREFIX), tuple(offsets[:stacked]))
        if self._last is None or self._last[0] != name:
            self._last = None  # free the previous tensor before building the next
            self._last = (name, self.mapping.to_megatron(name, self.hf.get, self.padded_vocab))
        index = tuple(slice(o, o + n) for o, n in zip(offsets[stacked:], sizes[stacked:]))
        return self._last[1][index].to(dtype).reshape(sizes).contiguous()


def _save_streaming(sharded: dict[str, Any], out: Path, source: _HFChunkSource, progress: bool) -> None:
    from megatron.core import dist_checkpointing

    with progress_bar(progress) as bar:
        n_chunks = sum(1 for _ in _iter_sharded_tensors(sharded))
        task = bar.add_task(f"HF -> megatron {out.name}", total=n_chunks)
        strategy = _streaming_strategy(source, lambda: bar.advance(task))
        dist_checkpointing.save(sharded, str(out), sharded_strategy=strategy)


def _iter_sharded_tensors(sharded: dict[str, Any]) -> Any:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return (v for v in nested_values(sharded) if isinstance(v, ShardedTensor))


def _file_group(fqn: str) -> str:
    m = re.match(r"^(.*?layers\.\d+\.)", fqn)
    return m.group(1) if m else fqn.split(".", 1)[0]


@functools.cache
def _strategy_classes() -> tuple[type, type, type]:
    """megatron's torch_dist save path with two changes: chunks are produced lazily (planner.resolve_data) and
    each file holds one layer (torch's FileSystemWriter keeps every tensor of a file until the file is closed)."""
    from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.planner import WriteItemType

    class LazyPlanner(MCoreSavePlanner):
        def __init__(self, source: _HFChunkSource, on_chunk: Any) -> None:
            super().__init__(flatten_state_dict=False)
            self.source, self.on_chunk = source, on_chunk

        def resolve_data(self, write_item: Any) -> Any:
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            td = write_item.tensor_data
            data = self.source.chunk(
                write_item.index.fqn, tuple(td.chunk.offsets), tuple(td.chunk.sizes), td.properties.dtype
            )
            self.on_chunk()
            return data

    class LayerFileWriter(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            file_queue: queue.Queue = queue.Queue()
            group, size, items = None, 0, []
            for item in plan.items:  # plan order: embedding, layer 0, layer 1, ..., passthrough by layer
                item_bytes = _item_bytes(item)
                if items and (_file_group(item.index.fqn) != group or size + item_bytes > MAX_FILE_BYTES):
                    self._queue_file(file_queue, plan, items)
                    size, items = 0, []
                group, size = _file_group(item.index.fqn), size + item_bytes
                items.append(item)
            if items:
                self._queue_file(file_queue, plan, items)
            return self._write_data(planner, file_queue)

        def _queue_file(self, file_queue: queue.Queue, plan: Any, items: list) -> None:
            name = f"{plan.storage_data.prefix}{file_queue.qsize()}.distcp"
            file_queue.put((self.fs.concat_path(self.path, name), name, items))

    class StreamingSaveStrategy(SaveShardedStrategy):
        def __init__(self, source: _HFChunkSource, on_chunk: Any) -> None:
            super().__init__("torch_dist", 1)
            self.source, self.on_chunk = source, on_chunk

        def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, keep_only_main_replica=True)
            pyt_state_dict = mcore_to_pyt_state_dict(flat, is_loading=False)
            writer = LayerFileWriter(str(checkpoint_dir), single_file_per_rank=True, thread_count=1)
            dcp_save(pyt_state_dict, storage_writer=writer, planner=LazyPlanner(self.source, self.on_chunk))

        @property
        def can_handle_sharded_objects(self) -> bool:
            return True

    return LazyPlanner, LayerFileWriter, StreamingSaveStrategy


def _item_bytes(item: Any) -> int:
    td = item.tensor_data
    if td is None:
        return 0
    n = 1
    for s in td.chunk.sizes:
        n *= s
    return n * td.properties.dtype.itemsize


def _streaming_strategy(source: _HFChunkSource, on_chunk: Any) -> Any:
    return _strategy_classes()[2](source, on_chunk)

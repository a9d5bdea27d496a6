"""SGLang's per-rank tensor payloads (`/update_weights_from_tensor`, SGLang 0.5.23): what a sender packs for each TP
rank of an engine and what that rank accepts when it opens it (owned by distributed/; the embedded engine opens them,
engines/embedded/weights.py; a sender -- a per-node push agent, a colocated trainer -- packs them).

An entry is the standard base64 of one pickle of `[(name, tensor), ...]` (SGLang's MultiprocessingSerializer: a
ForkingPickler dump), or, for `load_format="flattened_bucket"`, of `{"flattened_tensor": uint8, "metadata": [...]}`
(each metadata item with name, shape, dtype, start_idx, end_idx, numel, as SGLang's FlattenedTensorMetadata). The
request lists one entry per TP rank, and rank i opens only entry i.

Opening follows SGLang's SafeUnpickler (srt/utils/common.py): a global outside its allow-list is refused with its
words ("Blocked unsafe global (module.name) during pickle deserialization"), `torch.storage._load_from_bytes` (an
inline storage from a plain pickle) goes through `torch.load(weights_only=True)` and must give a storage. The
allow-list here is SGLang's, less what cannot occur in a weight payload without sglang installed (its request and
multimodal classes; its metadata classes are accepted under their names and read as plain records).

Tensors: a CUDA tensor pickles as a CUDA IPC handle (opened by a process on the same node); a CPU tensor pickled
with ForkingPickler under torch's `file_system` sharing strategy travels as a shared-memory file name, which any
process on the host can open while the sender keeps the tensor alive (`pack` shares them that way); a plain pickle
carries the bytes inline (`pack(..., inline=True)`: any host, any lifetime, twice the copies).
"""

from __future__ import annotations

import base64
import io
import pickle
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as torch_mp

_TENSOR_TYPES = ["BFloat16", "Bool", "Byte", "Char", "Double", "Float", "Half", "Int", "Long", "Short"]
_STORAGE_TYPES = [*_TENSOR_TYPES, "ComplexDouble", "ComplexFloat"]
_DTYPES = [
    "bcomplex32", "bfloat16", "bit", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "cdouble", "cfloat",
    "chalf", "complex128", "complex32", "complex64", "double", "float", "float16", "float32", "float4_e2m1fn_x2",
    "float64", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "half", "int",
    *(f"int{i}" for i in (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)), "long", "qint32", "qint8", "quint2x4", "quint4x2",
    "quint8", "short", *(f"uint{i}" for i in (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)),
    "per_tensor_affine", "per_tensor_symmetric", "per_channel_affine", "per_channel_symmetric",
    "per_channel_affine_float_qparams",
]  # fmt: skip
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    [("builtins", n) for n in ("bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int", "list",
                               "range", "set", "slice", "str", "tuple")]
    + [("collections", n) for n in ("OrderedDict", "defaultdict", "deque", "Counter")]
    + [("copyreg", "__newobj__"), ("copyreg", "__newobj_ex__"), ("functools", "partial"), ("itertools", "chain"),
       ("itertools", "repeat"), ("multiprocessing.reduction", "_rebuild_partial"),
       ("multiprocessing.reduction", "_rebuild_socket"), ("multiprocessing.resource_sharer", "DupFd"),
       ("types", "SimpleNamespace"), ("_codecs", "encode")]
    + [("torch", "Tensor")] + [(m, f"{t}Tensor") for m in ("torch", "torch.cuda") for t in _TENSOR_TYPES]
    + [(m, f"{t}Tensor") for m in ("torch.sparse", "torch.cuda.sparse") for t in _TENSOR_TYPES if t != "Bool"]
    + [("torch", n) for n in ("Size", "device", "dtype", *_DTYPES)]
    + [("torch.nn.parameter", "Parameter"), ("torch.serialization", "_get_layout"),
       ("torch._tensor", "_rebuild_from_type_v2")]
    + [("torch._utils", n) for n in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3",
                                     "_rebuild_parameter", "_rebuild_parameter_with_state", "_rebuild_qtensor",
                                     "_rebuild_sparse_tensor",
                                     "_rebuild_meta_tensor_no_storage", "_rebuild_wrapper_subclass",
                                     "_rebuild_device_tensor_from_numpy", "_rebuild_device_tensor_from_cpu_tensor")]
    + [("torch.storage", n) for n in ("UntypedStorage", "_UntypedStorage", "TypedStorage")]
    + [("torch", "UntypedStorage")]
    + [("torch", f"{t}Storage") for t in [*_STORAGE_TYPES, "QInt32", "QInt8", "QUInt2x4", "QUInt4x2", "QUInt8"]]
    + [("torch.cuda", f"{t}Storage") for t in _STORAGE_TYPES]
    + [("torch.multiprocessing.reductions", n) for n in (
        "rebuild_tensor", "rebuild_meta_tensor", "rebuild_cuda_tensor", "rebuild_nested_tensor",
        "rebuild_sparse_coo_tensor", "rebuild_sparse_compressed_tensor", "rebuild_storage_fd",
        "rebuild_storage_filename", "rebuild_storage_empty", "rebuild_typed_storage", "rebuild_typed_storage_child")]
)  # fmt: skip
"""SGLang 0.5.23's SafeUnpickler.ALLOWED_GLOBALS, as far as a weight payload can use it without sglang."""

METADATA_CLASSES = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket"),
}
"""SGLang's own classes a flattened-bucket payload may name (allowed by SGLang); read here as plain records."""


class PayloadError(ValueError):
    """A payload an engine rank refuses; the message says why in SGLang's words where SGLang has them."""


class _Record:
    """Stands in for an SGLang data class named in a payload: takes whatever state it was pickled with."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slots state)
            state = {**(state[0] or {}), **(state[1] or {})}
        self.__dict__.update(state or {})


def _load_storage(data: bytes) -> Any:
    out = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(out, torch.storage.TypedStorage | torch.storage.UntypedStorage):
        raise pickle.UnpicklingError(f"Expected a Torch storage, got {type(out)}")
    return out


class SafeUnpickler(pickle.Unpickler):
    """SGLang's rule: only the allow-listed globals; an inline storage only as a weights-only torch.load."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_storage
        if (module, name) in METADATA_CLASSES:
            return _Record
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def pack(named_tensors: Sequence[tuple[str, torch.Tensor]] | dict[str, Any], inline: bool = False) -> str:
    """One rank's entry: base64 of a ForkingPickler dump (CPU tensors moved to shared memory under the file_system
    strategy: the receiver opens them by name while the caller keeps `named_tensors` alive), or with `inline` of a
    plain pickle carrying the bytes."""
    if inline:
        data = pickle.dumps(named_tensors)
    else:
        if torch_mp.get_sharing_strategy() != "file_system":
            torch_mp.set_sharing_strategy("file_system")
        buf = io.BytesIO()
        ForkingPickler(buf).dump(named_tensors)
        data = buf.getvalue()
    return base64.b64encode(data).decode("ascii")


def open_entry(entry: str | bytes) -> Any:
    """One rank's entry as SGLang's TP worker opens it (strict base64, then the safe unpickler); PayloadError naming
    what is refused."""
    try:
        data = base64.b64decode(entry, validate=True) if isinstance(entry, str) else bytes(entry)
    except (ValueError, TypeError) as e:
        raise PayloadError(f"Expected base64-encoded bytes ({e})") from None
    try:
        return SafeUnpickler(io.BytesIO(data)).load()
    except RuntimeError as e:
        raise PayloadError(str(e)) from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError) as e:
        raise PayloadError(f"the payload does not unpickle: {type(e).__name__}: {e}") from None


def named_tensors(payload: Any, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of an opened entry: a list of pairs, or a flattened bucket split by its metadata."""
    if load_format == "flattened_bucket":
        if not isinstance(payload, dict) or "flattened_tensor" not in payload or "metadata" not in payload:
            raise PayloadError("load_format='flattened_bucket': the entry must be a dict with flattened_tensor and "
                               "metadata")  # fmt: skip
        flat = payload["flattened_tensor"]
        if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
            raise PayloadError("flattened_tensor must be a 1-D uint8 tensor")
        out = []
        for m in payload["metadata"]:
            try:
                name, start, end = str(m.name), int(m.start_idx), int(m.end_idx)
                dtype, shape = m.dtype, tuple(int(d) for d in m.shape)
            except (AttributeError, TypeError, ValueError) as e:
                raise PayloadError(f"flattened-bucket metadata item {m!r}: {e}") from None
            if not isinstance(dtype, torch.dtype) or not 0 <= start <= end <= flat.numel():
                raise PayloadError(f"flattened-bucket metadata of {name}: bytes [{start}, {end}) of "
                                   f"{flat.numel()}, dtype {dtype!r}")  # fmt: skip
            try:
                out.append((name, flat[start:end].view(dtype).view(shape)))
            except RuntimeError as e:
                raise PayloadError(f"flattened-bucket tensor {name}: {e}") from None
        return out
    if not isinstance(payload, list | tuple):
        raise PayloadError(f"the entry holds a {type(payload).__name__}, not a list of (name, tensor) pairs")
    pairs = []
    for item in payload:
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):  # fmt: skip
            raise PayloadError(f"an entry item is not a (name, tensor) pair: {type(item).__name__}")
        pairs.append((item[0], item[1]))
    return pairs

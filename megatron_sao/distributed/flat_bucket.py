"""SGLang's flattened-bucket layout and weight checksums: what the two ends of a weight push must agree on byte for
byte (the learner's stage sources pack, the embedded engine unpacks; a real SGLang server unpacks with its own
`FlattenedTensorBucket`, srt/weight_sync/tensor_bucket.py, which tests/engines/test_sglang_contract.py runs on our
buffers).

Layout (`load_format="flattened_bucket"` of `/update_weights_from_distributed`, SGLang >= 0.5.6): the tensors of one
request lie back to back in ONE uint8 buffer, in the order of `names`, with no padding; SGLang refuses a tensor whose
byte offset is not a multiple of its dtype's itemsize (ValueError before it receives anything, so the sender's
broadcast would hang). `aligned_order` sorts a bucket so every offset is aligned: by itemsize, largest first (a
sum of multiples of 8 is a multiple of 4, 2 and 1).

Sharded buckets (`load_format="sharded_bucket"`, the embedded engine's own): one engine rank's bucket holds, in the
request's order and the same layout rules, only the block (offset, shape) of each tensor that rank holds split, and
every other tensor whole; `sharded` packs it from the full bucket.

Checksums follow SGLang's `/weights_checker` (srt/utils/weight_checker.py through mm_utils.tensor_hash), which hashes
a tensor by where it lives: a CPU tensor by the first 8 bytes of sha256 over its raw bytes (`tensor_checksum`), a
CUDA tensor -- every weight of an engine on GPUs -- by SGLang's own Triton kernel (kernels/ops/memory/
gpu_tensor_hash.py: tile hashes of 32-bit words finished with splitmix64), ported here integer for integer
(`gpu_tensor_checksum`; tests/distributed/test_gpu_tensor_hash.py runs the kernel itself under Triton's interpreter
against the port). Both print as 16 hex digits; per GPU a sha256 over the sorted (name, tensor checksum) pairs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

T = TypeVar("T")


def dtype_from_name(name: str) -> torch.dtype:
    """'bfloat16' / 'torch.bfloat16' -> torch.bfloat16; ValueError naming the dtype otherwise."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; send torch dtype names such as 'bfloat16' or 'float32'")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (what SGLang's `dtypes` field carries)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in a flat bucket: bytes [start, end) viewed as `dtype` of `shape`."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def aligned_order(items: Sequence[T], dtype_of: Callable[[T], torch.dtype]) -> list[T]:
    """`items` in an order whose flat layout has every offset aligned (itemsize descending, stable otherwise)."""
    return sorted(items, key=lambda it: -dtype_of(it).itemsize)


def layout(names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> list[Slot]:
    """The slots of a flat bucket, exactly as SGLang's FlattenedTensorBucket.empty computes them; ValueError (SGLang's
    rules) for an empty bucket, a negative dimension or an unaligned offset."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
    if not names:
        raise ValueError("Cannot create empty tensor bucket")
    slots, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"Negative dimension in received tensor {name}: {list(shape)}")
        if offset % dtype.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
        size = torch.Size(shape).numel() * dtype.itemsize
        slots.append(Slot(name, dtype, shape, offset, offset + size))
        offset += size
    return slots


def nbytes(slots: Sequence[Slot]) -> int:
    return slots[-1].end if slots else 0


def view(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The tensor of `slot` inside the uint8 `buffer` (a view: writing it writes the buffer)."""
    return buffer[slot.start : slot.end].view(slot.dtype).view(slot.shape)


def tensor_checksum(tensor: torch.Tensor) -> str:
    """SGLang's per-tensor checksum: sha256 of the raw bytes, first 8 bytes as 16 hex digits."""
    t = tensor.detach().to("cpu").contiguous()
    digest = hashlib.sha256(memoryview(t.reshape(-1).view(torch.uint8).numpy())).digest()
    return f"{int.from_bytes(digest[:8], byteorder='big', signed=False):016x}"


# SGLang's gpu_tensor_hash constants (kernels/ops/memory/gpu_tensor_hash.py, 0.5.23) and its defaults
_FMIX32_C1, _FMIX32_C2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)
_POS_C1, _POS_C2 = np.uint32(0x27D4EB2D), np.uint32(0x165667B1)
GPU_HASH_SEED = 0x243F6A88
GPU_HASH_TILE_WORDS = 8192
_M32, _M64 = (1 << 32) - 1, (1 << 64) - 1
_CHUNK_TILES = 128  # tiles hashed at once (4 MiB of words): bounds the port's scratch memory


def _rotl32(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def _fmix32(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(16))
    x = x * _FMIX32_C1
    x = x ^ (x >> np.uint32(13))
    x = x * _FMIX32_C2
    return x ^ (x >> np.uint32(16))


def _splitmix64(x: int) -> int:
    x &= _M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def gpu_tensor_hash(tensor: torch.Tensor, seed: int = GPU_HASH_SEED, tile_words: int = GPU_HASH_TILE_WORDS) -> int:
    """SGLang's `gpu_tensor_hash` of `tensor`, computed on the CPU: the raw bytes, zero-padded to whole 32-bit words
    (little-endian); per tile of `tile_words` words two sums (mod 2^32) of fmix32(word ^ position hash), each xored
    with the padded byte count and mixed again into one 64-bit tile hash; the tile hashes summed mod 2^64 and
    finished with splitmix64. Every step is integer arithmetic, so the value is the kernel's bit for bit."""
    raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    pad = (4 - raw.size % 4) % 4
    if pad:
        raw = np.concatenate([raw, np.zeros(pad, dtype=np.uint8)])
    words = raw.view("<u4")
    n = words.size
    if n == 0:
        return 0
    s1 = np.uint32(seed & _M32)
    s2 = np.uint32(((seed * 0x9E3779B1) ^ 0xDEADBEEF) & _M32)
    nbytes = np.uint32((n * 4) & _M32)
    total = 0
    step = tile_words * _CHUNK_TILES
    for start in range(0, n, step):
        v = words[start : start + step]
        idx = np.arange(start, start + v.size, dtype=np.uint64).astype(np.uint32)
        k1 = _fmix32(v ^ ((idx * _POS_C1 + s1) ^ _rotl32(idx, 15)))
        k2 = _fmix32(v ^ ((idx * _POS_C2 + s2) ^ _rotl32(idx, 13)))
        tiles = -(-v.size // tile_words)
        sums = []
        for k in (k1, k2):  # the masked tail of the last tile adds zeros
            full = np.zeros(tiles * tile_words, dtype=np.uint32)
            full[: k.size] = k
            sums.append((full.reshape(tiles, tile_words).sum(axis=1, dtype=np.uint64) & _M32).astype(np.uint32))
        h1, h2 = (_fmix32(h ^ nbytes).astype(np.uint64) for h in sums)
        total += int(((h1 << np.uint64(32)) | h2).sum(dtype=np.uint64))
    return _splitmix64(total)


def gpu_tensor_checksum(tensor: torch.Tensor) -> str:
    """SGLang's per-tensor checksum of a tensor held on a CUDA device (`gpu_tensor_hash` as 16 hex digits)."""
    return f"{gpu_tensor_hash(tensor):016x}"


def sglang_checksums(tensor: torch.Tensor) -> dict[str, str]:
    """The checksum an SGLang engine shows for `tensor` by where it holds its weights: {"cpu": sha256, "cuda":
    gpu_tensor_hash} (engines/protocol.checksum_device says which an engine uses)."""
    return {"cpu": tensor_checksum(tensor), "cuda": gpu_tensor_checksum(tensor)}


def overall_checksum(checksums: Mapping[str, str]) -> str:
    """SGLang's per-GPU checksum over {name: tensor checksum}."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


Box = tuple[Sequence[int], Sequence[int]]
"""(offset, shape) of the block of a tensor one engine rank holds."""


def block(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    """The block `box` of `tensor` (a view); ValueError when the box does not lie inside the tensor (a slice would
    silently come out smaller, and a receiver expecting the box's size would wait for bytes that never come)."""
    offset, shape = box
    if len(offset) != tensor.dim() or len(shape) != tensor.dim():
        raise ValueError(f"block {list(offset)}+{list(shape)} of a {tensor.dim()}-D tensor {list(tensor.shape)}")
    out = tensor[tuple(slice(int(o), int(o) + int(n)) for o, n in zip(offset, shape))]
    if list(out.shape) != [int(n) for n in shape] or any(int(o) < 0 for o in offset):
        raise ValueError(f"block {list(offset)}+{list(shape)} does not lie inside a tensor of shape "
                         f"{list(tensor.shape)}")  # fmt: skip
    return out


def sharded(
    slots: Sequence[Slot], buffer: torch.Tensor, boxes: Mapping[str, Box | None],
    alloc: Callable[[int, torch.device], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[Slot]]:  # fmt: skip
    """One engine rank's sharded bucket from the full bucket (`slots` in `buffer`): each tensor named in `boxes`
    with a box cut to that block, every other tensor whole; (its buffer, its slots). `alloc(nbytes, device)`: where the
    buffer comes from (a sender reuses the buffers of landed buckets; default: a new one on `buffer`'s device)."""
    parts = [(s, boxes.get(s.name)) for s in slots]
    mine = layout([s.name for s in slots], [s.dtype for s in slots],
                  [s.shape if b is None else tuple(int(n) for n in b[1]) for s, b in parts])  # fmt: skip
    size = nbytes(mine)
    alloc = alloc or (lambda n, device: torch.empty(n, dtype=torch.uint8, device=device))
    out = alloc(size, buffer.device)
    for (s, b), m in zip(parts, mine):
        full = view(buffer, s)
        view(out, m).copy_(full if b is None else block(full, b))
    return out, mine

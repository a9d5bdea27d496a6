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

Checksums follow SGLang's `/weights_checker` (srt/utils/weight_checker.py, CPU path of mm_utils.tensor_hash): per
tensor the first 8 bytes of sha256 over its raw bytes as 16 hex digits, and per GPU a sha256 over the sorted
(name, tensor checksum) pairs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

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

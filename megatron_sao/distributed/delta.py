"""Weight deltas: a flat bucket sent as only what changed since the last push (owned by distributed/; the stage
sources encode, weight_sync/sender.py; the embedded engine and the push agent decode, engines/embedded/weights.py).

A bucket's bytes (distributed/flat_bucket.py, the engine's dtype: bf16, or FP8 e4m3 bytes plus their block scales)
are compared as units of the smallest itemsize in the bucket (every slot's offset and size are multiples of it:
bf16 buckets by 2-byte elements, FP8 ones byte by byte, scales included). A unit that differs from the base -- what
the same channel carried at the last push both ends kept -- is a change. One encoding per bucket, the smallest:

    sparse   positions (int32, ascending) then the new units: 4 + u bytes per change
    bitmap   one bit per unit (padded to 8 bytes) then the new units: units / 8 + u per change
    full     the bucket's bytes as they are (past the break-even, ~1/3 of bf16 units or ~1/5 of FP8 bytes changed)

Decoding writes the changed units into the base. Both ends keep a **fingerprint** of each base (`Fingerprint`: the sum
mod 2^64 of every unit's value times an odd key of its position) and move it by the changed units alone
(`advance`: what a unit contributes is subtracted at its old value and added at its new one), so a delta push costs no
pass over the whole bucket. The sender sends the new bytes' fingerprint; a receiver whose base differs from the
sender's anywhere -- at a changed unit or not -- arrives at another one and refuses instead of loading wrong weights
(docs/weight_sync.md, "Deltas"). Only a bucket kept whole is fingerprinted in full (`fingerprint`: on the device it
lives on).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

Encoding = Literal["sparse", "bitmap", "full"]
ENCODINGS: tuple[Encoding, ...] = ("sparse", "bitmap", "full")
_UNIT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
POSITION_BYTES = 4
MAX_UNITS = 2**31 - 1
"""Positions are int32: a bucket holds at most this many units (2 GiB of bf16), far above any bucket_mb."""


class DeltaError(ValueError):
    """A delta that does not fit its base or its own header (the message says which)."""


def unit_dtype(itemsize: int) -> torch.dtype:
    """The integer dtype compared per unit of `itemsize` bytes."""
    if itemsize not in _UNIT:
        raise DeltaError(f"no unit of {itemsize} bytes (1, 2, 4 or 8)")
    return _UNIT[itemsize]


def bucket_unit(slots: Sequence[Any]) -> int:
    """The unit a bucket's deltas count in, the same at both ends: its smallest itemsize (flat_bucket.Slot's dtypes;
    every slot's offset and size are multiples of it)."""
    return min(s.dtype.itemsize for s in slots)


_K, _C = 0x9E3779B97F4A7C15 - (1 << 64), 0x632BE59BD9B4E019
"""The position key: a unit at position i holding x contributes (x + 1) * ((i * K + C) | 1), all mod 2^64 (int64
arithmetic wraps the same on every device); an odd multiplier makes any single changed unit change the sum."""
_CHUNK = 1 << 22
_M64 = (1 << 64) - 1
Fingerprint = int


def _contribution(positions: torch.Tensor, values: torch.Tensor) -> int:
    """The sum (mod 2^64) over units at `positions` holding `values` (both int64, both consumed: written in place)."""
    keys = positions.mul_(_K).add_(_C).bitwise_or_(1)
    return int(values.add_(1).mul_(keys).sum()) & _M64


def _as_int64(units: torch.Tensor, unit: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Units (a signed integer view) as their unsigned values in int64 (8-byte units as they are), into `out`."""
    out = units.to(torch.int64, copy=True) if out is None else out[: units.numel()].copy_(units)
    return out.bitwise_and_((1 << 8 * unit) - 1) if unit < 8 else out


def fingerprint(buffer: torch.Tensor, unit: int) -> Fingerprint:
    """The fingerprint of a whole bucket (a pass over it, in chunks, on its device)."""
    units = buffer.view(unit_dtype(unit))
    size = min(_CHUNK, units.numel())
    positions = torch.empty(size, dtype=torch.int64, device=buffer.device)
    values = torch.empty(size, dtype=torch.int64, device=buffer.device)
    total = 0
    for start in range(0, units.numel(), _CHUNK):
        part = units[start : start + _CHUNK]
        n = part.numel()
        torch.arange(start, start + n, dtype=torch.int64, device=buffer.device, out=positions[:n])
        total = (total + _contribution(positions[:n], _as_int64(part, unit, values))) & _M64
    return total


def advance(fp: Fingerprint, positions: torch.Tensor, old: torch.Tensor, new: torch.Tensor, unit: int) -> Fingerprint:
    """The fingerprint after the units at `positions` went from `old` to `new` (unit-dtype views)."""
    if positions.numel() == 0:
        return fp
    added = _contribution(positions.to(torch.int64, copy=True), _as_int64(new, unit))
    removed = _contribution(positions.to(torch.int64, copy=True), _as_int64(old, unit))
    return (fp + added - removed) & _M64


def fingerprint_hex(fp: Fingerprint) -> str:
    return f"{fp:016x}"


@dataclass(frozen=True)
class Encoded:
    """One bucket's bytes as they travel: `payload` in `encoding`, `count` changed units, `unit` bytes each;
    `fingerprint` of the bytes it carries to (after decoding)."""

    encoding: Encoding
    count: int
    unit: int
    payload: torch.Tensor
    fingerprint: Fingerprint = 0

    @property
    def nbytes(self) -> int:
        return int(self.payload.nbytes)


def sizes(units: int, changed: int, unit: int) -> dict[Encoding, int]:
    """Bytes on the wire of a bucket of `units` units with `changed` of them changed, per encoding."""
    return {"sparse": changed * (POSITION_BYTES + unit), "bitmap": _bitmap_bytes(units) + changed * unit,
            "full": units * unit}  # fmt: skip


BITMAP_SAVING = 0.25
"""A bitmap is chosen only when it saves at least this share of the full bytes: past that density its decode (every
unit's bit read, most of them written) costs more than the bytes it saves."""


def choose(units: int, changed: int, unit: int) -> Encoding:
    """The encoding of a bucket of `units` units with `changed` changed: the smallest, a bitmap only when it saves
    BITMAP_SAVING of the full bytes."""
    cost = sizes(units, changed, unit)
    if cost["bitmap"] > (1 - BITMAP_SAVING) * cost["full"]:
        cost["bitmap"] = cost["full"] + 1
    return min(ENCODINGS, key=lambda e: (cost[e], ENCODINGS.index(e)))


def _bitmap_bytes(units: int) -> int:
    return -(-units // 64) * 8  # padded to 8 bytes: the values after it stay aligned for any unit


def encode(new: torch.Tensor, base: torch.Tensor | None, unit: int, base_fp: Fingerprint | None = None) -> Encoded:
    """`new` (a uint8 bucket) against `base` (the same bucket at the last push, of fingerprint `base_fp`; None:
    full), the smallest encoding; its fingerprint moved from `base_fp` by the changes (full pass without a base)."""
    if new.nbytes % unit:
        raise DeltaError(f"a bucket of {new.nbytes} bytes is not whole units of {unit}")
    units = new.nbytes // unit
    if base is None or base_fp is None or base.nbytes != new.nbytes or base.device != new.device or units > MAX_UNITS:
        return Encoded("full", 0, unit, new, fingerprint(new, unit))
    dt = unit_dtype(unit)
    n, b = new.view(dt), base.view(dt)
    positions = changed_units(new, base, unit)
    changed = positions.numel()
    best = choose(units, changed, unit)
    if best == "full":  # most units changed: one pass over the new bytes costs less than following each change
        return Encoded("full", changed, unit, new, fingerprint(new, unit))
    values = n[positions]
    fp = advance(base_fp, positions, b[positions], values, unit)
    if best == "sparse":
        payload = torch.cat([positions.to(torch.int32).view(torch.uint8), values.view(torch.uint8)])
        return Encoded("sparse", changed, unit, payload, fp)
    mask = torch.zeros(units, dtype=torch.bool, device=new.device)
    mask[positions] = True
    return Encoded(
        "bitmap", changed, unit, torch.cat([_pack(mask, _bitmap_bytes(units)), values.view(torch.uint8)]), fp
    )


def changed_units(new: torch.Tensor, base: torch.Tensor, unit: int) -> torch.Tensor:
    """The positions (int64, ascending) of the units of `new` that differ from `base`: compared 8 bytes at a time
    first, so the per-unit work covers only the words that changed (a few percent of them at the paper's lr)."""
    dt = unit_dtype(unit)
    whole = new.nbytes // 8 * 8
    per_word = 8 // unit
    if unit >= 8 or whole == 0:
        return (new.view(dt) != base.view(dt)).nonzero().reshape(-1)
    words = (new[:whole].view(torch.int64) != base[:whole].view(torch.int64)).nonzero().reshape(-1)
    if words.numel() * 4 > whole // 8:  # most words changed: comparing every unit costs less than following them
        return (new.view(dt) != base.view(dt)).nonzero().reshape(-1)
    candidates = (words.unsqueeze(1) * per_word + torch.arange(per_word, device=new.device)).reshape(-1)
    n, b = new.view(dt), base.view(dt)
    found = candidates[n[candidates] != b[candidates]]
    tail = torch.arange(whole // unit, new.nbytes // unit, device=new.device)
    return torch.cat([found, tail[n[tail] != b[tail]]]) if tail.numel() else found


def _pack(mask: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A bool mask as `nbytes` bytes of bits, least significant first (numpy's packbits on the host)."""
    if mask.device.type == "cpu":
        packed = torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
        return torch.cat([packed, torch.zeros(nbytes - packed.numel(), dtype=torch.uint8)])
    bits = torch.zeros(nbytes * 8, dtype=torch.bool, device=mask.device)
    bits[: mask.numel()] = mask
    return (
        (bits.view(-1, 8).to(torch.uint8) << torch.arange(8, dtype=torch.uint8, device=mask.device))
        .sum(1)
        .to(torch.uint8)
    )


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """The bits of `packed` as a bool tensor (the inverse of `_pack`)."""
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), bitorder="little").view(np.bool_))
    return ((packed.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8, device=packed.device)) & 1).reshape(-1).bool()


def payload_bytes(encoding: Encoding, units: int, count: int, unit: int) -> int:
    """The size of a payload its header describes (what a receiver allocates before the bytes arrive)."""
    if encoding not in ENCODINGS:
        raise DeltaError(f"unknown delta encoding {encoding!r}; one of {ENCODINGS}")
    if not 0 <= count <= units:
        raise DeltaError(f"{count} changed units in a bucket of {units}")
    return units * unit if encoding == "full" else sizes(units, count, unit)[encoding]


def apply(out: torch.Tensor, encoding: Encoding, count: int, unit: int, payload: torch.Tensor,
          base_fp: Fingerprint | None = None) -> Fingerprint | None:  # fmt: skip
    """Write a payload into `out` (a uint8 copy of the base; for "full", any buffer of the bucket's size) in place;
    the fingerprint of the result, moved from `base_fp` (None when not given, or for "full")."""
    if out.nbytes % unit:
        raise DeltaError(f"a bucket of {out.nbytes} bytes is not whole units of {unit}")
    units = out.nbytes // unit
    expected = payload_bytes(encoding, units, count, unit)
    if payload.nbytes != expected:
        raise DeltaError(f"a {encoding} payload of {count} changes in {units} units is {expected} bytes, got "
                         f"{payload.nbytes}")  # fmt: skip
    if encoding == "full":
        out.copy_(payload)
        return None
    dt = unit_dtype(unit)
    target = out.view(dt)
    if encoding == "sparse":
        positions = payload[: count * POSITION_BYTES].view(torch.int32).to(torch.int64)
        values = payload[count * POSITION_BYTES :].view(dt)
        if count and (int(positions.min()) < 0 or int(positions.max()) >= units):
            raise DeltaError(f"a delta position lies outside the bucket's {units} units")
    else:
        nbits = _bitmap_bytes(units)
        packed = payload[:nbits]
        bits = _unpack(packed)
        positions = bits[:units].nonzero().reshape(-1)
        if positions.numel() != count or bool(bits[units:].any()):
            raise DeltaError(f"the bitmap marks {int(bits.sum())} units, its header {count}")
        values = payload[nbits:].view(dt)
    fp = advance(base_fp, positions, target[positions], values, unit) if base_fp is not None else None
    target[positions] = values
    return fp

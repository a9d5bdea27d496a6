"""The delta codec (distributed/delta.py) and its header (engines/protocol.DeltaHeader): a bucket rebuilt from its
base and any encoding is the new bucket byte for byte, the smallest encoding is chosen, and bad input is refused."""

from __future__ import annotations

import pytest
import torch

from megatron_sao.distributed import delta
from megatron_sao.engines.protocol import DeltaHeader, DeltaPart


def _bucket(units: int, unit: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (units * unit,), dtype=torch.uint8, generator=g)


def _changed(base: torch.Tensor, unit: int, density: float, seed: int) -> torch.Tensor:
    """`base` with about `density` of its units rewritten (to a value that differs)."""
    g = torch.Generator().manual_seed(seed)
    new = base.clone()
    units = new.view(delta.unit_dtype(unit))
    mask = torch.rand(units.shape, generator=g) < density
    units[mask] = units[mask] ^ 1  # flip the lowest bit: every masked unit changes
    return new


@pytest.mark.parametrize("unit", [1, 2, 4])
@pytest.mark.parametrize(("density", "encoding"), [(0.0, "sparse"), (0.005, "sparse"), (0.1, "bitmap"),
                                                   (0.99, "full")])  # fmt: skip
def test_a_bucket_rebuilt_from_its_base_is_the_new_bucket(unit: int, density: float, encoding: str) -> None:
    base = _bucket(4099, unit, seed=unit)  # an odd count of units: the bitmap's padding is exercised
    new = _changed(base, unit, density, seed=7)
    base_fp = delta.fingerprint(base, unit)
    enc = delta.encode(new, base, unit, base_fp)
    assert enc.encoding == encoding
    assert enc.count == int((new.view(delta.unit_dtype(unit)) != base.view(delta.unit_dtype(unit))).sum())
    assert enc.nbytes == delta.sizes(4099, enc.count, unit)[encoding]
    assert enc.nbytes == delta.payload_bytes(enc.encoding, 4099, enc.count, unit)
    # the sender's fingerprint, moved by the changes alone, is the new bytes' as a full pass computes it
    assert enc.fingerprint == delta.fingerprint(new, unit)
    out = base.clone()
    fp = delta.apply(out, enc.encoding, enc.count, unit, enc.payload, base_fp)
    assert torch.equal(out, new)
    assert fp == (None if encoding == "full" else enc.fingerprint)
    assert (enc.fingerprint != base_fp) == (density > 0)


def test_a_receiver_whose_base_differs_anywhere_arrives_at_another_fingerprint() -> None:
    """What the receiver's check rests on: a base that differs from the sender's at a unit the delta leaves alone
    moves the rebuilt bytes' fingerprint away from the sender's; one that differs only at a unit the delta rewrites
    rebuilds the right bytes, and the fingerprints agree."""
    base = _bucket(5000, 2, seed=11)
    new = _changed(base, 2, 0.01, seed=12)
    enc = delta.encode(new, base, 2, delta.fingerprint(base, 2))
    changed = (new.view(torch.int16) != base.view(torch.int16)).nonzero().reshape(-1)
    untouched = next(i for i in range(5000) if i not in set(changed.tolist()))
    for at in (untouched, int(changed[0])):
        other = base.clone()
        other.view(torch.int16)[at] ^= 4  # the receiver's base: one unit off
        fp = delta.apply(other, enc.encoding, enc.count, 2, enc.payload, delta.fingerprint(other, 2))
        assert (fp == enc.fingerprint) == torch.equal(other, new) == (at != untouched), at


def test_the_fingerprint_moved_unit_by_unit_is_the_full_pass_for_every_unit() -> None:
    for unit in (1, 2, 4, 8):
        buf = _bucket(3000, unit, seed=unit)
        zeros = torch.zeros_like(buf)
        units = buf.view(delta.unit_dtype(unit))
        moved = delta.advance(delta.fingerprint(zeros, unit), torch.arange(units.numel()),
                              zeros.view(delta.unit_dtype(unit)), units, unit)  # fmt: skip
        assert moved == delta.fingerprint(buf, unit) != delta.fingerprint(zeros, unit)


def test_past_the_bitmaps_margin_a_bucket_goes_whole() -> None:
    """A bitmap saves bytes up to ~94% of bf16 units changed, but decoding it costs more than it saves past a
    quarter's saving (BITMAP_SAVING): at the CPU examples' densities (~0.76) buckets go whole."""
    units = 1 << 16
    assert delta.choose(units, int(0.5 * units), 2) == "bitmap"
    assert delta.choose(units, int(0.76 * units), 2) == "full"
    assert delta.choose(units, int(0.005 * units), 2) == "sparse"


def test_the_cheapest_encoding_is_chosen_at_the_break_even_points() -> None:
    units, unit = 1 << 16, 2
    costs = {d: delta.sizes(units, int(d * units), unit) for d in (1 / 64, 1 / 16, 0.9, 0.97)}
    # bf16: sparse 6 bytes a change; bitmap 1/8 a unit + 2 a change (below 1/32: sparse); full 2 a unit (past 15/16)
    assert min(costs[1 / 64], key=costs[1 / 64].get) == "sparse"
    assert min(costs[1 / 16], key=costs[1 / 16].get) == "bitmap"
    assert min(costs[0.9], key=costs[0.9].get) == "bitmap"
    assert min(costs[0.97], key=costs[0.97].get) == "full"


def test_no_base_or_another_size_goes_whole() -> None:
    new = _bucket(100, 2, seed=1)
    assert delta.encode(new, None, 2).encoding == "full"
    assert delta.encode(new, _bucket(101, 2, seed=1), 2, 0).encoding == "full"


def test_a_payload_that_does_not_fit_is_refused() -> None:
    base = _bucket(1000, 2, seed=3)
    enc = delta.encode(_changed(base, 2, 0.01, seed=4), base, 2, delta.fingerprint(base, 2))
    assert enc.encoding == "sparse" and enc.count > 0
    with pytest.raises(delta.DeltaError, match="bytes"):
        delta.apply(base.clone(), "sparse", enc.count + 1, 2, enc.payload)
    bad = enc.payload.clone()
    bad[:4].view(torch.int32)[0] = 5000  # a position past the bucket
    with pytest.raises(delta.DeltaError, match="outside"):
        delta.apply(base.clone(), "sparse", enc.count, 2, bad)
    with pytest.raises(delta.DeltaError, match="unknown"):
        delta.payload_bytes("rle", 1000, 3, 2)  # type: ignore[arg-type]
    with pytest.raises(delta.DeltaError, match="changed units"):
        delta.payload_bytes("sparse", 1000, 1001, 2)


def test_the_header_round_trips_and_names_what_is_wrong() -> None:
    header = DeltaHeader(keep=True, base=3, parts=(DeltaPart("sparse", 5, 2, "ab" * 16), DeltaPart("full", 0, 2)))
    assert DeltaHeader.from_json(header.to_json()) == header
    assert header.part(1).encoding == "full"
    assert DeltaHeader(keep=True).part(4) == DeltaPart("full")  # no base: every part whole
    with pytest.raises(ValueError, match="block part 2"):
        header.part(2)
    for raw, said in [({"base": -1, "parts": []}, "weight version"), ({"base": 2}, "parts is empty"),
                      ({"base": 2, "parts": [["sparse", 1, 2, ""]]}, "digest"),
                      ({"base": 2, "parts": [["zip", 1, 2, "x"]]}, "sparse|bitmap|full"),
                      ({"base": 2, "parts": [["full", 0, 3, ""]]}, "unit 1|2|4|8"),
                      ({"keep": True, "extra": 1}, "keep, base and parts"), ("delta", "an object")]:  # fmt: skip
        with pytest.raises(ValueError, match=said):
            DeltaHeader.from_json(raw)

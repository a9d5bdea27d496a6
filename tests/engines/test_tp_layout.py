"""The embedded engine's TP commit copies through strided views where a part's held positions form a block
(engines/embedded/tp.py `strided_layout`), and falls back to index scatter where they do not."""

from __future__ import annotations

import torch

from megatron_sao.engines.embedded.tp import Strided, strided_layout


def test_contiguous_run_and_row_blocks_are_found_and_view_the_same_elements() -> None:
    flat = torch.arange(100.0)
    cases = {
        "run": torch.arange(10, 40),
        "rows": (torch.arange(4).view(-1, 1) * 20 + torch.arange(5).view(1, -1) + 3).view(-1),  # column split
        "one": torch.tensor([7]),
    }
    for name, idx in cases.items():
        block = strided_layout(idx)
        assert block is not None, name
        assert torch.equal(block.of(flat).reshape(-1), flat[idx]), name
    assert strided_layout(cases["run"]) == Strided(10, 1, 30, 30)
    assert strided_layout(cases["rows"]) == Strided(3, 4, 5, 20)


def test_positions_that_are_not_one_block_fall_back() -> None:
    assert strided_layout(torch.tensor([0, 1, 2, 5, 6, 9])) is None  # ragged runs
    assert strided_layout(torch.tensor([0, 1, 4, 5, 6, 7])) is None  # runs of 2 then 4
    assert strided_layout(torch.tensor([0, 1, 5, 6, 8, 9])) is None  # uneven stride
    assert strided_layout(torch.tensor([3, 2, 1])) is None  # decreasing
    assert strided_layout(torch.tensor([], dtype=torch.long)) is None


def test_a_view_of_an_offset_tensor_starts_at_its_own_offset() -> None:
    base = torch.arange(50.0)
    flat = base[10:]  # storage offset 10
    block = strided_layout(torch.tensor([2, 3, 12, 13]))
    assert block is not None
    assert block.of(flat).reshape(-1).tolist() == [12.0, 13.0, 22.0, 23.0]
    block.of(flat).copy_(torch.zeros(2, 2))
    assert base[12].item() == 0.0 and base[23].item() == 0.0 and base[14].item() == 14.0

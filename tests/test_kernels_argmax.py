"""The native row argmax (csrc/argmax.cpp) gives torch.argmax's answer on every ISA level: the first maximal
index, the first NaN of a row holding one, infinities, ties, rows of any length and strided rows."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kernel_levels import isa  # noqa: F401 - fixture


@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 17, 33, 100, 49152, 49155])
def test_random_rows(isa: Any, n: int) -> None:  # noqa: F811
    g = torch.Generator().manual_seed(n)
    x = torch.randn(5, n, generator=g)
    assert torch.equal(isa.argmax_rows(x), x.argmax(-1))


def test_ties_infinities_and_nan(isa: Any) -> None:  # noqa: F811
    n = 70
    rows = []
    for spot in (0, 9, 16, 31, 69):
        tie = torch.zeros(n)
        tie[spot] = 3.0
        tie[-1] = 3.0  # the first of two equal maxima wins
        rows.append(tie)
        inf = torch.randn(n)
        inf[spot] = float("inf")
        rows.append(inf)
        nan = torch.randn(n)
        nan[spot] = float("nan")
        nan[min(spot + 3, n - 1)] = float("nan")
        rows.append(nan)
    rows.append(torch.full((n,), float("-inf")))
    rows.append(torch.full((n,), 2.5))
    x = torch.stack(rows)
    assert torch.equal(isa.argmax_rows(x), x.argmax(-1))


def test_strided_rows_and_threads(isa: Any) -> None:  # noqa: F811
    x = torch.randn(33, 5000)[:, 100:4100]  # rows 5000 apart, 4000 wide
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(isa.argmax_rows(x), x.argmax(-1))
    finally:
        torch.set_num_threads(before)


def test_bad_input(isa: Any) -> None:  # noqa: F811
    for bad in (torch.zeros(3), torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 0), torch.zeros(4, 3).t()):
        with pytest.raises(RuntimeError):
            isa.argmax_rows(bad)

"""Paged attention is batch-invariant (attention.cpp): a query row's output is bitwise the same whether it is a decode
row alone or among 15 other sequences, a row of a speculative-verification chunk or of a prefill chunk, computed
with 1 or 2 threads (flash-decoding split or not), on every ISA level this CPU has and both cache dtypes, with the
bf16 dot-product kernels (bf16 caches from avx512_bf16 up: the group threshold is lowered to 1) and without."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from kernel_levels import isa_all  # noqa: F401  (fixture)

BS, HKV, G = 16, 3, 3


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=[1, 4], ids=["bf16-dot", "fp32-kernels"])
def min_group(request: pytest.FixtureRequest, isa_all: Any) -> Iterator[Any]:  # noqa: F811
    before = isa_all.attention_bf16_min_group()
    isa_all.set_attention_bf16_min_group(request.param)
    yield isa_all
    isa_all.set_attention_bf16_min_group(before)


class World:
    """A KV cache holding a target sequence of `length` keys and `others` other sequences, and a query row q_star
    (all heads) at the target's last position."""

    def __init__(self, length: int, d: int, dtype: torch.dtype, others: int = 15) -> None:
        g = torch.Generator().manual_seed(length + d)
        self.d, self.length = d, length
        self.other_lens = [int(x) for x in torch.randint(1, 900, (others,), generator=g)]
        need = [math.ceil(n / BS) for n in [length, *self.other_lens]]
        nb = sum(need)
        self.kv = torch.randn(2, nb, BS, HKV, d, generator=g).to(dtype)
        perm = torch.randperm(nb, generator=g).to(torch.int32)
        self.tables, used = [], 0
        for n in need:
            self.tables.append(perm[used:used + n])
            used += n
        self.q_star = torch.randn(HKV * G, d, generator=g)
        self.gen = g

    def run(self, mod: Any, seqs: list[tuple[int, int, int]]) -> torch.Tensor:
        """seqs: (sequence index (0 = target), q_len, row of q_star or -1); returns the q_star row's output."""
        t = sum(n for _, n, _ in seqs)
        q = torch.randn(t, HKV * G, self.d, generator=self.gen)
        width = max(len(tb) for tb in self.tables)
        bt = torch.zeros(len(seqs), width, dtype=torch.int32)
        qsl, lens, at, start = [0], [], -1, 0
        for i, (s, n, row) in enumerate(seqs):
            bt[i, :len(self.tables[s])] = self.tables[s]
            lens.append(self.length if s == 0 else self.other_lens[s - 1])
            if row >= 0:
                q[start + row] = self.q_star
                at = start + row
            start += n
            qsl.append(start)
        out = torch.full(q.shape, float("nan"))
        mod.paged_attention(out, q, self.kv, bt, torch.tensor(qsl, dtype=torch.int32),
                            torch.tensor(lens, dtype=torch.int32), self.d ** -0.5)
        return out[at]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
def test_row_is_batch_invariant(min_group: Any, threads: None, d: int, dtype: torch.dtype) -> None:
    mod = min_group
    w = World(700, d, dtype)  # 700 keys: three partitions of 256
    others = [(i, 1, -1) for i in range(1, 16)]
    scenarios = {
        "decode alone": [(0, 1, 0)],
        "decode among 15": [*others[:7], (0, 1, 0), *others[7:]],
        "verify chunk of 5": [(3, 1, -1), (0, 5, 4)],
        "verify chunk, earlier rows": [(0, 5, 4), *others],
        "prefill chunk of 512": [(0, 512, 511)],
        "whole prompt of 700": [(5, 1, -1), (0, 700, 699)],
    }
    results = []
    for name, seqs in scenarios.items():
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append((f"{name}, {n} threads", w.run(mod, seqs)))
    ref = results[0][1]
    assert not ref.isnan().any()
    for name, out in results:
        assert torch.equal(out, ref), f"{mod.active_isa()}: {name} differs from a decode row alone"


def test_rows_spanning_partitions_in_one_chunk(min_group: Any, threads: None) -> None:
    """Rows of one prefill chunk on both sides of a partition boundary (keys 256) equal the same rows alone."""
    mod = min_group
    torch.set_num_threads(2)
    w = World(300, 64, torch.bfloat16, others=0)
    for row in (250, 255, 256, 299):
        w.length = row + 1
        alone = w.run(mod, [(0, 1, 0)])
        w.length = 300
        assert torch.equal(w.run(mod, [(0, 300, row)]), alone), (mod.active_isa(), row)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_kv_prefetch_changes_no_output(min_group: Any, threads: None, dtype: torch.dtype) -> None:
    """The decode kernels' K/V prefetch (KvRowsAhead: the next tile's rows into L2) only moves data: decode rows,
    a verification chunk and a prompt chunk come out bitwise the same with it off, on every level and cache format,
    with items spanning several KV heads (a batch of one, two threads) and not."""
    from pdserve.model.kv_cache_dtype import quantize_kv

    mod = min_group
    torch.set_num_threads(2)
    w = World(700, 64, torch.float32)
    if dtype == torch.int8:
        w.kv = quantize_kv(w.kv, dtype).view(dtype)
    else:
        w.kv = w.kv.to(dtype)
    others = [(i, 1, -1) for i in range(1, 16)]
    cases = [[(0, 1, 0)], [*others[:7], (0, 1, 0), *others[7:]], [(3, 1, -1), (0, 5, 4)], [(0, 300, 299)]]
    before = mod.attention_prefetch()
    try:
        for seqs in cases:
            outs = []
            for on in (False, True):
                mod.set_attention_prefetch(on)
                outs.append(w.run(mod, seqs))
            assert not outs[0].isnan().any()
            assert torch.equal(outs[0], outs[1]), (mod.active_isa(), dtype, seqs[-1])
    finally:
        mod.set_attention_prefetch(before)
    assert mod.attention_prefetch() == before

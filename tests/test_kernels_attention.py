"""Native paged attention and reshape_and_cache against float64 references and the SDPA backend, on every ISA level
this CPU has: ragged batches, block sizes 1/16/32, non-contiguous block tables, GQA, f32 and bf16 caches, head_dim
40/64/128/256, sliding windows, soft-capped scores (Gemma 2)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_levels import isa  # noqa: F401  (fixture)

from pdserve.model.attention import AttentionMetadata, PrefillChunk, SDPABackend

# The kernel and the reference read the same cache values (bf16 widens exactly), so both dtypes get f32 tolerances.
RTOL = ATOL = 1e-5


@dataclass
class Case:
    q: torch.Tensor  # [T, Hq, D], a strided view
    kv: torch.Tensor  # [2, NB, BS, Hkv, D]
    block_table: torch.Tensor  # int32 [S, W], garbage past each sequence's blocks
    qsl: torch.Tensor  # int32 [S + 1]
    seq_lens: torch.Tensor  # int32 [S]
    scale: float
    window: int = 0  # sliding window (0: none)
    softcap: float = 0.0  # scores s -> softcap * tanh(s / softcap) (0: none)


def make_case(ctx: list[int], qlen: list[int], bs: int, hkv: int, group: int, d: int, dtype: torch.dtype,
              seed: int) -> Case:
    g = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in zip(ctx, qlen)]
    need = [math.ceil(n / bs) for n in lens]
    nb = sum(need) + 3
    width = max(need) + 2
    # unused blocks hold NaN: reading a key the sequence does not own poisons the output
    kv = torch.full((2, nb, bs, hkv, d), float("nan"), dtype=dtype)
    perm = torch.randperm(nb, generator=g)
    table = torch.randint(-1000, 1000, (len(lens), width), generator=g, dtype=torch.int32)
    used = 0
    for s, n in enumerate(need):
        blocks = perm[used:used + n]
        used += n
        table[s, :n] = blocks.to(torch.int32)
        kv[:, blocks] = torch.randn(2, n, bs, hkv, d, generator=g).to(dtype)
    t = sum(qlen)
    hq = hkv * group
    q = torch.randn(t, hq * d + 24, generator=g)[:, 8:8 + hq * d].view(t, hq, d)  # token stride != Hq * D
    qsl = torch.tensor([0, *torch.tensor(qlen).cumsum(0).tolist()], dtype=torch.int32)
    return Case(q, kv, table, qsl, torch.tensor(lens, dtype=torch.int32), 1 / math.sqrt(d) * 1.3)


def reference(c: Case) -> torch.Tensor:
    """Float64 attention: query j of sequence s sits at seq_len - q_len + j and sees keys up to its position."""
    out = torch.zeros(c.q.shape, dtype=torch.float64)
    _, _, bs, hkv, d = c.kv.shape
    group = c.q.shape[1] // hkv
    for s in range(len(c.seq_lens)):
        q0, q1, n = int(c.qsl[s]), int(c.qsl[s + 1]), int(c.seq_lens[s])
        blocks = c.block_table[s, :math.ceil(n / bs)].long()
        k, v = (c.kv[i, blocks].reshape(-1, hkv, d)[:n].double().repeat_interleave(group, 1) for i in (0, 1))
        scores = torch.einsum("qhd,khd->hqk", c.q[q0:q1].double(), k) * c.scale
        if c.softcap:
            scores = torch.tanh(scores / c.softcap) * c.softcap
        pos = n - (q1 - q0) + torch.arange(q1 - q0)
        key = torch.arange(n)[None, None, :]
        scores.masked_fill_(key > pos[None, :, None], float("-inf"))
        if c.window:
            scores.masked_fill_(key <= pos[None, :, None] - c.window, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def run_kernel(mod: Any, c: Case) -> torch.Tensor:
    out = torch.full(c.q.shape, float("nan"))
    mod.paged_attention(out, c.q, c.kv, c.block_table, c.qsl, c.seq_lens, c.scale, c.window, c.softcap)
    return out


def check(mod: Any, c: Case) -> None:
    torch.testing.assert_close(run_kernel(mod, c).double(), reference(c), rtol=RTOL, atol=ATOL)


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), bs=st.sampled_from([1, 16, 32]), hkv=st.integers(1, 4), group=st.sampled_from([1, 3, 4]),
       d=st.sampled_from([64, 128, 40, 256]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       nseq=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_paged_attention_random(isa: Any, data: st.DataObject, bs: int, hkv: int, group: int, d: int,  # noqa: F811
                                dtype: torch.dtype, nseq: int, seed: int) -> None:
    ctx = data.draw(st.lists(st.integers(0, 300), min_size=nseq, max_size=nseq))
    qlen = data.draw(st.lists(st.sampled_from([1, 1, 2, 5, 17, 70]), min_size=nseq, max_size=nseq))
    check(isa, make_case(ctx, qlen, bs, hkv, group, d, dtype, seed))


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), bs=st.sampled_from([1, 16]), group=st.sampled_from([1, 4]), d=st.sampled_from([64, 128, 256]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), window=st.sampled_from([1, 7, 100, 300]),
       nseq=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_sliding_window(isa: Any, data: st.DataObject, bs: int, group: int, d: int, dtype: torch.dtype,  # noqa: F811
                        window: int, nseq: int, seed: int) -> None:
    """Gemma 3's local layers: a row at position p sees keys p - window < j <= p only (ragged batches of decodes and
    chunks whose rows' windows start in different blocks and key partitions; NaN in the blocks before a window is
    still only read where the window reaches)."""
    ctx = data.draw(st.lists(st.integers(0, 700), min_size=nseq, max_size=nseq))
    qlen = data.draw(st.lists(st.sampled_from([1, 2, 17, 70]), min_size=nseq, max_size=nseq))
    c = make_case(ctx, qlen, bs, 2, group, d, dtype, seed)
    c.window = window
    check(isa, c)


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), bs=st.sampled_from([1, 16]), group=st.sampled_from([1, 4]), d=st.sampled_from([40, 64, 256]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), window=st.sampled_from([0, 7, 300]),
       softcap=st.sampled_from([0.5, 2.0, 50.0]), nseq=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_softcap(isa: Any, data: st.DataObject, bs: int, group: int, d: int, dtype: torch.dtype,  # noqa: F811
                 window: int, softcap: float, nseq: int, seed: int) -> None:
    """Gemma 2's attention logit soft-capping, with and without its sliding window, decodes and chunks with context
    (partitions folded)."""
    ctx = data.draw(st.lists(st.integers(0, 600), min_size=nseq, max_size=nseq))
    qlen = data.draw(st.lists(st.sampled_from([1, 2, 17, 70]), min_size=nseq, max_size=nseq))
    c = make_case(ctx, qlen, bs, 2, group, d, dtype, seed)
    c.q.mul_(2.0)  # scores of a few units: the caps 0.5 and 2 bite, 50 barely does
    c.window, c.softcap = window, softcap
    check(isa, c)


def test_softcap_changes_the_result(isa: Any) -> None:  # noqa: F811
    c = make_case([200], [20], 16, 2, 4, 64, torch.float32, 15)
    c.q.mul_(4.0)
    plain = run_kernel(isa, c)
    c.softcap = 1.0
    assert not torch.allclose(run_kernel(isa, c), plain, atol=1e-3)
    with pytest.raises(RuntimeError, match="softcap"):
        c.softcap = -1.0
        run_kernel(isa, c)


def test_sliding_window_changes_only_rows_past_it(isa: Any) -> None:  # noqa: F811
    """Rows whose position is inside the window equal plain causal attention; later rows do not."""
    c = make_case([0], [40], 16, 1, 4, 64, torch.float32, 9)
    full = run_kernel(isa, c)
    c.window = 16
    local = run_kernel(isa, c)
    assert torch.equal(local[:16], full[:16])
    assert not torch.allclose(local[16:], full[16:])
    with pytest.raises(RuntimeError, match="sliding_window"):
        c.window = -1
        run_kernel(isa, c)
    torch.set_num_threads(2)  # a lone decode splits its window's keys into partitions, the first one partial
    for window in (300, 512, 513):
        c = make_case([1500], [1], 16, 1, 4, 128, torch.float32, 10)
        c.window = window
        check(isa, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_split_keys_single_sequence(isa: Any, d: int, dtype: torch.dtype) -> None:  # noqa: F811
    """Batch 1 with a long context splits the keys into partitions (flash-decoding) and merges them."""
    torch.set_num_threads(2)
    check(isa, make_case([1500], [1], 16, 3, 3, d, dtype, 1))  # decode
    check(isa, make_case([700], [5], 32, 1, 4, d, dtype, 2))  # speculative verify: 5 rows
    check(isa, make_case([300], [40], 16, 1, 3, d, dtype, 3))  # later rows' partitions: keys past some rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_kv_heads_in_head_spans(isa: Any, dtype: torch.dtype) -> None:  # noqa: F811
    """Generated rows' work items span several KV heads (up to 64 rows: 21 heads at G = 3, so 24 heads make spans
    of 21 and 3; 64 of 64 at G = 1): every head's rows against the reference, decode and speculative verification
    rows beside a prefill chunk, a long context split into partitions, on every kernel level."""
    torch.set_num_threads(2)
    check(isa, make_case([40, 700, 0], [1, 1, 1], 16, 24, 3, 64, dtype, 11))
    check(isa, make_case([1500, 33, 90], [1, 5, 30], 16, 24, 3, 64, dtype, 12))
    check(isa, make_case([2000], [1], 16, 32, 1, 64, dtype, 13))  # one MHA sequence: one item, every head
    check(isa, make_case([300, 17], [1, 2], 32, 8, 2, 128, dtype, 14))


def test_smollm2_shapes(isa: Any) -> None:  # noqa: F811
    """SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64): a decode batch and a 512-token prefill chunk."""
    check(isa, make_case([255, 1023, 0, 17], [1, 1, 1, 1], 16, 3, 3, 64, torch.float32, 4))
    check(isa, make_case([512, 0], [1, 512], 16, 3, 3, 64, torch.bfloat16, 5))


def test_large_scores_are_stable(isa: Any) -> None:  # noqa: F811
    """Scores in the hundreds (online softmax must subtract the running max) and all-equal scores."""
    c = make_case([200], [3], 16, 1, 3, 64, torch.float32, 6)
    c.q.mul_(40.0)
    check(isa, c)
    c.kv[0].zero_()
    check(isa, c)


def test_matches_sdpa_backend(isa: Any) -> None:  # noqa: F811
    """Same step through SDPABackend (writes K/V itself) and through reshape_and_cache + paged_attention."""
    g = torch.Generator().manual_seed(7)
    bs, hkv, hq, d, nb = 16, 3, 9, 64, 40
    ctx, qlen = [30, 100, 0, 40], [1, 1, 20, 33]  # two decodes, then two prefill chunks (one with context)
    lens = [c + n for c, n in zip(ctx, qlen)]
    perm = torch.randperm(nb, generator=g)
    tables, used = [], 0
    for n in lens:
        tables.append(perm[used:used + math.ceil(n / bs)])
        used += len(tables[-1])
    cache = torch.randn(2, nb, bs, hkv, d, generator=g)
    t = sum(qlen)
    q = torch.randn(t, hq, d, generator=g)
    k, v = torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g)
    slots, starts = [], [0, *torch.tensor(qlen).cumsum(0).tolist()]
    for s in range(4):
        for p in range(ctx[s], lens[s]):
            slots.append(int(tables[s][p // bs]) * bs + p % bs)
    slot_mapping = torch.tensor(slots)
    width = max(len(b) for b in tables)
    dec = torch.zeros(2, width, dtype=torch.long)
    for s in range(2):
        dec[s, :len(tables[s])] = tables[s]
    mask = (torch.arange(width * bs)[None, :] < torch.tensor(lens[:2])[:, None]).view(2, 1, 1, -1)
    prefills = [PrefillChunk(starts[s], qlen[s], ctx[s], tables[s]) for s in (2, 3)]
    meta = AttentionMetadata(slot_mapping, 2, dec, mask, prefills)
    scale = d ** -0.5
    want = SDPABackend().forward(q, k, v, cache.clone(), meta, scale)

    mine = cache.clone()
    isa.reshape_and_cache(k, v, mine, slot_mapping)
    bt = torch.zeros(4, width, dtype=torch.int32)
    for s in range(4):
        bt[s, :len(tables[s])] = tables[s].to(torch.int32)
    out = torch.empty_like(q)
    qsl, seq_lens = torch.tensor(starts, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    isa.paged_attention(out, q, mine, bt, qsl, seq_lens, scale)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache(isa: Any, dtype: torch.dtype) -> None:  # noqa: F811
    g = torch.Generator().manual_seed(8)
    nb, bs, hkv, d, t = 6, 16, 3, 64, 20
    kv = torch.randn(2, nb, bs, hkv, d, generator=g).to(dtype)
    qkv = torch.randn(t, (9 + 2 * hkv) * d, generator=g)  # k, v: strided views of a fused projection
    k = qkv[:, 9 * d:(9 + hkv) * d].view(t, hkv, d)
    v = qkv[:, (9 + hkv) * d:].view(t, hkv, d)
    k[0, 0, :4] = torch.tensor([float("nan"), float("inf"), 1 + 2**-9, -(1 + 3 * 2**-9)])  # NaN, rounding ties
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[3] = -1  # padding token: skipped
    want = kv.clone()
    keep = slots >= 0
    want[0].view(-1, hkv, d)[slots[keep]] = k[keep].to(dtype)
    want[1].view(-1, hkv, d)[slots[keep]] = v[keep].to(dtype)
    isa.reshape_and_cache(k, v, kv, slots)
    torch.testing.assert_close(kv.float(), want.float(), rtol=0, atol=0, equal_nan=True)  # exact, RNE rounding


def test_argument_errors(isa: Any) -> None:  # noqa: F811
    c = make_case([10], [2], 16, 3, 1, 64, torch.float32, 9)
    out = torch.empty(c.q.shape)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        isa.paged_attention(out[:, :2], c.q[:, :2], c.kv, c.block_table, c.qsl, c.seq_lens, 1.0)
    with pytest.raises(RuntimeError, match="int32"):
        isa.paged_attention(out, c.q, c.kv, c.block_table.long(), c.qsl, c.seq_lens, 1.0)
    with pytest.raises(RuntimeError, match="contiguous heads"):
        isa.paged_attention(out, c.q.transpose(0, 1).contiguous().transpose(0, 1), c.kv, c.block_table, c.qsl,
                            c.seq_lens, 1.0)
    bad = c.block_table.clone()
    bad[0, 0] = 10**6
    with pytest.raises(RuntimeError, match="is not a block"):
        isa.paged_attention(out, c.q, c.kv, bad, c.qsl, c.seq_lens, 1.0)
    with pytest.raises(RuntimeError, match="exceeds seq_len"):
        isa.paged_attention(out, c.q, c.kv, c.block_table, c.qsl, torch.tensor([1], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="past the cache"):
        isa.reshape_and_cache(torch.randn(1, 3, 64), torch.randn(1, 3, 64), c.kv, torch.tensor([10**6]))

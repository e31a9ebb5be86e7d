"""FlexBackend (model/flex_attention.py) against float64 attention and the SDPA backend on ragged batches: decodes,
multi-token decode rows and prefill chunks with context, GQA, block sizes 1/16/32, non-contiguous block tables with
garbage past each sequence's blocks, f32 and bf16 caches; and the block mask's sparse structure itself."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernels_attention import Case, make_case, reference

from pdserve.model.attention import AttentionMetadata, PrefillChunk, SDPABackend
from pdserve.model.flex_attention import Q_BLOCK, FlexBackend, build_block_mask


def _finite(c: Case, seed: int) -> Case:
    """Unowned blocks hold huge finite garbage instead of NaN: the dense/eager paths weigh masked keys by exactly 0,
    and 0 x NaN is NaN, but a masked key read with weight > 0 still ruins the result."""
    g = torch.Generator().manual_seed(seed)
    garbage = (torch.rand(c.kv.shape, generator=g) * 2e3 - 1e3).to(c.kv.dtype)
    c.kv.copy_(torch.where(c.kv.isnan(), garbage, c.kv))
    return c


def _step(c: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slot_mapping, positions, k, v) of the query rows: the rows' own K/V as already in the cache, so the
    backends' write is a no-op and every backend sees the same cache."""
    bs = c.kv.shape[2]
    slots, pos = [], []
    for s in range(len(c.seq_lens)):
        n, q = int(c.seq_lens[s]), int(c.qsl[s + 1] - c.qsl[s])
        for p in range(n - q, n):
            pos.append(p)
            slots.append(int(c.block_table[s, p // bs]) * bs + p % bs)
    slot_mapping = torch.tensor(slots, dtype=torch.long)
    _, nb, _, h, d = c.kv.shape
    k = c.kv[0].reshape(nb * bs, h, d)[slot_mapping].clone()
    v = c.kv[1].reshape(nb * bs, h, d)[slot_mapping].clone()
    return slot_mapping, torch.tensor(pos, dtype=torch.long), k, v


def run_flex(c: Case, mode: str) -> torch.Tensor:
    slot_mapping, positions, k, v = _step(c)
    meta = AttentionMetadata(slot_mapping, 0, None, None, [], block_table=c.block_table, query_start_loc=c.qsl,
                             seq_lens=c.seq_lens)
    backend = FlexBackend("cpu", mode)
    backend.prepare(meta, positions, c.kv.shape[1], c.kv.shape[2])
    return backend.forward(c.q.to(c.kv.dtype), k, v, c.kv, meta, c.scale)


def run_sdpa(c: Case) -> torch.Tensor:
    """The same step in SDPABackend's form: leading one-token rows as batched decodes, the rest as chunks."""
    slot_mapping, _, k, v = _step(c)
    bs, lens = c.kv.shape[2], c.seq_lens.tolist()
    qlen = (c.qsl[1:] - c.qsl[:-1]).tolist()
    nd = next((i for i, n in enumerate(qlen) if n != 1), len(qlen))
    tables = [c.block_table[s, :math.ceil(lens[s] / bs)].long() for s in range(len(lens))]
    dec = mask = None
    if nd:
        width = max(len(t) for t in tables[:nd])
        dec = torch.zeros(nd, width, dtype=torch.long)
        for s in range(nd):
            dec[s, :len(tables[s])] = tables[s]
        mask = (torch.arange(width * bs)[None, :] < torch.tensor(lens[:nd])[:, None]).view(nd, 1, 1, -1)
    chunks = [PrefillChunk(int(c.qsl[s]), qlen[s], lens[s] - qlen[s], tables[s]) for s in range(nd, len(lens))]
    meta = AttentionMetadata(slot_mapping, nd, dec, mask, chunks)
    return SDPABackend().forward(c.q.to(c.kv.dtype), k, v, c.kv, meta, c.scale)


def check(c: Case, mode: str, vs_sdpa: bool = True) -> None:
    tol = 1e-5 if c.kv.dtype == torch.float32 else 2e-2  # bf16: the backends compute in the cache's dtype
    want = reference(c)
    got = run_flex(c, mode)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    if vs_sdpa:  # (SDPA's decode rows gather padding block 0: NaN there would poison them)
        torch.testing.assert_close(got, run_sdpa(c), rtol=tol, atol=tol)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(data=st.data(), bs=st.sampled_from([1, 16, 32]), hkv=st.integers(1, 4), group=st.sampled_from([1, 3, 4]),
       d=st.sampled_from([64, 40]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       nseq=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_dense_mode_random(data: st.DataObject, bs: int, hkv: int, group: int, d: int, dtype: torch.dtype,
                           nseq: int, seed: int) -> None:
    ctx = data.draw(st.lists(st.integers(0, 200), min_size=nseq, max_size=nseq))
    qlen = data.draw(st.lists(st.sampled_from([1, 1, 2, 5, 17, 40]), min_size=nseq, max_size=nseq))
    check(_finite(make_case(ctx, qlen, bs, hkv, group, d, dtype, seed), seed), "dense")


@pytest.mark.parametrize("mode", ["dense", "eager"])
def test_decodes_spec_rows_and_chunks(mode: str) -> None:
    """Two decodes, a 5-row speculative decode, a chunk with context and a fresh prompt, SmolLM2's head shape."""
    check(_finite(make_case([30, 100, 64, 40, 0], [1, 1, 5, 33, 20], 16, 3, 3, 64, torch.float32, 7), 7), mode)


@given(data=st.data(), bs=st.sampled_from([1, 4, 16]), nseq=st.integers(1, 40), seed=st.integers(0, 2**16))
@settings(max_examples=40, deadline=None, derandomize=True)
def test_block_mask_lists_exactly_the_tiles_blocks(data: st.DataObject, bs: int, nseq: int, seed: int) -> None:
    """The sparse structure the compiled kernel follows: tile t lists exactly the blocks owned by the sequences
    with a row in it (so no visible key is skipped and no foreign block is loaded), and the mask function admits
    exactly each row's own keys up to its position."""
    ctx = data.draw(st.lists(st.integers(0, 60), min_size=nseq, max_size=nseq))
    qlen = data.draw(st.lists(st.sampled_from([1, 1, 3, 20]), min_size=nseq, max_size=nseq))
    c = make_case(ctx, qlen, bs, 1, 1, 8, torch.float32, seed)
    nb = c.kv.shape[1]
    _, positions, _, _ = _step(c)
    bm = build_block_mask(c.block_table, c.qsl, c.seq_lens, positions, nb, bs)
    t = positions.shape[0]
    owned: list[set[int]] = []
    row_seq: list[int] = []
    for s in range(nseq):
        owned.append(set(c.block_table[s, :math.ceil(int(c.seq_lens[s]) / bs)].tolist()))
        row_seq += [s] * qlen[s]
    for tile in range(-(-t // Q_BLOCK)):
        n = int(bm.kv_num_blocks[0, 0, tile])
        listed = set(bm.kv_indices[0, 0, tile, :n].tolist())
        seqs = set(row_seq[tile * Q_BLOCK:(tile + 1) * Q_BLOCK])
        assert listed == set().union(*(owned[s] for s in seqs))
    from torch.nn.attention.flex_attention import create_mask

    dense = create_mask(bm.mask_mod, None, None, t, nb * bs, device="cpu")[0, 0]
    want = torch.zeros(t, nb * bs, dtype=torch.bool)
    for i, (s, p) in enumerate(zip(row_seq, positions.tolist())):
        for j in range(p + 1):
            want[i, int(c.block_table[s, j // bs]) * bs + j % bs] = True
    assert torch.equal(dense, want)


@pytest.mark.slow
def test_compiled_flex_on_cpu_skips_unowned_blocks() -> None:
    """torch.compile'd flex_attention (the kernel cuda runs) compiles on cpu too: with NaN in every block no
    sequence owns, the output is finite and right only if the kernel loads no unlisted block. About 90 s of
    compilation on a 2-core machine."""
    c = make_case([30, 100, 64, 0], [1, 1, 5, 20], 16, 3, 3, 64, torch.float32, 9)
    assert c.kv.isnan().any()
    check(c, "compiled", vs_sdpa=False)

"""Prompt rows on fp32 FMAs in transposed key tiles (csrc/attention_avx512_tiles.cpp): every cache format at the
avx512 level, f32 caches above it (bf16 and quantized caches there take bf16 dot products). Against a float64
reference over the values the cache stores (quantized: code x scale, exact in fp32) within fp32 tolerances, and a
prompt row's bits do not depend on the chunk it comes in, the rows beside it or the thread count."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_levels import lowered, module
from test_kernels_attention import Case, make_case, reference

from pdserve.model.kv_cache_dtype import dequantize_kv, quantize_kv

FORMATS = (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn)
# (level, cache dtype) pairs whose prompt rows take the fp32 tiles
TILE_CASES = [("avx512", f) for f in FORMATS] + [("avx512_bf16", torch.float32), ("amx", torch.float32)]


@pytest.fixture(autouse=True)
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def stored(c: Case, dtype: torch.dtype) -> tuple[Case, Case]:
    """The case's cache in `dtype`, and the same values in an f32 cache (what the reference reads)."""
    if dtype in (torch.float32, torch.bfloat16):
        kv = c.kv.to(dtype)
        return Case(c.q, kv, c.block_table, c.qsl, c.seq_lens, c.scale), Case(
            c.q, kv.float(), c.block_table, c.qsl, c.seq_lens, c.scale)
    codes = quantize_kv(c.kv, dtype)
    return (Case(c.q, codes.view(dtype), c.block_table, c.qsl, c.seq_lens, c.scale),
            Case(c.q, dequantize_kv(codes, dtype, torch.float32), c.block_table, c.qsl, c.seq_lens, c.scale))


def prompt_run(mod: object, c: Case) -> torch.Tensor:
    """Every row a prompt row (prompt_lens = seq_lens)."""
    out = torch.full(c.q.shape, float("nan"))
    mod.paged_attention(out, c.q, c.kv, c.block_table, c.qsl, c.seq_lens, c.scale, 0, 0.0,  # type: ignore[attr-defined]
                        c.seq_lens)
    return out


@pytest.mark.parametrize(("level", "dtype"), TILE_CASES)
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), bs=st.sampled_from([1, 16, 32]), hkv=st.integers(1, 3), group=st.sampled_from([1, 3, 4]),
       d=st.sampled_from([64, 128]), nseq=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_fp32_tiles_against_reference(level: str, dtype: torch.dtype, data: st.DataObject, bs: int, hkv: int,
                                      group: int, d: int, nseq: int, seed: int) -> None:
    ctx = data.draw(st.lists(st.integers(0, 600), min_size=nseq, max_size=nseq))
    qlen = data.draw(st.lists(st.sampled_from([1, 2, 15, 17, 70]), min_size=nseq, max_size=nseq))
    for mod in lowered(module(), level):
        assert mod.attention_kernels(d, str(dtype).removeprefix("torch."), group)[0] == "avx512_tiles"
        torch.set_num_threads(2)
        c, values = stored(make_case(ctx, qlen, bs, hkv, group, d, torch.float32, seed), dtype)
        torch.testing.assert_close(prompt_run(mod, c).double(), reference(values), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("level", "dtype"), TILE_CASES)
def test_long_prompt_and_large_scores(level: str, dtype: torch.dtype) -> None:
    """A 512-row chunk after 300 keys of context (partitions of 256 folded) and scores in the hundreds, where a score's
    rounding (one chain over d) moves its probability: within 3x the error of the same rows on the fp32 row kernel
    (no prompt_lens) and 1e-4 absolute."""
    for mod in lowered(module(), level):
        c, values = stored(make_case([300, 0], [1, 512], 16, 2, 3, 64, torch.float32, 5), dtype)
        c.q.mul_(30.0)
        want = reference(values)
        rows = torch.full(c.q.shape, float("nan"))
        mod.paged_attention(rows, c.q, c.kv, c.block_table, c.qsl, c.seq_lens, c.scale)
        tiles_err = float((prompt_run(mod, c).double() - want).abs().max())
        assert tiles_err <= max(3 * float((rows.double() - want).abs().max()), 1e-6) and tiles_err <= 1e-4


@pytest.mark.parametrize(("level", "dtype"), TILE_CASES)
def test_prompt_row_bits_do_not_depend_on_the_chunk(level: str, dtype: torch.dtype) -> None:
    """Row r of a 700-token prompt: the same bits in the whole prompt, in a chunk of 5 rows ending at it, in a chunk of
    40 rows starting at it (another row block position), alone, and beside another sequence; 1 and 2 threads."""
    length, hkv, group, d = 700, 2, 3, 64
    whole, _ = stored(make_case([0], [length], 16, hkv, group, d, torch.float32, 9), dtype)
    other, _ = stored(make_case([90], [33], 16, hkv, group, d, torch.float32, 10), dtype)

    def chunk(mod: object, a: int, b: int, beside: bool = False) -> torch.Tensor:
        """Rows [a, b) of the prompt as one chunk (keys < b); with `beside`, after the other sequence's rows."""
        nb_whole = whole.kv.shape[1]
        kv = whole.kv
        if beside:  # as bytes: fp8 tensors have no cat
            kv = torch.cat([whole.kv.view(torch.uint8), other.kv.view(torch.uint8)], dim=1).view(whole.kv.dtype)
        tables = [whole.block_table[0]]
        qs = [whole.q[a:b]]
        lens = [b]
        if beside:
            width = max(whole.block_table.shape[1], other.block_table.shape[1])
            tables = [torch.nn.functional.pad(other.block_table[0] + nb_whole, (0, width - other.block_table.shape[1])),
                      torch.nn.functional.pad(whole.block_table[0], (0, width - whole.block_table.shape[1]))]
            qs = [other.q, whole.q[a:b]]
            lens = [int(other.seq_lens[0]), b]
        q = torch.cat(qs)
        qsl = torch.tensor([0, *torch.tensor([len(x) for x in qs]).cumsum(0).tolist()], dtype=torch.int32)
        c = Case(q, kv, torch.stack(tables).to(torch.int32), qsl, torch.tensor(lens, dtype=torch.int32), whole.scale)
        return prompt_run(mod, c)[int(qsl[-2]):]

    for mod in lowered(module(), level):
        for r in (0, 17, 255, 256, 511, 699):
            want = None
            for threads in (1, 2):
                torch.set_num_threads(threads)
                got = [chunk(mod, 0, length)[r], chunk(mod, max(0, r - 4), r + 1)[-1],
                       chunk(mod, r, min(length, r + 40))[0], chunk(mod, r, r + 1)[0],
                       chunk(mod, max(0, r - 4), r + 1, beside=True)[-1]]
                want = got[0] if want is None else want
                assert not bool(want.isnan().any())
                for i, x in enumerate(got):
                    assert torch.equal(x, want), (level, dtype, r, threads, i)


def test_soft_caps_and_sliding_windows_keep_the_row_kernel() -> None:
    """Soft-capped scores (the row kernels apply the cap) and sliding windows (every prompt group one token) keep
    the fp32 row kernel for prompt rows: prompt_lens changes nothing."""
    for mod in lowered(module(), "avx512"):
        assert mod.attention_kernels(64, "float32", 3, False, True)[0] == "avx512"
        assert mod.attention_kernels(64, "float32", 3, True)[0] == "avx512"
        c = make_case([40], [60], 16, 2, 3, 64, torch.float32, 21)
        for window, cap in ((16, 0.0), (0, 2.0)):
            plain, mixed = torch.full(c.q.shape, float("nan")), torch.full(c.q.shape, float("nan"))
            mod.paged_attention(plain, c.q, c.kv, c.block_table, c.qsl, c.seq_lens, c.scale, window, cap)
            mod.paged_attention(mixed, c.q, c.kv, c.block_table, c.qsl, c.seq_lens, c.scale, window, cap, c.seq_lens)
            assert torch.equal(mixed, plain), (window, cap)

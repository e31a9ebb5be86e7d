"""--kv-cache-dtype int8 / fp8 (e4m3, e5m2): the row format (model/kv_cache_dtype.py, kernels/csrc/kv_quant.h), the
native reshape_and_cache bit-exact with the PyTorch quantizer, paged attention on quantized caches against a float64
reference on the dequantized values on every ISA level this CPU has, and the SDPA reference path equal to the native
one on the same step."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kernel_levels import isa  # noqa: F401  (fixture)
from test_kernels_attention import Case, make_case, reference, run_kernel

from pdserve.config import EngineConfig, ModelArchConfig, kv_cache_dtype_name, kv_row_bytes
from pdserve.model.attention import AttentionMetadata, PrefillChunk, SDPABackend
from pdserve.model.kv_cache_dtype import dequantize_kv, kv_row_elements, quantize_kv

QUANTIZED = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
# half an ulp of the format's code relative to |x| (fp8 normals), and the format's smallest step in code units
REL = {torch.int8: 0.0, torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3}
ABS = {torch.int8: 0.5, torch.float8_e4m3fn: 2**-10, torch.float8_e5m2: 2**-17}


def rows(seed: int, n: int = 64, d: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, d, generator=g) * torch.logspace(-3, 3, n)[:, None, None]  # magnitudes over 6 decades
    x[0, 0] = 0.0  # a zero row: scale 0
    x[1, 1, 5] = 1e4  # one outlier
    x[2, 2] = torch.linspace(-1, 1, d)
    return x


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_round_trip_bounds(dtype: torch.dtype) -> None:
    x = rows(1)
    q = quantize_kv(x, dtype)
    assert q.dtype == torch.uint8 and q.shape == (*x.shape[:-1], x.shape[-1] + 2)
    back = dequantize_kv(q, dtype)
    scale = q[..., -2:].contiguous().view(torch.bfloat16).float()
    err = (back - x).abs()
    bound = REL[dtype] * x.abs() + ABS[dtype] * scale
    assert (err <= bound * (1 + 1e-6) + 1e-12).all()
    assert (back[0, 0] == 0).all()
    amax = x.abs().amax(-1, keepdim=True)
    assert ((back.abs().amax(-1, keepdim=True) - amax).abs() <= REL[dtype] * amax + ABS[dtype] * scale).all()


def test_names_and_sizes() -> None:
    assert kv_cache_dtype_name("fp8", "float32") == "float8_e4m3fn"
    assert kv_cache_dtype_name("fp8_e5m2", "float32") == "float8_e5m2"
    assert kv_cache_dtype_name("auto", "bf16") == "bfloat16"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
    assert kv_row_bytes("int8", 64) == 66 and kv_row_bytes("bfloat16", 64) == 128
    assert kv_row_elements(torch.int8, 128) == 130 and kv_row_elements(torch.float32, 128) == 128
    arch = ModelArchConfig(vocab_size=10, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    assert arch.kv_bytes_per_token("int8") == 2 * 2 * 2 * 66
    assert arch.kv_bytes_per_token(torch.float32) == 2 * 2 * 2 * 256


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_reshape_and_cache_matches_torch_quantizer(isa: Any, dtype: torch.dtype) -> None:  # noqa: F811
    g = torch.Generator().manual_seed(3)
    nb, bs, hkv, d, t = 5, 16, 3, 64, 40
    x = rows(2, n=2 * t, d=d)
    k, v = x[:t], x[t:]
    cache = torch.randint(0, 255, (2, nb, bs, hkv, d + 2), generator=g, dtype=torch.uint8)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[4] = -1  # padding: skipped
    want = cache.clone()
    keep = slots >= 0
    want[0].view(-1, hkv, d + 2)[slots[keep]] = quantize_kv(k[keep], dtype)
    want[1].view(-1, hkv, d + 2)[slots[keep]] = quantize_kv(v[keep], dtype)
    isa.reshape_and_cache(k, v, cache.view(dtype), slots)
    assert torch.equal(cache, want)


def quantized_case(c: Case, dtype: torch.dtype) -> tuple[Case, Case]:
    """The case with its cache quantized (as the kernel reads it) and with those values dequantized (reference)."""
    codes = quantize_kv(c.kv, dtype)
    stored = Case(c.q, codes.view(dtype), c.block_table, c.qsl, c.seq_lens, c.scale, c.window)
    values = Case(c.q, dequantize_kv(codes, dtype), c.block_table, c.qsl, c.seq_lens, c.scale, c.window)
    return stored, values


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("d", [64, 128, 256, 40])
def test_paged_attention_quantized(isa: Any, dtype: torch.dtype, d: int) -> None:  # noqa: F811
    # decodes, a speculative row group, prefill chunks with context, a split long sequence; block sizes 16 and 1
    for bs, ctx, qlen, hkv, group in [(16, [255, 1023, 0, 17], [1, 1, 30, 5], 2, 4),
                                      (1, [40, 0], [3, 9], 1, 3),
                                      (16, [600, 20], [1, 1], 24, 1)]:  # generated rows in spans of KV heads
        stored, values = quantized_case(make_case(ctx, qlen, bs, hkv, group, d, torch.float32, d), dtype)
        torch.testing.assert_close(run_kernel(isa, stored).double(), reference(values), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, *QUANTIZED])
@pytest.mark.parametrize("group", [1, 2, 3])
def test_a_rows_arithmetic_does_not_depend_on_its_item(isa: Any, dtype: torch.dtype, group: int) -> None:  # noqa: F811
    # a decode row reads the stored rows in place, a row of a 4-token item (speculative verification) reads them
    # widened once per tile: the same row must come out bit for bit the same (greedy equality under speculation)
    case = make_case([300], [4], 16, 3, group, 64, torch.float32, 7)
    many = quantized_case(case, dtype)[0] if dtype in QUANTIZED else make_case([300], [4], 16, 3, group, 64, dtype, 7)
    hq = 3 * group
    last = many.q[3:4].clone()
    one = Case(last, many.kv, many.block_table, torch.tensor([0, 1], dtype=torch.int32), many.seq_lens, many.scale)
    torch.testing.assert_close(run_kernel(isa, one), run_kernel(isa, many)[3:4].reshape(1, hq, 64), rtol=0, atol=0)


def test_argument_errors(isa: Any) -> None:  # noqa: F811
    c = make_case([10], [2], 16, 3, 1, 64, torch.float32, 9)
    out = torch.empty(c.q.shape)
    wrong = torch.zeros(2, *c.kv.shape[1:], dtype=torch.int8)  # int8 rows of 64: no room for the scale
    with pytest.raises(RuntimeError, match="do not hold head_dim 64 codes"):
        isa.paged_attention(out, c.q, wrong, c.block_table, c.qsl, c.seq_lens, 1.0)
    with pytest.raises(RuntimeError, match="must be float32, bfloat16, int8"):
        isa.paged_attention(out, c.q, c.kv.half(), c.block_table, c.qsl, c.seq_lens, 1.0)


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_sdpa_reference_matches_native(isa: Any, dtype: torch.dtype) -> None:  # noqa: F811
    """One step (two decodes, a first prefill chunk, a chunk with cached context) through the PyTorch reference path
    (quantizes on write, dequantizes on gather) and reshape_and_cache + paged_attention: same cache bytes, same
    output."""
    g = torch.Generator().manual_seed(7)
    bs, hkv, hq, d, nb = 16, 3, 9, 64, 40
    ctx, qlen = [30, 100, 0, 40], [1, 1, 20, 33]
    lens = [c + n for c, n in zip(ctx, qlen)]
    perm = torch.randperm(nb, generator=g)
    tables, used = [], 0
    for n in lens:
        tables.append(perm[used:used + -(-n // bs)])
        used += len(tables[-1])
    cache = quantize_kv(torch.randn(2, nb, bs, hkv, d, generator=g), dtype).view(dtype)
    t = sum(qlen)
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    starts = [0, *torch.tensor(qlen).cumsum(0).tolist()]
    slot_mapping = torch.tensor([int(tables[s][p // bs]) * bs + p % bs
                                 for s in range(4) for p in range(ctx[s], lens[s])])
    width = max(len(b) for b in tables)
    bt = torch.zeros(4, width, dtype=torch.long)
    for s in range(4):
        bt[s, :len(tables[s])] = tables[s]
    mask = (torch.arange(width * bs)[None, :] < torch.tensor(lens[:2])[:, None]).view(2, 1, 1, -1)
    meta = AttentionMetadata(slot_mapping, 2, bt[:2], mask, [PrefillChunk(starts[s], qlen[s], ctx[s], tables[s])
                                                             for s in (2, 3)])
    ref_cache = cache.clone() if dtype == torch.int8 else cache.view(torch.uint8).clone().view(dtype)
    want = SDPABackend().forward(q, k, v, ref_cache, meta, d ** -0.5)
    mine = cache.view(torch.uint8).clone().view(dtype)
    isa.reshape_and_cache(k, v, mine, slot_mapping)
    assert torch.equal(mine.view(torch.uint8), ref_cache.view(torch.uint8))
    out = torch.empty_like(q)
    isa.paged_attention(out, q, mine, bt.int(), torch.tensor(starts, dtype=torch.int32),
                        torch.tensor(lens, dtype=torch.int32), d ** -0.5)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("d", [64, 24, 40])
def test_vector_quantizers_match_on_ties_and_subnormal_codes(isa: Any, dtype: torch.dtype, d: int) -> None:  # noqa: F811
    """Rows whose values sit exactly halfway between two codes (ties round to even), on both sides of the smallest
    normal fp8 code, at the format's max and at zero, with d a multiple of 16, of 8 only, and of neither: each
    level's quantizer (16 or 8 values a step, the scalar row for the rest) gives the PyTorch quantizer's bytes."""
    name = str(dtype).removeprefix("torch.")
    code_max = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}[name]
    g = torch.Generator().manual_seed(d)
    s = 2.0**-5  # a bf16 scale: amax = code_max * s exactly
    if dtype == torch.int8:
        grid = torch.arange(-127, 127, dtype=torch.float32) + 0.5  # every tie
    else:
        codes = torch.arange(0, 127, dtype=torch.uint8).view(dtype).float()  # every non-negative code value
        codes = codes[torch.isfinite(codes)]
        grid = torch.cat([codes, (codes[:-1] + codes[1:]) / 2])  # the codes and the midpoints between them
        grid = torch.cat([grid, -grid])
    n = 64
    x = grid[torch.randint(0, len(grid), (n, 3, d), generator=g)] * s
    x[..., 0] = code_max * s  # every row's absmax maps onto the format's max
    x[0, 0] = 0.0
    x[1, 1, 1:] = -0.0
    k, v = x[: n // 2], x[n // 2:]
    nb, bs = 4, 16
    cache = torch.zeros(2, nb, bs, 3, d + 2, dtype=torch.uint8)
    slots = torch.arange(n // 2)
    isa.reshape_and_cache(k, v, cache.view(dtype), slots)
    assert torch.equal(cache[0].view(-1, 3, d + 2)[: n // 2], quantize_kv(k, dtype))
    assert torch.equal(cache[1].view(-1, 3, d + 2)[: n // 2], quantize_kv(v, dtype))

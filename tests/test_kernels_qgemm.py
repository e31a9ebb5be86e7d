"""pack_gguf: GGUF block weights (Q4_0 ... Q6_K, IQ4_*) packed once, multiplied with int8 activations on every ISA
level this CPU has (csrc/qgemm*.cpp).

- dequantize() and rows() are bitwise equal to gguf.quants.dequantize of the stored blocks;
- forward equals a float64 reference of (dequantized W) x (x after the kernels' int8 quantization: per 32 values
  d = amax/127, q = round half to even (x * (1/d))) within the fp32 rounding of its operation count, and stays within
  the activation quantization error of the fp32 product;
- batch invariance: a row's output is bitwise the same whatever M, the other rows, the thread count, the path
  (few rows, many rows, AMX tiles) and the ISA level.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_levels import (
    isa_all,  # noqa: F401  (fixture: each test marked with it runs on every ISA level)
    lowered,
)

import pdserve.kernels as K
from pdserve.kernels.gguf_random import BLOCKS, random_blocks

gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.skipif(not K.available(), reason="native kernels not built (python -m pdserve.kernels)")
LEVELS = ("generic", "avx2", "avx512", "amx")  # avx512_bf16 runs the avx512 entries
TYPES = tuple(BLOCKS)
SETTINGS = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
EPS32 = 2.0**-24
# Bytes of each min type's quant values in its block (zeroed, the block dequantizes to its min term alone).
QUANT_BYTES = {"Q4_1": (4, 20), "Q5_1": (4, 24), "Q2_K": (16, 80), "Q4_K": (16, 144), "Q5_K": (16, 176)}


@pytest.fixture(scope="module")
def mod() -> Any:
    return K.require()


def ggml_type(name: str) -> int:
    return BLOCKS[name][0]


def block_values(name: str) -> int:
    return BLOCKS[name][1]


def dequant_ref(w: np.ndarray, name: str, k: int) -> np.ndarray:
    return gguf.quants.dequantize(w, gguf.GGMLQuantizationType(ggml_type(name))).reshape(w.shape[0], k)


def quantize_acts(x: np.ndarray) -> np.ndarray:
    """x as the kernels see it after int8 quantization (float64): per 32 values d = amax/127, q = rint(x * (1/d))."""
    b = x.reshape(x.shape[0], -1, 32)
    d = np.abs(b).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    q = np.rint(b * inv)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


def magnitudes(w: np.ndarray, name: str, k: int) -> np.ndarray:
    """|scale part| + |min part| of every dequantized weight: the size of the terms the kernels sum separately."""
    deq = dequant_ref(w, name, k).astype(np.float64)
    if name not in QUANT_BYTES:
        return np.abs(deq)
    qb, bb = block_values(name), BLOCKS[name][2]
    lo, hi = QUANT_BYTES[name]
    blocks = w.reshape(w.shape[0], k // qb, bb).copy()
    blocks[..., lo:hi] = 0
    mins = dequant_ref(blocks.reshape(w.shape), name, k).astype(np.float64)
    return np.abs(deq - mins) + np.abs(mins)


def check_forward(y: np.ndarray, x: np.ndarray, w: np.ndarray, name: str, k: int, bias: np.ndarray | None) -> None:
    """y within the fp32 rounding bound of the kernels' operation count of the float64 reference."""
    xq = quantize_acts(x)
    ref = xq @ dequant_ref(w, name, k).astype(np.float64).T
    scale = np.abs(xq) @ magnitudes(w, name, k).T
    if bias is not None:
        ref = ref + bias
        scale = scale + np.abs(bias)
    ops = 2 * k // 16 + 8  # per output: two fp32 roundings per sub-block (>= 16 values), the bias and slack
    assert y.dtype == np.float32 and y.shape == ref.shape
    np.testing.assert_array_less(np.abs(y - ref), ops * EPS32 * scale + 1e-30)


def random_acts(rng: np.random.Generator, m: int, k: int) -> np.ndarray:
    x = rng.standard_normal((m, k)).astype(np.float32) * rng.uniform(0.1, 4.0, size=(m, 1)).astype(np.float32)
    if m > 1:
        x[1, :32] = 0.0  # an all-zero block: scale 0
    return x


def pack(mod: Any, w: np.ndarray, name: str, k: int) -> Any:
    return mod.pack_gguf(torch.from_numpy(w), ggml_type(name), k)


@pytest.mark.usefixtures("isa_all")
@pytest.mark.parametrize("name", TYPES)
@SETTINGS
@given(n=st.integers(1, 40), blocks=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_dequantize_and_rows_bitwise(mod: Any, name: str, n: int, blocks: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    k = block_values(name) * blocks * (3 if block_values(name) == 32 else 1)
    w = random_blocks(rng, n, k, name)
    pw = pack(mod, w, name, k)
    assert (pw.n, pw.k, pw.shape, pw.type_name) == (n, k, (n, k), name)
    ref = dequant_ref(w, name, k)
    np.testing.assert_array_equal(pw.dequantize().numpy().view(np.uint32), ref.view(np.uint32))
    ids = rng.integers(0, n, size=(2, 3))
    np.testing.assert_array_equal(pw.rows(torch.from_numpy(ids)).numpy().view(np.uint32), ref[ids].view(np.uint32))


shapes = st.tuples(st.integers(1, 300), st.integers(1, 40), st.integers(1, 3))


@pytest.mark.usefixtures("isa_all")
@pytest.mark.parametrize("name", TYPES)
@SETTINGS
@given(shape=shapes, seed=st.integers(0, 2**31), with_bias=st.booleans())
def test_forward_matches_reference(mod: Any, name: str, shape: tuple[int, int, int], seed: int,
                                   with_bias: bool) -> None:
    m, n, blocks = shape
    if mod.active_isa() == "generic":
        m = min(m, 40)  # the scalar reference level is slow
    k = block_values(name) * blocks * (5 if block_values(name) == 32 else 1)
    rng = np.random.default_rng(seed)
    x, w = random_acts(rng, m, k), random_blocks(rng, n, k, name)
    bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
    y = pack(mod, w, name, k).forward(torch.from_numpy(x), None if bias is None else torch.from_numpy(bias))
    check_forward(y.numpy(), x, w, name, k, bias)


@pytest.mark.parametrize("name", TYPES)
def test_close_to_fp32_product(mod: Any, name: str) -> None:
    """The int8 activations cost at most the expected quantization error against x @ W.T in float64."""
    rng = np.random.default_rng(ggml_type(name))
    m, n, k = 24, 48, 512
    x, w = random_acts(rng, m, k), random_blocks(rng, n, k, name)
    y = pack(mod, w, name, k).forward(torch.from_numpy(x)).numpy().astype(np.float64)
    exact = x.astype(np.float64) @ dequant_ref(w, name, k).astype(np.float64).T
    rel = np.linalg.norm(y - exact) / np.linalg.norm(exact)
    assert 1e-4 < rel < 1.5e-2, rel  # int8 per 32 values: ~0.5 % here (not exact: the test checks the rounding)


def outputs_of_rows(mod: Any, pw: Any, x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    return pw.forward(torch.from_numpy(x[rows])).numpy()


@pytest.mark.parametrize("name", TYPES)
def test_batch_invariance(mod: Any, name: str) -> None:
    """Row r's output is bitwise the same with M = 1-5, 12, 17, 64, 300 (mixed with other random rows), with 1 or 2
    threads, and on every ISA level this CPU has (every path: few-row tiles, whole-panel tiles, AMX tiles)."""
    rng = np.random.default_rng(100 + ggml_type(name))
    n, k = 37, 2 * 256
    x, w = random_acts(rng, 300, k), random_blocks(rng, n, k, name)
    pw = pack(mod, w, name, k)
    ref = None
    threads = torch.get_num_threads()
    for level in LEVELS:
        if not mod.cpu_supports(level):
            continue
        for _ in lowered(mod, level):
            full = outputs_of_rows(mod, pw, x, np.arange(300))
            if ref is None:
                ref = full
            np.testing.assert_array_equal(full.view(np.uint32), ref.view(np.uint32), err_msg=level)
            for m in (1, 2, 3, 4, 5, 12, 17, 64):
                rows = rng.choice(300, size=m, replace=False)
                got = outputs_of_rows(mod, pw, x, rows)
                np.testing.assert_array_equal(got.view(np.uint32), ref[rows].view(np.uint32), err_msg=f"{level} M={m}")
            torch.set_num_threads(1)
            try:
                one = outputs_of_rows(mod, pw, x, np.arange(64))
            finally:
                torch.set_num_threads(threads)
            np.testing.assert_array_equal(one.view(np.uint32), ref[:64].view(np.uint32), err_msg=f"{level} 1 thread")


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q4_0"])
def test_long_rows_in_blocks_of_panels(mod: Any, name: str) -> None:
    """At K = 8192 and more rows than the register path takes, each thread decodes blocks of a few panels (a Q4_K
    panel decodes to 163 KiB) and runs the row tiles over pairs of them; an odd panel count and a partial last panel
    run alone. Every level gives the generic level's bits."""
    rng = np.random.default_rng(7 + ggml_type(name))
    m, n, k = 70, 5 * 16 + 3, 8192
    x, w = random_acts(rng, m, k), random_blocks(rng, n, k, name)
    pw = pack(mod, w, name, k)
    ref = None
    for level in LEVELS:
        if not mod.cpu_supports(level):
            continue
        for _ in lowered(mod, level):
            got = pw.forward(torch.from_numpy(x)).numpy()
        if ref is None:
            ref = got
        np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32), err_msg=level)


@pytest.mark.usefixtures("isa_all")
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q5_0", "Q8_0", "IQ4_XS"])
def test_slabs_give_the_bits_of_forward(mod: Any, name: str) -> None:
    """forward_slab over consecutive K ranges (the accumulators carried in y, bias in the last) and over column
    ranges gives forward's bits, at every row count's path; on the amx level (prompt rows' own arithmetic) the
    weight takes no slabs and writes nothing."""
    rng = np.random.default_rng(ggml_type(name))
    n, k = 83, 1024
    w = pack(mod, random_blocks(rng, n, k, name), name, k)
    stacked = mod.stack_packed([pack(mod, random_blocks(rng, 40, k, name), name, k), w])
    takes = mod.active_isa() != "amx"
    assert w.takes_slabs is takes and stacked.takes_slabs is takes
    for m in (1, 5, 70, 300):
        x = torch.from_numpy(random_acts(rng, m, k))
        for pw, cols, (c0, c1) in ((w, n, (32, 83)), (stacked, 40 + n, (32, 88))):
            bias = torch.randn(cols)
            full = pw.forward(x, bias)
            y = torch.full((m, cols), float("nan"))
            cuts = [0, 256, 768, k]
            for i in range(3):
                xs, last = x[:, cuts[i]:cuts[i + 1]], i == 2
                assert pw.forward_slab(xs, y, 0, cuts[i], i > 0, bias if last else None) is takes
            part = torch.full((m, c1 - c0), float("nan"))  # to w's last column; across the stacked parts' boundary
            assert pw.forward_slab(x, part, c0, 0, False, bias[c0:c1]) is takes
            if takes:
                assert torch.equal(y, full), (m, pw.type_name)
                assert torch.equal(part, full[:, c0:c1]), (m, pw.type_name)
            else:
                assert bool(y.isnan().all())
                continue
            # x quantized once for several column slabs (kept, then reused); a kept quantization of another x (or
            # shape) is not reused
            a, b, c = (torch.full((m, 16), float("nan")) for _ in range(3))
            x2 = x * 2
            assert pw.forward_slab(x, a, 0, 0, False, None, 1) and pw.forward_slab(x, b, 16, 0, False, None, 2)
            assert pw.forward_slab(x2, c, 16, 0, False, None, 2)
            assert torch.equal(a, pw.forward(x)[:, :16]) and torch.equal(b, pw.forward(x)[:, 16:32])
            assert torch.equal(c, pw.forward(x2)[:, 16:32])


@pytest.mark.usefixtures("isa_all")
@pytest.mark.parametrize("name", TYPES)
def test_zero_blocks_and_zero_rows(mod: Any, name: str) -> None:
    """All-zero blocks (scale 0) and all-zero activation rows give exact zeros, never NaN."""
    k = block_values(name) * 2
    w = np.zeros((20, k // block_values(name) * BLOCKS[name][2]), dtype=np.uint8)
    x = np.random.default_rng(0).standard_normal((3, k)).astype(np.float32)
    x[1] = 0.0
    pw = pack(mod, w, name, k)
    assert not pw.dequantize().isnan().any()
    y = pw.forward(torch.from_numpy(x))
    assert torch.equal(y, torch.zeros(3, 20))
    w2 = random_blocks(np.random.default_rng(1), 20, k, name)
    y2 = pack(mod, w2, name, k).forward(torch.from_numpy(x))
    assert torch.equal(y2[1], torch.zeros(20)) and not y2.isnan().any()


@pytest.mark.usefixtures("isa_all")
@pytest.mark.parametrize("m", [1, 3, 9, 40])
def test_strided_rows_and_bias(mod: Any, m: int) -> None:
    rng = np.random.default_rng(m)
    name, n, k = "Q4_K", 33, 256
    wide = torch.from_numpy(random_acts(rng, m, k + 48))
    x = wide[:, 16:16 + k]  # row stride k + 48, last dim contiguous
    w = random_blocks(rng, n, k, name)
    bias = rng.standard_normal(n).astype(np.float32)
    y = pack(mod, w, name, k).forward(x, torch.from_numpy(bias)).numpy()
    check_forward(y, x.contiguous().numpy(), w, name, k, bias)


def test_packed_bytes_near_the_file(mod: Any) -> None:
    """A decode step streams the packed bytes: within 1.04x of the GGUF bytes (K-quants' 6-bit scales widened to
    bytes, 16 columns a panel)."""
    rng = np.random.default_rng(0)
    for name in TYPES:
        w = random_blocks(rng, 64, 512, name)
        ratio = pack(mod, w, name, 512).nbytes / w.nbytes
        assert 1.0 <= ratio <= 1.04, (name, ratio)


def test_errors(mod: Any) -> None:
    w = torch.from_numpy(random_blocks(np.random.default_rng(0), 4, 256, "Q4_K"))
    cases = [
        (lambda: mod.pack_gguf(w, 1, 256), "not supported"),
        (lambda: mod.pack_gguf(w, 12, 512), "bytes per row"),
        (lambda: mod.pack_gguf(w, 12, 128), "multiple of 256"),
        (lambda: mod.pack_gguf(w.float(), 12, 256), "uint8"),
        (lambda: mod.pack_gguf(w[0], 12, 256), "2-D"),
        (lambda: mod.pack_gguf(w, 12, 256).forward(torch.randn(2, 128)), "K="),
        (lambda: mod.pack_gguf(w, 12, 256).forward(torch.randn(2, 256).double()), "float32"),
        (lambda: mod.pack_gguf(w, 12, 256).forward(torch.randn(2, 256), torch.zeros(3)), "bias"),
        (lambda: mod.pack_gguf(w, 12, 256).rows(torch.tensor([4])), "out of range"),
    ]
    for fn, msg in cases:
        with pytest.raises(RuntimeError, match=msg):
            fn()
    assert mod.pack_gguf(w, 12, 256).forward(torch.zeros(0, 256)).shape == (0, 4)
    assert mod.pack_gguf_types()["Q4_K"] == 12


@pytest.mark.usefixtures("isa_all")
@pytest.mark.parametrize("m", [1, 5, 40])
def test_stacked_parts_compute_what_each_part_does(mod: Any, m: int) -> None:
    """stack_packed (a fused q/k/v of Q4_K, Q4_K and Q6_K parts): each output column is bitwise what its part
    computes alone, with the bias; rows, dequantize and the byte count follow the parts."""
    rng = np.random.default_rng(m)
    k = 256
    parts = [(name, random_blocks(rng, n, k, name)) for name, n in (("Q4_K", 48), ("Q6_K", 17), ("Q8_0", 16))]
    packed = [pack(mod, w, name, k) for name, w in parts]
    stacked = mod.stack_packed(packed)
    assert stacked.shape == (81, k) and stacked.type_name == "Q4_K+Q6_K+Q8_0"
    assert stacked.nbytes == sum(p.nbytes for p in packed)
    x = torch.from_numpy(random_acts(rng, m, k))
    bias = torch.from_numpy(rng.standard_normal(81).astype(np.float32))
    expected = torch.cat([p.forward(x, b) for p, b in zip(packed, bias.split([48, 17, 16]))], dim=1)
    assert torch.equal(stacked.forward(x, bias), expected)
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in packed]))
    ids = torch.tensor([0, 47, 48, 64, 65, 80])
    assert torch.equal(stacked.rows(ids), stacked.dequantize()[ids])
    with pytest.raises(RuntimeError, match="differ in K"):
        mod.stack_packed([packed[0], pack(mod, random_blocks(rng, 4, 512, "Q4_K"), "Q4_K", 512)])
    # parts of one type in a row share one quantization of x (a part of another type quantizes again): same bits
    same = [pack(mod, random_blocks(rng, n, k, name), name, k) for name, n in (("Q4_K", 32), ("Q4_K", 16),
                                                                              ("Q6_K", 16), ("Q4_K", 33))]
    expected = torch.cat([p.forward(x) for p in same], dim=1)
    assert torch.equal(mod.stack_packed(same).forward(x), expected)


def test_prefetch_distance_changes_speed_not_results(mod: Any) -> None:
    """The decode GEMVs' L2 prefetch distance (off, one line, the default, far past the weight's end) leaves every
    output bit as it was; a distance outside 0..1 MiB is refused."""
    before = mod.stream_prefetch_bytes()
    assert before >= 0
    rng = np.random.default_rng(7)
    k = 512
    x = random_acts(rng, 5, k)
    outs: dict[str, list[np.ndarray]] = {}
    try:
        for dist in (0, 64, before, 1 << 20):
            mod.set_stream_prefetch_bytes(dist)
            for name in ("Q4_K", "Q6_K", "Q4_0"):
                pw = pack(mod, random_blocks(np.random.default_rng(ggml_type(name)), 37, k, name), name, k)
                y = [pw.forward(torch.from_numpy(x[:m]), None).numpy() for m in (1, 5)]
                outs.setdefault(name, y)
                for got, ref in zip(y, outs[name], strict=True):
                    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32), err_msg=f"{name} {dist}")
        for bad in (-1, (1 << 20) + 1):
            with pytest.raises(RuntimeError):
                mod.set_stream_prefetch_bytes(bad)
    finally:
        mod.set_stream_prefetch_bytes(before)
    assert mod.stream_prefetch_bytes() == before

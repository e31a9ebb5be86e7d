"""Native quantized-linear kernels over GGUF blocks (Q4_0, Q4_1, Q8_0) on every ISA level this CPU has.

quantize/dequantize are bitwise equal to gguf.quants; quant_linear's default small-batch path (fp32 activations)
and its dequant path equal x @ dequantize(w).T up to float rounding; the integer path equals a float64 reference that
applies the same activation quantization (int8 per 32-block, d = amax/127, round half to even) to ~1e-5 of the
sum of absolute terms; its dequant path equals x @ dequantize(w).T; both stay close to the fp32 product.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_levels import LEVELS, lowered

import pdserve.kernels as K

gguf = pytest.importorskip("gguf")
GQT = gguf.GGMLQuantizationType
QTYPES = {2: GQT.Q4_0, 3: GQT.Q4_1, 8: GQT.Q8_0}
BLOCK_BYTES = {2: 18, 3: 20, 8: 34}

pytestmark = pytest.mark.skipif(not K.available(), reason="native kernels not built (python -m pdserve.kernels)")
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def mod() -> Any:
    return K.require()


@pytest.fixture(params=LEVELS)
def isa(request: pytest.FixtureRequest, mod: Any) -> Iterator[str]:
    for _ in lowered(mod, request.param):
        yield request.param


def random_weights(rng: np.random.Generator, n: int, k: int, qtype: int) -> np.ndarray:
    """Random GGUF bytes: every quant value occurs (Q8_0 includes -128), scales are sane fp16, Q4_1 mins too."""
    nb, bb = k // 32, BLOCK_BYTES[qtype]
    blk = rng.integers(0, 256, size=(n, nb, bb), dtype=np.uint8)
    scale = (rng.uniform(0.001, 0.05, size=(n, nb)) * rng.choice([-1, 1], size=(n, nb))).astype(np.float16)
    blk[..., 0:2] = scale.view(np.uint8).reshape(n, nb, 2)
    if qtype == 3:
        blk[..., 2:4] = rng.uniform(-0.3, 0.3, size=(n, nb)).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    return blk.reshape(n, nb * bb)


def random_acts(rng: np.random.Generator, m: int, k: int) -> np.ndarray:
    x = rng.standard_normal((m, k)).astype(np.float32) * rng.uniform(0.1, 4.0, size=(m, 1)).astype(np.float32)
    if m > 1 and k >= 64:
        x[0, 32:64] = 0.0  # an all-zero block: scale 0
    return x


def split_blocks(w: np.ndarray, qtype: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Integer weights [N, nb, 32], scales [N, nb] and Q4_1 mins, all float64: w = d * q (+ m)."""
    n, nb = w.shape[0], k // 32
    blk = w.reshape(n, nb, BLOCK_BYTES[qtype])
    d = blk[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    if qtype == 8:
        return blk[..., 2:].copy().view(np.int8).astype(np.float64), d, None
    qs = blk[..., (4 if qtype == 3 else 2):]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.float64)
    if qtype == 2:
        return q - 8, d, None
    return q, d, blk[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)


def quantize_acts_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' activation quantization: per 32-block d = amax/127 (fp32), q = rint(x * (1/d))."""
    b = x.reshape(x.shape[0], -1, 32)
    d = np.abs(b).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    q = np.rint(b * inv).astype(np.float64)
    return q, d[..., 0].astype(np.float64)


def linear_ref(x: np.ndarray, w: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray]:
    """Float64 reference of the integer path and the sum of absolute products (the fp32 rounding scale)."""
    k = x.shape[1]
    qw, dw, mw = split_blocks(w, qtype, k)
    qx, dx = quantize_acts_ref(x)
    scales = dw[None] * dx[:, None]
    terms = np.einsum("mbj,nbj->mnb", qx, qw) * scales
    abs_terms = np.einsum("mbj,nbj->mnb", np.abs(qx), np.abs(qw)) * np.abs(scales)
    if mw is not None:
        terms = terms + mw[None] * (dx * qx.sum(-1))[:, None]
        abs_terms = abs_terms + np.abs(mw[None] * (dx * qx.sum(-1))[:, None])
    return terms.sum(-1), abs_terms.sum(-1)


def gguf_dequant(w: np.ndarray, qtype: int, k: int) -> np.ndarray:
    return gguf.quants.dequantize(w, QTYPES[qtype]).reshape(w.shape[0], k)


shapes = st.tuples(st.integers(1, 600), st.integers(1, 96), st.integers(1, 24).map(lambda b: 32 * b))


@pytest.mark.parametrize("qtype", [2, 3, 8])
@SETTINGS
@given(shape=shapes, seed=st.integers(0, 2**31))
def test_int_path_matches_reference(mod: Any, isa: str, qtype: int, shape: tuple[int, int, int], seed: int) -> None:
    m, n, k = shape
    rng = np.random.default_rng(seed)
    x, w = random_acts(rng, m, k), random_weights(rng, n, k, qtype)
    y = mod.quant_linear_with(torch.from_numpy(x), torch.from_numpy(w), qtype, None, "int").numpy()
    ref, scale = linear_ref(x, w, qtype)
    assert y.shape == (m, n) and y.dtype == np.float32
    np.testing.assert_array_less(np.abs(y - ref), 2e-5 * scale + 1e-6)


@pytest.mark.parametrize("qtype", [2, 3, 8])
@SETTINGS
@given(shape=shapes, seed=st.integers(0, 2**31))
def test_f32_path_matches_dequantized_product(mod: Any, isa: str, qtype: int, shape: tuple[int, int, int],
                                              seed: int) -> None:
    """The default small-batch path (blocks dequantized in registers, fp32 activations) is x @ dequantize(w).T up to
    float summation order: no activation rounding."""
    m, n, k = shape
    rng = np.random.default_rng(seed)
    x, w = random_acts(rng, m, k), random_weights(rng, n, k, qtype)
    y = mod.quant_linear_with(torch.from_numpy(x), torch.from_numpy(w), qtype, None, "f32").numpy()
    wf = gguf_dequant(w, qtype, k).astype(np.float64)
    ref = x.astype(np.float64) @ wf.T
    scale = np.abs(x.astype(np.float64)) @ np.abs(wf).T
    assert y.shape == (m, n) and y.dtype == np.float32
    np.testing.assert_array_less(np.abs(y - ref), 2e-6 * scale + 1e-6)


@pytest.mark.parametrize("qtype", [2, 3, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 64])
def test_bias_and_strided_rows(mod: Any, isa: str, qtype: int, m: int) -> None:
    rng = np.random.default_rng(m * 10 + qtype)
    n, k = 70, 96  # odd block count: exercises the AVX-512 half pair
    wide = torch.from_numpy(random_acts(rng, m, k + 64))
    x = wide[:, 16:16 + k]  # row stride k + 64, last dim contiguous
    w = random_weights(rng, n, k, qtype)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    ref, scale = linear_ref(x.contiguous().numpy(), w, qtype)
    y = mod.quant_linear_with(x, torch.from_numpy(w), qtype, bias, "int").numpy()
    np.testing.assert_array_less(np.abs(y - ref - bias.numpy()), 2e-5 * scale + 1e-5)
    wf = torch.from_numpy(gguf_dequant(w, qtype, k))
    torch.testing.assert_close(mod.quant_linear_with(x, torch.from_numpy(w), qtype, bias, "f32"),
                               torch.addmm(bias, x, wf.t()), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mod.quant_linear_with(x, torch.from_numpy(w), qtype, bias, "dequant"),
                               torch.addmm(bias, x, wf.t()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", [2, 3, 8])
@pytest.mark.parametrize("m", [1, 16, 47, 48, 200])
def test_auto_path_close_to_fp32(mod: Any, isa: str, qtype: int, m: int) -> None:
    """Whole-result error vs the fp32 product of the dequantized weight: float rounding only, on both sides of the
    dequant threshold (the f32 path below it, dequant + GEMM from it), so a request's result does not depend on how
    many rows its step has."""
    rng = np.random.default_rng(m + qtype)
    k, n = 576, 96
    w = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, QTYPES[qtype])
    x = torch.from_numpy(random_acts(rng, m, k))
    y = mod.quant_linear(x, torch.from_numpy(w), qtype)
    exact = x @ torch.from_numpy(gguf_dequant(w, qtype, k)).t()
    rel = float((y - exact).norm() / exact.norm())
    assert rel < 1e-5, rel


@pytest.mark.parametrize("qtype", [2, 3, 8])
@SETTINGS
@given(n=st.integers(1, 70), nb=st.integers(1, 20), seed=st.integers(0, 2**31), mag=st.sampled_from([1e-6, 1.0, 300.0]))
def test_quantize_and_dequantize_bitwise(mod: Any, isa: str, qtype: int, n: int, nb: int, seed: int,
                                        mag: float) -> None:
    rng = np.random.default_rng(seed)
    k = 32 * nb
    x = (rng.standard_normal((n, k)) * mag).astype(np.float32)
    x[0, :32] = 0.0  # scale 0
    if n > 1:
        x[1, :32] = 1.5  # constant block: Q4_1 d == 0
    q = mod.quantize(torch.from_numpy(x), qtype).numpy()
    expect = gguf.quants.quantize(x, QTYPES[qtype])
    assert q.dtype == np.uint8 and q.shape == expect.shape
    np.testing.assert_array_equal(q, expect)
    deq = mod.dequantize(torch.from_numpy(q), qtype, k).numpy()
    np.testing.assert_array_equal(deq.view(np.uint32), gguf_dequant(q, qtype, k).view(np.uint32))
    w = random_weights(rng, n, k, qtype)  # every bit pattern of the quants
    np.testing.assert_array_equal(mod.dequantize(torch.from_numpy(w), qtype, k).numpy().view(np.uint32),
                                  gguf_dequant(w, qtype, k).view(np.uint32))


@pytest.mark.parametrize("qtype", [2, 3, 8])
def test_embedding(mod: Any, isa: str, qtype: int) -> None:
    rng = np.random.default_rng(qtype)
    n, k = 50, 96
    w = torch.from_numpy(random_weights(rng, n, k, qtype))
    ids = torch.tensor([3, 0, 49, 3, 17], dtype=torch.int64)
    full = torch.from_numpy(gguf_dequant(w.numpy(), qtype, k))
    assert torch.equal(mod.embedding(ids, w, qtype, k), full[ids])
    assert torch.equal(mod.embedding(ids.view(1, 5), w, qtype, k), full[ids].view(1, 5, k))
    for bad in (-1, n):
        with pytest.raises(RuntimeError, match="out of range"):
            mod.embedding(torch.tensor([0, bad]), w, qtype, k)
    with pytest.raises(RuntimeError, match="int64"):
        mod.embedding(ids.int(), w, qtype, k)


def test_errors(mod: Any) -> None:
    x = torch.randn(2, 64)
    w = torch.zeros(4, 2 * 18, dtype=torch.uint8)  # Q4_0, K = 64
    cases = [
        (lambda: mod.quant_linear(x, w, 5), "qtype"),
        (lambda: mod.quant_linear(x.double(), w, 2), "float32"),
        (lambda: mod.quant_linear(x, w.float(), 2), "uint8"),
        (lambda: mod.quant_linear(x, w[:, :35].contiguous(), 2), "blocks"),
        (lambda: mod.quant_linear(x, w, 8), "blocks"),  # 36 bytes are not Q8_0 blocks
        (lambda: mod.quant_linear(torch.randn(2, 96), w, 2), "K="),
        (lambda: mod.quant_linear(torch.randn(64, 2).t(), w, 2), "contiguous"),
        (lambda: mod.quant_linear(x, w, 2, torch.zeros(3)), "bias"),
        (lambda: mod.quant_linear(x, w, 2, torch.zeros(4, dtype=torch.float64)), "bias"),
        (lambda: mod.dequantize(w, 2, 48), "multiple of 32"),
        (lambda: mod.dequantize(w, 2, 96), "bytes per row"),
        (lambda: mod.embedding(torch.tensor([0]), w, 2, 32), "bytes per row"),
        (lambda: mod.quantize(torch.randn(3, 40), 2), "multiple of 32"),
        (lambda: mod.quantize(torch.randn(3, 64).double(), 8), "float32"),
        (lambda: mod.quantize(torch.randn(3, 64), 7), "qtype"),
    ]
    for fn, msg in cases:
        with pytest.raises(RuntimeError, match=msg):
            fn()
    assert mod.quant_linear(torch.zeros(0, 64), w, 2).shape == (0, 4)

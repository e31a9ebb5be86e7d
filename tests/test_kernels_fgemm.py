"""Float-weight PackedWeight (`pack_float`, csrc/fgemm*.cpp) on every ISA level this CPU has: bitwise batch
invariance (a row's result whatever M, the other rows, the thread count and the kernel path), bitwise equality with
a float32 emulation of the documented bf16 accumulation order, accuracy against float64, stored values, rows(ids),
odd shapes and argument errors."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from kernel_levels import isa_all  # noqa: F401  (fixture)

SHAPES = [(1, 1), (15, 3), (17, 31), (33, 33), (100, 77), (48, 64)]  # (N, K): not multiples of 16 / 32, K odd


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def amx_rows(isa_all: Any) -> Iterator[Any]:  # noqa: F811
    """Restores the AMX row threshold that a test changes."""
    before = isa_all.fgemm_amx_min_rows()
    yield isa_all
    isa_all.set_fgemm_amx_min_rows(before)


def emulate_bf16(x: torch.Tensor, w: torch.Tensor, order: str) -> torch.Tensor:
    """y = x @ w.T in float32 ops in the kernels' order (fgemm_kernels.h). x and w hold bf16 values, so every product
    is exact in float32 and each `+` below is the one rounding the kernels do."""
    m, k = x.shape
    kpad = (k + 31) // 32 * 32
    xp = torch.zeros(m, kpad)
    wp = torch.zeros(w.shape[0], kpad)
    xp[:, :k], wp[:, :k] = x, w
    acc = torch.zeros(m, w.shape[0])
    if order == "pair":
        for i in range(0, kpad, 2):
            acc = acc + xp[:, i + 1:i + 2] * wp[:, i + 1]
            acc = acc + xp[:, i:i + 1] * wp[:, i]
        return acc
    for b in range(0, kpad, 32):
        e = xp[:, b:b + 1] * wp[:, b]
        o = xp[:, b + 1:b + 2] * wp[:, b + 1]
        for i in range(b + 2, b + 32, 2):
            e = e + xp[:, i:i + 1] * wp[:, i]
            o = o + xp[:, i + 1:i + 2] * wp[:, i + 1]
        acc = acc + (e + o)
    return acc


@pytest.mark.parametrize("fmt", ["bf16", "f32"])
def test_batch_invariance(amx_rows: Any, threads: None, fmt: str) -> None:
    """Row r's output is bitwise the same alone, among 4, 16, 63 or 299 other rows, at any position, with 1 or 2
    threads, and (amx level) through AMX tiles or the FMA kernel."""
    mod = amx_rows
    n, k = 100, 77
    pw = mod.pack_float(rand(n, k), fmt)
    pool = rand(300, k, seed=1) * 3
    target = pool[7:8].clone()
    bias = rand(n, seed=2)
    results = []
    for m in (1, 5, 17, 64, 300):
        for threads_n in (1, 2):
            for amx_min in (1, 10**9):
                torch.set_num_threads(threads_n)
                mod.set_fgemm_amx_min_rows(amx_min)
                x = pool[:m].clone()
                pos = (m * 5) // 7
                x[pos] = target[0]
                results.append((f"M={m} threads={threads_n} amx_min={amx_min}", pw.forward(x, bias)[pos]))
    ref = results[0][1]
    for name, y in results:
        assert torch.equal(y, ref), f"{mod.active_isa()} {fmt}: {name} differs from M=1"


def test_bf16_matches_emulated_order(isa_all: Any) -> None:  # noqa: F811
    """Every level computes exactly its documented bf16 order; AMX tiles (amx level, many rows) included."""
    for n, k in SHAPES:
        w, x = rand(n, k, seed=n), rand(40, k, seed=k) * 2
        pw = isa_all.pack_float(w, "bf16")
        xb, wb = x.bfloat16().float(), w.bfloat16().float()
        want = emulate_bf16(xb, wb, isa_all.fgemm_bf16_order())
        assert torch.equal(pw.forward(x), want), (isa_all.active_isa(), n, k)


@pytest.mark.parametrize("fmt", ["bf16", "f32"])
def test_accuracy_against_float64(isa_all: Any, fmt: str) -> None:  # noqa: F811
    """|y - x @ W.T| (float64, W the stored values) within fp32 summation bounds, plus bf16 rounding of x (bf16)."""
    for n, k in SHAPES + [(300, 1000)]:
        w, x, bias = rand(n, k, seed=3), rand(9, k, seed=4), rand(n, seed=5)
        pw = isa_all.pack_float(w, fmt)
        stored = pw.dequantize().double()
        want = x.double() @ stored.T + bias.double()
        mag = x.double().abs() @ stored.abs().T + bias.double().abs()
        eps = (k + 2) * 2.0**-24 + (2.0**-8 if fmt == "bf16" else 0.0)
        err = (pw.forward(x, bias).double() - want).abs()
        assert (err <= eps * mag + 1e-30).all(), (isa_all.active_isa(), n, k, float((err / mag).max()))


def test_stored_values(isa_all: Any) -> None:  # noqa: F811
    """dequantize() returns what the kernels multiply by: bf16 rounding (RNE) of the source, or the source."""
    w = rand(37, 45) * 10
    assert torch.equal(isa_all.pack_float(w, "f32").dequantize(), w)
    assert torch.equal(isa_all.pack_float(w, "bf16").dequantize(), w.bfloat16().float())
    for dt in (torch.bfloat16, torch.float16):
        src = w.to(dt)
        assert torch.equal(isa_all.pack_float(src, "f32").dequantize(), src.float())
        assert torch.equal(isa_all.pack_float(src, "bf16").dequantize(), src.float().bfloat16().float())
    pw = isa_all.pack_float(w.to(torch.bfloat16), "bf16")
    assert (pw.type_name, pw.shape, pw.nbytes) == ("BF16", (37, 45), 48 * 64 * 2)  # N to 48, K to 64
    pf = isa_all.pack_float(w, "f32")
    assert (pf.type_name, pf.nbytes) == ("F32", 48 * 45 * 4)


def test_subnormals_flush_to_zero(isa_all: Any) -> None:  # noqa: F811
    """fp32 subnormals become signed zeros in bf16 (AMX and vdpbf16ps read bf16 subnormals as zero)."""
    w = torch.tensor([[1e-39, -1e-39, 2.0, 2e-38]])
    assert isa_all.pack_float(w, "bf16").dequantize().tolist() == [[0.0, -0.0, 2.0, w[0, 3].bfloat16().item()]]
    x = torch.tensor([[1.0, 1.0, 1e-39, 1.0]])
    assert isa_all.pack_float(w, "bf16").forward(x).item() == w[0, 3].bfloat16().item()


def test_rows_as_embedding(isa_all: Any) -> None:  # noqa: F811
    """rows(ids): W[ids] as float32 [*ids.shape, K] (a tied embedding table); ids out of range raise."""
    for fmt in ("bf16", "f32"):
        pw = isa_all.pack_float(rand(50, 33), fmt)
        table = pw.dequantize()
        ids = torch.tensor([[0, 49, 17], [16, 15, 0]])
        assert torch.equal(pw.rows(ids), table[ids])
        with pytest.raises(RuntimeError, match="out of range"):
            pw.rows(torch.tensor([50]))


def test_argument_errors(isa_all: Any) -> None:  # noqa: F811
    with pytest.raises(RuntimeError, match="fmt must be"):
        isa_all.pack_float(rand(4, 4), "q4")
    with pytest.raises(RuntimeError, match="2-D"):
        isa_all.pack_float(rand(4), "f32")
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        isa_all.pack_float(torch.ones(4, 4, dtype=torch.int32), "f32")
    pw = isa_all.pack_float(rand(4, 8), "bf16")
    with pytest.raises(RuntimeError, match="K=8"):
        pw.forward(rand(2, 7))
    assert pw.forward(rand(0, 8)).shape == (0, 4)


def test_strided_rows_and_large_panels(isa_all: Any) -> None:  # noqa: F811
    """x rows with a stride > K, and N spanning several thread chunks and AMX panel pairs."""
    w = rand(1000, 96, seed=8)
    big = rand(70, 200, seed=9)
    x = big[:, 50:146]
    for fmt in ("bf16", "f32"):
        pw = isa_all.pack_float(w, fmt)
        assert torch.equal(pw.forward(x), pw.forward(x.contiguous()))
        xr = x.bfloat16().float() if fmt == "bf16" else x  # what the kernels multiply by
        torch.testing.assert_close(pw.forward(x), xr @ pw.dequantize().T, rtol=1e-4, atol=1e-4)


def test_cache_blocks_keep_each_rows_bits(isa_all: Any) -> None:  # noqa: F811
    """On AMX tiles many rows of a long K run in chunks of rows x groups of panels (fgemm::run_blocked; at K = 8192:
    32 rows, 2 panels), C tiles stored straight into y for whole row blocks without bias: every row's bits equal its
    result alone, with and without bias, N ending in a partial panel and M in a partial row block (every level)."""
    w, x, bias = rand(100, 8192, seed=22), rand(100, 8192, seed=23), rand(100, seed=24)
    for fmt in ("bf16", "f32"):
        pw = isa_all.pack_float(w, fmt)
        for b in (None, bias):
            y = pw.forward(x, b)
            for r in (0, 15, 31, 32, 63, 96, 99):
                assert torch.equal(y[r], pw.forward(x[r:r + 1], b)[0]), (isa_all.active_isa(), fmt, b is None, r)


def test_amx_tiles_are_not_a_vdpbf16ps_sequence(amx_rows: Any) -> None:
    """The finding behind the two bf16 orders (fgemm_amx.cpp): on a CPU with both, AMX tdpbf16ps (amx level, tiles
    forced) and vdpbf16ps (avx512_bf16 level) over the same pairs in the same order give different bits, each
    exactly its own documented order."""
    mod = amx_rows
    if mod.active_isa() != "amx":
        pytest.skip("runs once, at the amx level")
    w, x = rand(64, 512, seed=20), rand(16, 512, seed=21) * 4
    pw = mod.pack_float(w, "bf16")
    mod.set_fgemm_amx_min_rows(1)
    amx = pw.forward(x)
    mod.set_active_isa("avx512_bf16")
    try:
        vdp = pw.forward(x)
    finally:
        mod.set_active_isa("amx")
    xb, wb = x.bfloat16().float(), pw.dequantize()
    assert torch.equal(amx, emulate_bf16(xb, wb, "block")) and torch.equal(vdp, emulate_bf16(xb, wb, "pair"))
    assert (amx != vdp).float().mean() > 0.2  # measured: about half of the outputs differ in the last bits

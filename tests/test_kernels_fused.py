"""Native fused layer ops (rms_norm, fused_add_rms_norm, rms_norm_heads, rotary_embedding, silu_and_mul) against
PyTorch, on every
ISA level this CPU has, over random shapes and row strides."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_levels import isa  # noqa: F401  (fixture)

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])  # isa is the same for every input
RTOL, ATOL = 1e-5, 1e-6


def strided(t: int, h: int, pad: int, seed: int) -> torch.Tensor:
    """A [t, h] float32 matrix whose rows are `pad` floats further apart than h (a column slice)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, h + pad, generator=g)[:, pad // 2:pad // 2 + h]


def ref_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()).float()


@SETTINGS
@given(t=st.integers(1, 40), h=st.sampled_from([1, 7, 16, 33, 64, 100, 576, 1000]), pad=st.sampled_from([0, 5, 64]),
       eps=st.sampled_from([1e-5, 1e-6]), seed=st.integers(0, 2**16))
def test_rms_norm(isa: Any, t: int, h: int, pad: int, eps: float, seed: int) -> None:  # noqa: F811
    x = strided(t, h, pad, seed) * 3
    w = torch.randn(h)
    out = torch.full((t, h), float("nan"))
    isa.rms_norm(out, x, w, eps)
    torch.testing.assert_close(out, ref_rms(x, w, eps), rtol=RTOL, atol=ATOL)


def test_rms_norm_in_place(isa: Any) -> None:  # noqa: F811
    x = torch.randn(5, 576)
    w = torch.randn(576)
    want = ref_rms(x, w, 1e-5)
    isa.rms_norm(x, x, w, 1e-5)
    torch.testing.assert_close(x, want, rtol=RTOL, atol=ATOL)


@SETTINGS
@given(t=st.integers(1, 40), h=st.sampled_from([1, 9, 16, 40, 576, 1000]), pad=st.sampled_from([0, 3, 32]),
       seed=st.integers(0, 2**16))
def test_fused_add_rms_norm(isa: Any, t: int, h: int, pad: int, seed: int) -> None:  # noqa: F811
    x = strided(t, h, pad, seed)
    res = strided(t, h, pad, seed + 1)
    w = torch.randn(h)
    want_res = x + res
    want_x = ref_rms(want_res, w, 1e-6)
    isa.fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(res, want_res, rtol=0, atol=0)
    torch.testing.assert_close(x, want_x, rtol=RTOL, atol=ATOL)


@SETTINGS
@given(t=st.integers(1, 30), d=st.sampled_from([16, 32, 64, 128]), heads=st.integers(1, 9),
       pad=st.sampled_from([0, 48]), seed=st.integers(0, 2**16))
def test_rms_norm_heads(isa: Any, t: int, d: int, heads: int, pad: int, seed: int) -> None:  # noqa: F811
    """Qwen3's q/k norm, in place on a column slice of the fused qkv output; the columns around it untouched."""
    wide = strided(t, heads * d + 2 * pad, 0, seed)
    before = wide.clone()
    x = wide[:, pad:pad + heads * d]
    w = torch.randn(d)
    want = ref_rms(x.reshape(t, heads, d), w, 1e-6).reshape(t, heads * d)
    isa.rms_norm_heads(x, w, 1e-6)
    torch.testing.assert_close(x, want, rtol=RTOL, atol=ATOL)
    assert torch.equal(wide[:, :pad], before[:, :pad]) and torch.equal(wide[:, pad + heads * d:],
                                                                       before[:, pad + heads * d:])
    with pytest.raises(RuntimeError, match="whole number of heads"):
        isa.rms_norm_heads(x, torch.ones(d + 1), 1e-6)


def rope_tables(positions: int, d: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


def ref_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, d: int) -> torch.Tensor:
    """Hugging Face rotate_half: x * cos + rotate_half(x) * sin, cos/sin repeated over both halves."""
    t = x.shape[0]
    xh = x.reshape(t, -1, d).double()
    c = torch.cat([cos, cos], -1).double()[:, None, :]
    s = torch.cat([sin, sin], -1).double()[:, None, :]
    rot = torch.cat([-xh[..., d // 2:], xh[..., :d // 2]], -1)
    return (xh * c + rot * s).reshape(t, -1).float()


@SETTINGS
@given(t=st.integers(1, 30), d=st.sampled_from([2, 40, 64, 128]), hq=st.integers(1, 9), hkv=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_rotary_embedding(isa: Any, t: int, d: int, hq: int, hkv: int, seed: int) -> None:  # noqa: F811
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    cos, sin = rope_tables(4096, d)
    pos = torch.randint(0, 4096, (t,), generator=g)
    want_q, want_k, want_v = ref_rope(q, cos[pos], sin[pos], d), ref_rope(k, cos[pos], sin[pos], d), v.clone()
    isa.rotary_embedding(pos, q, k, cos, sin, d)
    torch.testing.assert_close(q, want_q, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(k, want_k, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(v, want_v, rtol=0, atol=0)


@SETTINGS
@given(t=st.integers(1, 12), d=st.sampled_from([16, 64, 128]), frac=st.sampled_from([0.25, 0.5, 0.75]),
       hq=st.integers(1, 6), hkv=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_rotary_embedding_partial(isa: Any, t: int, d: int, frac: float, hq: int, hkv: int,  # noqa: F811
                                  seed: int) -> None:
    """Partial rotary (Phi-4-mini): the first rot = 2 * cos.size(1) dims of each head turn, the rest stay as they
    were, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    rot = int(d * frac)
    q, k = torch.randn(t, hq * d, generator=g), torch.randn(t, hkv * d, generator=g)
    cos, sin = rope_tables(512, rot)
    pos = torch.randint(0, 512, (t,), generator=g)

    def want(x: torch.Tensor) -> torch.Tensor:
        heads = x.reshape(t, -1, d)
        turned = ref_rope(heads[..., :rot].reshape(t, -1), cos[pos], sin[pos], rot).reshape(t, -1, rot)
        return torch.cat([turned, heads[..., rot:]], -1).reshape(t, -1)

    want_q, want_k = want(q), want(k)
    isa.rotary_embedding(pos, q, k, cos, sin, d)
    torch.testing.assert_close(q, want_q, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(k, want_k, rtol=RTOL, atol=ATOL)
    for x, w in ((q, want_q), (k, want_k)):
        assert torch.equal(x.reshape(t, -1, d)[..., rot:], w.reshape(t, -1, d)[..., rot:])


@SETTINGS
@given(t=st.integers(1, 30), i=st.sampled_from([1, 5, 16, 37, 1536]), pad=st.sampled_from([0, 8]),
       seed=st.integers(0, 2**16))
def test_silu_and_mul(isa: Any, t: int, i: int, pad: int, seed: int) -> None:  # noqa: F811
    x = strided(t, 2 * i, pad, seed) * 4
    out = torch.full((t, i), float("nan"))
    isa.silu_and_mul(out, x)
    x64 = x.double()
    torch.testing.assert_close(out, (F.silu(x64[:, :i]) * x64[:, i:]).float(), rtol=RTOL, atol=ATOL)


def test_silu_and_mul_extremes(isa: Any) -> None:  # noqa: F811
    g = torch.tensor([[-1000.0, -100.0, -88.5, -87.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 88.5, 100.0, 1000.0]])
    x = torch.cat([g, torch.full_like(g, 2.0)], 1)
    out = torch.empty_like(g)
    isa.silu_and_mul(out, x)
    torch.testing.assert_close(out, (F.silu(g.double()) * 2).float(), rtol=1e-5, atol=1e-30)


@SETTINGS
@given(t=st.integers(1, 30), i=st.sampled_from([1, 5, 16, 37, 2048]), pad=st.sampled_from([0, 8]),
       seed=st.integers(0, 2**16))
def test_gelu_tanh_and_mul(isa: Any, t: int, i: int, pad: int, seed: int) -> None:  # noqa: F811
    """Gemma's GeGLU: gelu(gate, approximate="tanh") * up against float64."""
    x = strided(t, 2 * i, pad, seed) * 4
    out = torch.full((t, i), float("nan"))
    isa.gelu_tanh_and_mul(out, x)
    x64 = x.double()
    want = F.gelu(x64[:, :i], approximate="tanh") * x64[:, i:]
    torch.testing.assert_close(out, want.float(), rtol=RTOL, atol=ATOL)


def test_gelu_tanh_and_mul_extremes(isa: Any) -> None:  # noqa: F811
    g = torch.tensor([[-1000.0, -100.0, -20.0, -5.0, -1e-30, 0.0, 1e-30, 0.5, 5.0, 20.0, 100.0, 1000.0]])
    x = torch.cat([g, torch.full_like(g, 2.0)], 1)
    out = torch.empty_like(g)
    isa.gelu_tanh_and_mul(out, x)
    want = (F.gelu(g.double(), approximate="tanh") * 2).float()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-30)


def test_argument_errors(isa: Any) -> None:  # noqa: F811
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="float32"):
        isa.rms_norm(torch.empty(3, 8), x.double(), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        isa.rms_norm(torch.empty(3, 8), x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous last dimension"):
        isa.rms_norm(torch.empty(3, 8), torch.randn(8, 3).t(), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match=r"x must be \[3, 10\]"):
        isa.silu_and_mul(torch.empty(3, 5), x)
    cos, sin = rope_tables(4, 8)
    with pytest.raises(RuntimeError, match="outside the table"):
        isa.rotary_embedding(torch.tensor([0, 1, 4]), torch.randn(3, 8), torch.randn(3, 8), cos, sin, 8)


def test_levels_without_their_own_kernels_run_the_level_below() -> None:
    """An IsaTable falls back to the highest level it implements at or below the active one (dispatch.h): on every
    level the CPU runs, the fused ops give the avx512 (or lower) result."""
    from kernel_levels import ALL_LEVELS, lowered, module

    mod = module()
    x = torch.randn(3, 64)
    w = torch.rand(64)
    results = []
    for level in ALL_LEVELS:
        if not mod.cpu_supports(level):
            continue
        for m in lowered(mod, level):
            out = torch.empty_like(x)
            m.rms_norm(out, x, w, 1e-6)
            results.append((level, out))
    ref = torch.nn.functional.rms_norm(x, (64,), w, 1e-6)
    for level, out in results:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=level)
    with pytest.raises(ValueError, match="unknown ISA level"):
        mod.set_active_isa("sse9")

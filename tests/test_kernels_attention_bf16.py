"""Paged attention with bf16 dot products (levels avx512_bf16 and amx, bf16 caches, head_dim 64/128:
csrc/attention_bf16.h, csrc/attention_avx512bf16_rows.cpp) against a float64 reference that reads the same queries
(bf16(q) for vdpbf16ps's transposed tiles; q itself for AMX and for vdpbf16ps's rows kernel, which multiply it as two
bf16 parts): within the bound of the one remaining rounding, the probabilities' to bf16 (|error| <= 2^-9 max|v| per
output, 2^-8 allowed). The kernels run from `attention_bf16_min_group()` query heads per KV head on (set to 1 here),
the fp32 kernels below it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_levels import lowered, module
from test_kernels_attention import Case, make_case, reference

BF16_LEVELS = ("avx512_bf16", "amx")


@pytest.fixture(autouse=True)
def every_group() -> Iterator[None]:
    mod = module()
    before = mod.attention_bf16_min_group()
    mod.set_attention_bf16_min_group(1)
    yield
    mod.set_attention_bf16_min_group(before)


def check_bf16(mod: Any, c: Case) -> None:
    group, d = c.q.shape[1] // c.kv.shape[3], c.q.shape[2]
    # q multiplied as two bf16 parts (q itself, to ~16 bits): AMX, and vdpbf16ps's rows kernel, which takes
    # generated rows (these cases have no prompt rows) at small G
    if mod.active_isa() == "amx" or mod.attention_kernels(d, "bfloat16", group)[1] == "avx512_bf16_rows":
        want = reference(c)
    else:  # what vdpbf16ps multiplies: bf16(q * scale)
        qb = (c.q * c.scale).bfloat16().float()
        want = reference(Case(qb, c.kv, c.block_table, c.qsl, c.seq_lens, 1.0))
    out = torch.full(c.q.shape, float("nan"))
    mod.paged_attention(out, c.q, c.kv, c.block_table, c.qsl, c.seq_lens, c.scale)
    bound = 2.0**-8 * float(c.kv[1].float().nan_to_num(0).abs().max())
    err = (out.double() - want).abs()
    assert float(err.max()) <= bound, (mod.active_isa(), float(err.max()), bound)


@pytest.mark.parametrize("level", BF16_LEVELS)
@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), bs=st.sampled_from([1, 16, 32]), hkv=st.integers(1, 3), group=st.sampled_from([1, 3, 4]),
       d=st.sampled_from([64, 128]), nseq=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_bf16_dot_products_random(level: str, data: st.DataObject, bs: int, hkv: int, group: int, d: int, nseq: int,
                                  seed: int) -> None:
    ctx = data.draw(st.lists(st.integers(0, 600), min_size=nseq, max_size=nseq))
    qlen = data.draw(st.lists(st.sampled_from([1, 1, 2, 5, 17, 70]), min_size=nseq, max_size=nseq))
    for mod in lowered(module(), level):
        torch.set_num_threads(2)
        check_bf16(mod, make_case(ctx, qlen, bs, hkv, group, d, torch.bfloat16, seed))


@pytest.mark.parametrize("level", BF16_LEVELS)
def test_bf16_prefill_and_large_scores(level: str) -> None:
    """A 512-token prefill chunk with context (partitions of 256 folded), and scores in the hundreds."""
    for mod in lowered(module(), level):
        check_bf16(mod, make_case([300, 0], [1, 512], 16, 3, 3, 64, torch.bfloat16, 11))
        c = make_case([200], [40], 16, 1, 3, 128, torch.bfloat16, 12)
        c.q.mul_(30.0)
        check_bf16(mod, c)


@pytest.mark.parametrize("level", BF16_LEVELS)
def test_f32_cache_keeps_f32_kernels(level: str) -> None:
    """An f32 cache at these levels runs the avx512 fp32 kernel: f32 tolerances."""
    for mod in lowered(module(), level):
        c = make_case([100, 40], [1, 30], 16, 3, 3, 64, torch.float32, 13)
        out = torch.full(c.q.shape, float("nan"))
        mod.paged_attention(out, c.q, c.kv, c.block_table, c.qsl, c.seq_lens, c.scale)
        torch.testing.assert_close(out.double(), reference(c), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("level", BF16_LEVELS)
def test_softcap_takes_the_f32_kernels(level: str) -> None:
    """Soft-capped scores (Gemma 2) on a bf16 cache at a group the bf16 kernels would take: the fp32 kernels run
    (f32 tolerances), as they are the ones that apply the cap."""
    for mod in lowered(module(), level):
        c = make_case([300], [20], 16, 2, 4, 64, torch.bfloat16, 16)
        c.q.mul_(4.0)
        c.softcap = 2.0
        out = torch.full(c.q.shape, float("nan"))
        mod.paged_attention(out, c.q, c.kv, c.block_table, c.qsl, c.seq_lens, c.scale, 0, c.softcap)
        torch.testing.assert_close(out.double(), reference(c), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("level", BF16_LEVELS)
def test_min_group_chooses_the_kernel(level: str) -> None:
    """Below the group threshold a bf16 cache runs the fp32 kernel (f32 tolerances); at it, bf16 dot products."""
    for mod in lowered(module(), level):
        mod.set_attention_bf16_min_group(4)
        for group, exact in ((3, True), (4, False)):
            c = make_case([300], [20], 16, 2, group, 64, torch.bfloat16, 14)
            out = torch.full(c.q.shape, float("nan"))
            mod.paged_attention(out, c.q, c.kv, c.block_table, c.qsl, c.seq_lens, c.scale)
            err = float((out.double() - reference(c)).abs().max())
            assert (err < 1e-5) == exact, (group, err)


@pytest.mark.parametrize("level,threshold", [("avx512_bf16", 1), ("amx", 4)])
def test_default_threshold_per_level(level: str, threshold: int) -> None:
    """Threshold 0 is each level's own for generated rows: vdpbf16ps (avx512_bf16) at every G (its rows kernel below
    eight query heads per KV head), AMX from four and, at G = 1, the avx512_bf16 rows kernel; prompt rows take the
    bf16 dot products at every G."""
    for mod in lowered(module(), level):
        mod.set_attention_bf16_min_group(0)
        assert mod.effective_attention_bf16_min_group() == threshold
        for group in (1, 3, 4, 8):
            c = make_case([300], [20], 16, 2, group, 64, torch.bfloat16, 15)
            out = torch.full(c.q.shape, float("nan"))
            mod.paged_attention(out, c.q, c.kv, c.block_table, c.qsl, c.seq_lens, c.scale)
            err = float((out.double() - reference(c)).abs().max())
            assert (err < 1e-5) == (group < threshold and not (level == "amx" and group == 1)), (group, err)
            # the same rows as prompt rows (prompt_lens past them): bf16 dot products at every G
            mod.paged_attention(out, c.q, c.kv, c.block_table, c.qsl, c.seq_lens, c.scale, 0, 0.0,
                                c.seq_lens)
            assert float((out.double() - reference(c)).abs().max()) >= 1e-5, group

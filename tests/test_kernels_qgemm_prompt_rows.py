"""pack_gguf's row kinds (`forward(x, bias, prompt_rows)`, csrc/packed_weight.h): on CPUs with AMX, prompt rows
multiply as bf16 on AMX tiles over the dequantized weights (the bits of pack_float(dequantize(), "bf16") on the same
level), every other row keeps the int8 arithmetic it has without prompt_rows; below amx prompt_rows changes nothing.
A row's bits follow from its input and its kind alone, wherever the row sits and however many rows share the call.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from kernel_levels import lowered

import pdserve.kernels as K
from pdserve.kernels.gguf_random import BLOCKS, random_blocks

pytestmark = pytest.mark.skipif(not K.available(), reason="native kernels not built (python -m pdserve.kernels)")
LEVELS = ("generic", "avx2", "avx512", "amx")


@pytest.fixture(scope="module")
def mod() -> Any:
    return K.require()


def packed(mod: Any, name: str, n: int, k: int, seed: int) -> Any:
    w = random_blocks(np.random.default_rng(seed), n, k, name)
    return mod.pack_gguf(torch.from_numpy(w), BLOCKS[name][0], k)


def masks(m: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(m)
    tail = torch.zeros(m, dtype=torch.bool)
    tail[m // 3:] = True  # decodes first, then a prefill chunk: one run of each kind
    return {"all": torch.ones(m, dtype=torch.bool), "none": torch.zeros(m, dtype=torch.bool), "tail": tail,
            "scattered": torch.rand(m, generator=gen) < 0.5}


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", tuple(BLOCKS))
def test_prompt_rows_take_bf16_tiles_others_keep_int8(mod: Any, level: str, name: str) -> None:
    k = 512 if BLOCKS[name][1] == 256 else 96
    for lv in lowered(mod, level):
        w = packed(lv, name, 37, k, 7)
        x = torch.randn(41, k) * torch.rand(41, 1) * 4
        bias = torch.randn(37)
        plain = w.forward(x, bias)
        bf16 = lv.pack_float(w.dequantize(), "bf16").forward(x, bias)
        for label, mask in masks(41).items():
            for kinds in (mask, mask.to(torch.uint8)):
                y = w.forward(x, bias, kinds)
                assert torch.equal(y[~mask], plain[~mask]), label
                assert torch.equal(y[mask], bf16[mask] if level == "amx" else plain[mask]), label
        if level == "amx":  # the two arithmetics do differ (else the test above would prove nothing)
            assert not torch.equal(bf16, plain)


@pytest.mark.parametrize("m", [1, 5, 16, 17, 33, 130])
def test_prompt_row_bits_do_not_depend_on_the_batch(mod: Any, m: int) -> None:
    """Row 0's result alone equals its result among m rows of both kinds, at every size (a prefill chunked
    differently, a preempted request recomputed)."""
    w = packed(mod, "Q4_K", 70, 512, 3)
    x = torch.randn(m, 512)
    mask = torch.ones(m, dtype=torch.bool)
    mask[m // 2:] = False if m > 1 else True
    y = w.forward(x, None, mask)
    for r in {0, m - 1}:
        alone = w.forward(x[r:r + 1], None, mask[r:r + 1])
        assert torch.equal(y[r:r + 1], alone)


def test_prompt_rows_in_cache_blocks(mod: Any) -> None:
    """At K = 8192 prompt rows run in chunks of 32 rows over groups of 2 decoded panels (fgemm::run_blocked): still
    the bits of pack_float(dequantize(), "bf16") on the amx level, row by row, with and without bias."""
    for lv in lowered(mod, "amx"):
        w = packed(lv, "Q4_0", 70, 8192, 5)
        x = torch.randn(100, 8192)
        ref = lv.pack_float(w.dequantize(), "bf16")
        for bias in (None, torch.randn(70)):
            assert torch.equal(w.forward(x, bias, torch.ones(100, dtype=torch.bool)), ref.forward(x, bias))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_a_gated_projection_of_prompt_rows_is_fused_with_the_same_bits(mod: Any, level: str, name: str) -> None:
    """forward_gated (a gate/up projection straight to act = silu or gelu_tanh of the gate half times the up half):
    on the amx level, every row a prompt row, the bits of forward then silu_and_mul / gelu_tanh_and_mul, for row
    counts off the 16-row tiles and 32-row blocks and into a strided act; otherwise (other levels, a generated row
    among them, no kinds, a half that is not whole 16-column panels) it declines and writes nothing."""
    k = 512 if BLOCKS[name][1] == 256 else 96
    fused = level == "amx"
    for lv in lowered(mod, level):
        w = packed(lv, name, 2 * 48, k, 9)
        for m in (1, 17, 100):
            x = torch.randn(m, k) * torch.rand(m, 1) * 4
            ones = torch.ones(m, dtype=torch.bool)
            for gelu in (False, True):
                ref = torch.empty(m, 48)
                (lv.gelu_tanh_and_mul if gelu else lv.silu_and_mul)(ref, w.forward(x, None, ones))
                act = torch.full((m, 80), float("nan"))[:, 16:64]  # rows 80 apart, as in the MLP's scratch
                assert w.forward_gated(x, act, gelu, ones) is fused
                assert torch.equal(act, ref) if fused else bool(act.isnan().all())
        x = torch.randn(20, k)
        act = torch.full((20, 48), float("nan"))
        mixed = torch.ones(20, dtype=torch.bool)
        mixed[7] = False
        assert not w.forward_gated(x, act, False, mixed) and not w.forward_gated(x, act)
        assert not packed(lv, name, 2 * 40, k, 9).forward_gated(x, torch.empty(20, 40), False, torch.ones(20) > 0)
        assert bool(act.isnan().all())


def test_a_gated_projection_in_cache_blocks(mod: Any) -> None:
    """At K = 8192 the fused gate/up projection runs in row chunks of 32 over groups of decoded gate/up panels: the
    same bits as the projection then silu_and_mul."""
    for lv in lowered(mod, "amx"):
        w = packed(lv, "Q4_0", 2 * 80, 8192, 5)
        x = torch.randn(100, 8192)
        ones = torch.ones(100, dtype=torch.bool)
        ref, act = torch.empty(100, 80), torch.empty(100, 80)
        lv.silu_and_mul(ref, w.forward(x, None, ones))
        assert w.forward_gated(x, act, False, ones) and torch.equal(act, ref)


def test_a_gated_projection_checks_its_arguments(mod: Any) -> None:
    w = packed(mod, "Q4_0", 64, 64, 1)
    ones = torch.ones(4, dtype=torch.bool)
    for x, act in ((torch.randn(4, 64), torch.empty(4, 64)), (torch.randn(4, 32), torch.empty(4, 32)),
                   (torch.randn(4, 64), torch.empty(3, 32)), (torch.randn(4, 64), torch.empty(4, 32).double())):
        with pytest.raises(RuntimeError, match="act|x has K"):
            w.forward_gated(x, act, False, ones)
    with pytest.raises(RuntimeError, match="even N"):
        packed(mod, "Q4_0", 7, 64, 1).forward_gated(torch.randn(4, 64), torch.empty(4, 3), False, ones)
    with pytest.raises(RuntimeError, match="prompt_rows"):
        w.forward_gated(torch.randn(4, 64), torch.empty(4, 32), False, torch.ones(3, dtype=torch.bool))


def test_stacked_parts_pass_the_kinds_on(mod: Any) -> None:
    a, b = packed(mod, "Q4_0", 20, 64, 1), packed(mod, "Q8_0", 12, 64, 2)
    s = mod.stack_packed([a, b])
    x = torch.randn(9, 64)
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
    assert torch.equal(s.forward(x, None, mask), torch.cat([a.forward(x, None, mask), b.forward(x, None, mask)], 1))


def test_prompt_rows_are_checked(mod: Any) -> None:
    w = packed(mod, "Q4_0", 8, 64, 1)
    x = torch.randn(4, 64)
    for bad in (torch.ones(3, dtype=torch.bool), torch.ones(4, dtype=torch.int32), torch.ones(4, 1, dtype=torch.bool)):
        with pytest.raises(RuntimeError, match="prompt_rows"):
            w.forward(x, None, bad)


def test_prompt_row_mask_marks_rows_below_the_prompt_length(mod: Any) -> None:
    # a prefill chunk (rows 0..3 at positions 0..3 of a 6-token prompt), a chunk crossing the prompt's end
    # (positions 8..11, prompt 10), a decode row and a speculative verification of 3 rows
    qsl = torch.tensor([0, 4, 8, 9, 12], dtype=torch.int32)
    seq_lens = torch.tensor([4, 12, 30, 23], dtype=torch.int32)
    prompt_lens = torch.tensor([6, 10, 5, 20], dtype=torch.int32)
    mask = mod.prompt_row_mask(qsl, seq_lens, prompt_lens)
    assert mask.dtype == torch.uint8
    assert mask.tolist() == [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    with pytest.raises(RuntimeError, match="prompt_lens"):
        mod.prompt_row_mask(qsl, seq_lens, prompt_lens[:3])
    with pytest.raises(RuntimeError, match="seq_len"):
        mod.prompt_row_mask(qsl, torch.tensor([3, 12, 30, 23], dtype=torch.int32), prompt_lens)

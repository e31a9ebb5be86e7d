"""Prompt rows (`paged_attention(..., prompt_lens)`: a row at a position below its sequence's prompt length) run on
the bf16 dot-product kernel of the level (AMX tiles, AVX512-BF16 vdpbf16ps) with a bf16 cache, and on fp32 FMAs in
the same transposed key tiles at the avx512 level (test_kernels_attention_tiles.py); every other row keeps the kernel
it runs without prompt_lens. A row's kernel, and so its bits, follow from its position alone: a chunk that crosses
the prompt's end (a preempted request's recompute) splits there."""

from __future__ import annotations

import pytest
import torch
from kernel_levels import ALL_LEVELS, lowered, module
from test_kernels_attention import Case, make_case, reference

from pdserve.model.kv_cache_dtype import dequantize_kv, quantize_kv

# a prefill chunk of prompt rows only, a chunk crossing the prompt's end (prompt 220, rows at 200..239), a decode
# row and a speculative verification of 5 rows past their prompts
CTX, QLEN, PROMPT = [0, 200, 300, 90], [70, 40, 1, 5], [70, 220, 10, 50]


def run(mod: object, c: Case, prompt_lens: torch.Tensor | None) -> torch.Tensor:
    out = torch.full(c.q.shape, float("nan"))
    mod.paged_attention(out, c.q, c.kv, c.block_table, c.qsl, c.seq_lens, c.scale, 0, 0.0,  # type: ignore[attr-defined]
                        prompt_lens)
    return out


def prompt_mask(c: Case) -> torch.Tensor:
    rows = []
    for s in range(len(QLEN)):
        pos0 = int(c.seq_lens[s]) - QLEN[s]
        rows += [pos0 + i < PROMPT[s] for i in range(QLEN[s])]
    return torch.tensor(rows)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_prompt_rows_take_bf16_dot_products_others_keep_their_kernel(level: str, group: int) -> None:
    for mod in lowered(module(), level):
        before = mod.attention_bf16_min_group()
        try:
            c = make_case(CTX, QLEN, 16, 2, group, 64, torch.bfloat16, 21 + group)
            mask = prompt_mask(c)
            assert 0 < int(mask.sum()) < len(mask) and bool(mask[70 + 19]) and not bool(mask[70 + 20])
            mod.set_attention_bf16_min_group(0)
            plain, mixed = run(mod, c, None), run(mod, c, torch.tensor(PROMPT, dtype=torch.int32))
            assert torch.equal(mixed[~mask], plain[~mask])  # generated rows: untouched
            if level in ("generic", "avx2"):  # no tile kernel: prompt_lens changes nothing
                assert torch.equal(mixed, plain)
                continue
            if level == "avx512":  # fp32 FMAs in transposed tiles
                assert torch.equal(mixed[mask], run(mod, c, c.seq_lens)[mask])
                assert not torch.equal(mixed[mask], plain[mask])
                continue
            # every row a prompt row: every row on the level's tile kernel (AMX tiles, vdpbf16ps transposed tiles)
            tiles = run(mod, c, c.seq_lens)
            assert torch.equal(mixed[mask], tiles[mask])
            # generated rows ran another kernel (amx: the fp32 one below G = 4; avx512_bf16: vdpbf16ps on rows as
            # stored, q in two bf16 parts): prompt rows differ from it
            assert not torch.equal(mixed[mask], plain[mask])
            if level == "amx":  # vdpbf16ps rounds q to bf16 too: test_kernels_attention_bf16.py bounds it
                bound = 2.0**-8 * float(c.kv[1].float().nan_to_num(0).abs().max())  # p to bf16; q split, not rounded
                assert float((mixed[mask].double() - reference(c)[mask]).abs().max()) <= bound
            # a threshold above the group sends prompt rows to the fp32 tiles (the avx512 level's prompt rows)
            mod.set_attention_bf16_min_group(group + 1)
            fp32 = run(mod, c, torch.tensor(PROMPT, dtype=torch.int32))
            assert torch.equal(fp32[~mask], run(mod, c, None)[~mask])
            for avx512 in lowered(mod, "avx512"):
                assert torch.equal(fp32[mask], run(avx512, c, torch.tensor(PROMPT, dtype=torch.int32))[mask])
        finally:
            mod.set_attention_bf16_min_group(before)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize(("group", "d"), [(3, 64), (1, 128)])
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_prompt_rows_of_a_quantized_cache_read_its_rows_as_bf16(level: str, dtype: torch.dtype, group: int,
                                                                d: int) -> None:
    """int8/fp8 caches: on CPUs with AVX512-BF16 (AMX ones too) prompt rows run the vdpbf16ps kernel over each key
    tile converted to bf16(scale * code): the bits that kernel gives on a bf16 cache holding those values; at avx512
    the fp32 tiles over code x scale (exact in fp32): the bits of an f32 cache holding those values. Other rows, and
    every row below avx512, keep the fp32 kernel over the codes."""
    for mod in lowered(module(), level):
        c = make_case(CTX, QLEN, 16, 2, group, d, torch.float32, 31 + d)
        codes = quantize_kv(c.kv, dtype)
        stored = Case(c.q, codes.view(dtype), c.block_table, c.qsl, c.seq_lens, c.scale)
        mask, prompts = prompt_mask(c), torch.tensor(PROMPT, dtype=torch.int32)
        plain, mixed = run(mod, stored, None), run(mod, stored, prompts)
        assert torch.equal(mixed[~mask], plain[~mask])
        if level in ("generic", "avx2"):
            assert torch.equal(mixed, plain)
            continue
        if level == "avx512":
            as_f32 = Case(c.q, dequantize_kv(codes, dtype, torch.float32), c.block_table, c.qsl, c.seq_lens, c.scale)
            assert torch.equal(mixed[mask], run(mod, as_f32, prompts)[mask])
            assert not torch.equal(mixed[mask], plain[mask])
            continue
        as_bf16 = Case(c.q, dequantize_kv(codes, dtype, torch.bfloat16), c.block_table, c.qsl, c.seq_lens, c.scale)
        for bf16_level in lowered(mod, "avx512_bf16"):  # on amx, a bf16 cache's prompt rows take AMX tiles
            assert torch.equal(mixed[mask], run(bf16_level, as_bf16, prompts)[mask])
        assert not torch.equal(mixed[mask], plain[mask])
        assert not bool(mixed.isnan().any())


def test_prompt_lens_is_checked() -> None:
    mod = module()
    c = make_case([0], [4], 16, 1, 1, 64, torch.float32, 3)
    with pytest.raises(RuntimeError, match="prompt_lens"):
        run(mod, c, torch.tensor([4, 4], dtype=torch.int32))

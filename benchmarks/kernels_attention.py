"""Native attention and fused layer ops vs the PyTorch path they replace, at SmolLM2-135M's shapes.

    PYTHONPATH=. python benchmarks/kernels_attention.py [--threads 2] [--repeats 15] [--quick]

Attention: the SDPA gather path (`SDPABackend.forward`, which writes the step's K/V and attends) against
`reshape_and_cache` + `paged_attention`, for decode batches (1/16/32/64 sequences at context 256 and 1024) and prefill
chunks (512 and 2048 tokens, with and without 512 tokens of context); f32 KV cache, block size 16. Fused ops: T = 1
and T = 512 against their torch equivalents in pdserve/model/llama.py. Every time is the median of `repeats` samples,
each sample the mean of enough back-to-back calls to last ~20 ms (per-call overhead included). Native columns per ISA
level this CPU has. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

import pdserve.kernels as K
from pdserve.model.attention import AttentionMetadata, PrefillChunk, SDPABackend

HQ, HKV, D, BS, HIDDEN, INTER = 9, 3, 64, 16, 576, 1536
LEVELS = ("avx2", "avx512", "avx512_bf16", "amx")  # avx512_bf16, amx: own kernels for bf16 caches only


def timeit(fn: Callable[[], Any], repeats: int, sample_s: float = 0.02) -> float:
    """Median seconds per call."""
    fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, int(sample_s / one))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


class Step:
    """One layer's attention step: sequences with (context, q_len), their blocks, q/k/v, both paths' inputs."""

    def __init__(self, ctx: list[int], qlen: list[int], dtype: torch.dtype = torch.float32) -> None:
        g = torch.Generator().manual_seed(0)
        lens = [c + n for c, n in zip(ctx, qlen)]
        need = [math.ceil(n / BS) for n in lens]
        nb = sum(need) + 1
        perm = torch.randperm(nb, generator=g)
        self.tables = []
        used = 0
        for n in need:
            self.tables.append(perm[used:used + n])
            used += n
        self.cache = torch.randn(2, nb, BS, HKV, D, generator=g).to(dtype)
        t = sum(qlen)
        self.q = torch.randn(t, HQ, D, generator=g)
        self.k, self.v = torch.randn(t, HKV, D, generator=g), torch.randn(t, HKV, D, generator=g)
        slots = [int(tb[p // BS]) * BS + p % BS for tb, c, n in zip(self.tables, ctx, lens) for p in range(c, n)]
        self.slots = torch.tensor(slots)
        width = max(need)
        self.bt = torch.zeros(len(lens), width, dtype=torch.int32)
        for s, tb in enumerate(self.tables):
            self.bt[s, :len(tb)] = tb.to(torch.int32)
        self.qsl = torch.tensor([0, *torch.tensor(qlen).cumsum(0).tolist()], dtype=torch.int32)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)
        self.out = torch.empty_like(self.q)
        self.meta = self._sdpa_meta(ctx, qlen, lens, width)

    def _sdpa_meta(self, ctx: list[int], qlen: list[int], lens: list[int], width: int) -> AttentionMetadata:
        if all(n == 1 for n in qlen):
            mask = (torch.arange(width * BS)[None, :] < torch.tensor(lens)[:, None]).view(len(lens), 1, 1, -1)
            return AttentionMetadata(self.slots, len(lens), self.bt.long(), mask, [])
        starts = self.qsl.tolist()
        chunks = [PrefillChunk(starts[s], qlen[s], ctx[s], self.tables[s]) for s in range(len(lens))]
        return AttentionMetadata(self.slots, 0, None, None, chunks)

    def sdpa(self) -> None:
        SDPABackend().forward(self.q, self.k, self.v, self.cache, self.meta, D ** -0.5)

    def native(self, mod: Any) -> None:
        mod.reshape_and_cache(self.k, self.v, self.cache, self.slots)
        mod.paged_attention(self.out, self.q, self.cache, self.bt, self.qsl, self.seq_lens, D ** -0.5)


def levels(mod: Any) -> list[str]:
    return [lv for lv in LEVELS if mod.cpu_supports(lv)]


def native_times(mod: Any, fn: Callable[[], Any], repeats: int) -> list[float]:
    out = []
    before = mod.active_isa()
    for lv in levels(mod):
        mod.set_active_isa(lv)
        out.append(timeit(fn, repeats))
    mod.set_active_isa(before)
    return out


def row(name: str, torch_s: float, native_s: list[float], unit: float, fmt: str) -> str:
    cells = " | ".join(f"{t * unit:{fmt}}" for t in native_s)
    return f"| {name} | {torch_s * unit:{fmt}} | {cells} | {torch_s / native_s[-1]:.2f}x |"


def attention_table(mod: Any, repeats: int, quick: bool) -> None:
    cols = " | ".join(f"native {lv} ms" for lv in levels(mod))
    print(f"| attention step (write K/V + attend) | SDPA ms | {cols} | speedup |")
    print("|---|---:|" + "---:|" * len(levels(mod)) + "---:|")
    cases: list[tuple[str, list[int], list[int]]] = []
    for ctx in (256, 1024):
        for b in (1, 16, 32, 64):
            cases.append((f"decode batch {b}, context {ctx}", [ctx] * b, [1] * b))
    for n in (512, 2048):
        for ctx in (0, 512):
            if not (quick and n == 2048):
                cases.append((f"prefill {n} tokens, context {ctx}", [ctx], [n]))
    for name, ctx_list, qlen in cases:
        step = Step(ctx_list, qlen)
        reps = max(3, repeats // 3) if sum(qlen) >= 512 else repeats
        print(row(name, timeit(step.sdpa, reps), native_times(mod, partial(step.native, mod), reps), 1e3, ".3f"),
              flush=True)


def bf16_table(mod: Any, repeats: int) -> None:
    """The native path with a bf16 cache (halves the KV bytes; rows are widened to f32 per key tile)."""
    cols = " | ".join(f"{lv} f32 ms | {lv} bf16 ms" for lv in levels(mod))
    print(f"| native attention step, KV dtype | {cols} |")
    print("|---|" + "---:|---:|" * len(levels(mod)))
    for name, ctx, qlen in (("decode batch 16, context 1024", [1024] * 16, [1] * 16),
                            ("prefill 512 tokens, context 512", [512], [512])):
        steps = [Step(ctx, qlen, dt) for dt in (torch.float32, torch.bfloat16)]
        per_dtype = [native_times(mod, partial(st.native, mod), repeats) for st in steps]
        cells = [f"{t * 1e3:.3f}" for lv_t in zip(*per_dtype) for t in lv_t]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def fused_cases(t: int) -> list[tuple[str, Callable[[], Any], Callable[[Any], Any]]]:
    g = torch.Generator().manual_seed(1)
    x, res, w = torch.randn(t, HIDDEN, generator=g), torch.randn(t, HIDDEN, generator=g), torch.randn(HIDDEN)
    out = torch.empty_like(x)
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, generator=g)
    q, k = qkv[:, :HQ * D], qkv[:, HQ * D:(HQ + HKV) * D]
    # a real table: the ops run in place again and again, so a non-unit rotation would drift into denormals
    ang = torch.arange(4096.0)[:, None] * 10000.0 ** (-torch.arange(0, D, 2) / D)[None, :]
    cos, sin = ang.cos(), ang.sin()
    pos = torch.randint(0, 4096, (t,), generator=g)
    rope = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    gu = torch.randn(t, 2 * INTER, generator=g)
    act = torch.empty(t, INTER)

    def torch_rotary() -> None:
        for z, h in ((q, HQ), (k, HKV)):
            x1, x2 = z.view(t, h, D).chunk(2, dim=-1)
            torch.cat((x1 * rope[0] - x2 * rope[1], x2 * rope[0] + x1 * rope[1]), dim=-1)

    def torch_add_norm() -> None:
        r = x + res
        F.rms_norm(r, (HIDDEN,), w, 1e-5)

    return [
        ("rms_norm", lambda: F.rms_norm(x, (HIDDEN,), w, 1e-5), lambda m: m.rms_norm(out, x, w, 1e-5)),
        ("fused_add_rms_norm", torch_add_norm, lambda m: m.fused_add_rms_norm(x, res, w, 1e-5)),
        ("rotary_embedding", torch_rotary, lambda m: m.rotary_embedding(pos, q, k, cos, sin, D)),
        ("silu_and_mul", lambda: F.silu(gu[:, :INTER]) * gu[:, INTER:], lambda m: m.silu_and_mul(act, gu)),
    ]


def fused_table(mod: Any, repeats: int) -> None:
    cols = " | ".join(f"native {lv} us" for lv in levels(mod))
    print(f"| fused op | torch us | {cols} | speedup |")
    print("|---|---:|" + "---:|" * len(levels(mod)) + "---:|")
    for t in (1, 512):
        for name, torch_fn, native_fn in fused_cases(t):
            nat = native_times(mod, partial(native_fn, mod), repeats)
            print(row(f"{name}, T={t}", timeit(torch_fn, repeats), nat, 1e6, ".1f"), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="skip the 2048-token prefills")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mod = K.require()
    print(f"threads {torch.get_num_threads()}, CPU ISA {mod.cpu_isa()}, median of {args.repeats} samples\n")
    fused_table(mod, args.repeats)
    print()
    attention_table(mod, args.repeats, args.quick)
    print()
    bf16_table(mod, max(3, args.repeats // 3))


if __name__ == "__main__":
    main()

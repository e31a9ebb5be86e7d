"""Native GGUF-block linear kernels vs the PyTorch paths they replace, at SmolLM2-135M's shapes.

    PYTHONPATH=. .venv/bin/python benchmarks/kernels_quant.py [--threads 2] [--reps 200] [--batch-only|--gemv-only]

Times are medians of many calls (other work on the machine makes single runs noisy). GEMV (decode, M=1..8):
`cold` rotates over enough weight copies that every call reads its weight from DRAM (> 2x the LLC), `hot` repeats
one weight (cache-resident); GB/s = weight bytes / time, compared with the machine's read bandwidth (a 512 MiB
torch sum). Baselines: F.linear on the dequantized fp32 weight (the current path, 8x / 3.8x the bytes)
and torch.ops.aten._weight_int8pack_mm (int8 weight, per-row scale). Batches/prefill (M=16..2048): the integer
kernel, dequantize-then-GEMM, quant_linear's automatic choice and F.linear on the fp32 weight.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

import pdserve.kernels as K

QNAMES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}
BLOCK_BYTES = {2: 18, 3: 20, 8: 34}
# (name, N, K, qtypes) of SmolLM2-135M's linears
SHAPES = [("gate_up", 3072, 576, (2, 3, 8)), ("down", 576, 1536, (2, 3, 8)), ("qkv", 960, 576, (2, 3, 8)),
          ("lm_head", 49152, 576, (8,))]
LLC_BYTES = 48 << 20


def median_time(fn: Callable[[int], object], reps: int, warmup: int = 3) -> float:
    for i in range(warmup):
        fn(i)
    ts = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def read_bandwidth() -> tuple[float, float]:
    """(read GB/s of a 512 MiB torch sum, read+write GB/s of a 512 MiB torch copy)."""
    src = torch.empty(128 << 20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t_sum = median_time(lambda _: src.sum(), 9, warmup=2)
    t_copy = median_time(lambda _: dst.copy_(src), 9, warmup=2)
    return src.numel() * 4 / t_sum / 1e9, 2 * src.numel() * 4 / t_copy / 1e9


def make_weight(m, n: int, k: int, qtype: int) -> torch.Tensor:
    return m.quantize(torch.randn(n, k) * 0.05, qtype)


def rotating(w: torch.Tensor) -> list[torch.Tensor]:
    """w and enough copies that cycling through them reads each from DRAM (> 2x the LLC in all)."""
    nbytes = w.numel() * w.element_size()
    return [w] + [w.clone() for _ in range(max(1, 2 * LLC_BYTES // nbytes))]


def call_time(fn: Callable[[], object], reps: int) -> float:
    return median_time(lambda _: fn(), reps)


def cold_time(fn: Callable[[torch.Tensor], object], ws: list[torch.Tensor], reps: int) -> float:
    return median_time(lambda i: fn(ws[i % len(ws)]), reps)


def gemv_rows(m, bw: float, reps: int, rows: int) -> list[str]:
    out = []
    for name, n, k, qtypes in SHAPES:
        for qt in qtypes:
            w = make_weight(m, n, k, qt)
            x = torch.randn(rows, k)
            cold = cold_time(partial(m.quant_linear, x, qtype=qt), rotating(w), reps)
            hot = call_time(partial(m.quant_linear, x, w, qt), reps)
            wf = m.dequantize(w, qt, k)
            f32 = cold_time(partial(F.linear, x), rotating(wf), max(20, reps // 4))
            scales = wf.abs().amax(1) / 127
            w8 = torch.round(wf / scales[:, None]).to(torch.int8)
            int8pack = torch.ops.aten._weight_int8pack_mm
            i8 = cold_time(lambda w8: int8pack(x, w8, scales), rotating(w8), max(20, reps // 4))  # noqa: B023
            gbs = w.numel() / cold / 1e9
            out.append(f"| {name} {n}x{k} | {QNAMES[qt]} | {rows} | {w.numel() / 1e6:.2f} | {cold * 1e6:.0f} | "
                       f"{gbs:.1f} ({gbs / bw:.0%}) | {hot * 1e6:.0f} | "
                       f"{f32 * 1e6:.0f} | {i8 * 1e6:.0f} | {f32 / cold:.1f}x | {i8 / cold:.1f}x |")
    return out


def batch_rows(m, reps: int, ms: list[int]) -> list[str]:
    out = []
    for name, n, k, qtypes in SHAPES[:3]:
        for qt in (2, 8):
            if qt not in qtypes:
                continue
            w = make_weight(m, n, k, qt)
            wf = m.dequantize(w, qt, k)
            for rows in ms:
                x = torch.randn(rows, k)
                r = max(5, reps // max(1, rows // 8))
                t_int, t_dq, t_auto, t_f32 = (
                    call_time(f, r) for f in (
                        partial(m.quant_linear_with, x, w, qt, None, "int"),
                        partial(m.quant_linear_with, x, w, qt, None, "dequant"),
                        partial(m.quant_linear, x, w, qt), partial(F.linear, x, wf)))
                gmacs = rows * n * k / 1e9
                out.append(f"| {name} {n}x{k} | {QNAMES[qt]} | {rows} | {t_int * 1e3:.3f} ({gmacs / t_int:.0f}) | "
                           f"{t_dq * 1e3:.3f} ({gmacs / t_dq:.0f}) | {t_auto * 1e3:.3f} | "
                           f"{t_f32 * 1e3:.3f} ({gmacs / t_f32:.0f}) | {t_f32 / t_auto:.2f}x |")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--gemv-rows", default="1,4,8")
    ap.add_argument("--batch-rows", default="16,32,48,64,128,512,2048")
    ap.add_argument("--gemv-only", action="store_true")
    ap.add_argument("--batch-only", action="store_true")
    ap.add_argument("--isa", default=None, help="lower the kernels' ISA level (avx2, generic)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    m = K.require()
    if args.isa:
        m.set_active_isa(args.isa)
    np.random.seed(0)
    torch.manual_seed(0)
    bw, copy_bw = read_bandwidth()
    print(f"ISA {m.active_isa()}, {args.threads} threads, read bandwidth {bw:.1f} GB/s (torch sum; copy: "
          f"{copy_bw:.1f} GB/s read+write), "
          f"dequant threshold M >= {m.quant_linear_dequant_min_rows()}; medians of {args.reps} calls\n")
    if not args.batch_only:
        print("| linear | type | M | weight MB | native cold us | GB/s (of read bw) | native hot us | "
              "F.linear fp32 us | int8pack_mm us | vs fp32 | vs int8pack |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for rows in (int(r) for r in args.gemv_rows.split(",")):
            for line in gemv_rows(m, bw, args.reps, rows):
                print(line, flush=True)
        print()
    if not args.gemv_only:
        print("| linear | type | M | int ms (GMAC/s) | dequant+GEMM ms (GMAC/s) | auto ms | F.linear fp32 ms (GMAC/s) "
              "| fp32 / auto |")
        print("|---|---|---|---|---|---|---|---|")
        for line in batch_rows(m, args.reps, [int(r) for r in args.batch_rows.split(",")]):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""pack_gguf's GEMMs (csrc/qgemm*.cpp) side by side with torch's F.linear on the dequantized weight (fp32 and
bf16), at the linear shapes of SmolLM2-135M and Llama-shaped 1.7B and 7B models. (BENCHMARKS.md's tables from
before 2026-12-02 10:00 UTC also have a column for quant_linear, the GGUF kernels pack_gguf replaced.)

    PYTHONPATH=. .venv/bin/python benchmarks/kernels_qgemm.py [--sizes 135M,1.7B,7B] [--types Q4_0,Q4_K,Q6_K,Q8_0]
        [--ms 1,4,16,32,64,512] [--levels avx2,avx512,amx] [--threads 2] [--clock wall|cpu] [--cold-mib 512]

Every implementation of a row runs in the same process, one after another, on the same activations. M = 1 (decode
GEMV): each call reads a weight not read since at least --cold-mib MiB of other copies (a model's layers stream from
DRAM the same way); reported as GB/s of the bytes the implementation reads (packed qgemm bytes, 4 or 2 bytes a
weight for torch) next to the machine's stream bandwidth measured at the start. M > 1: one weight, GMAC/s.
`--clock cpu` times with the calling thread's CPU time and one thread (on a shared, loaded machine wall time
measures the neighbours; CPU time measures the kernels); `--clock wall` with perf_counter.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import pdserve.kernels as K
from pdserve.kernels.gguf_random import BLOCKS, random_blocks

# hidden, intermediate, heads, kv heads, head dim
SIZES = {"135M": (576, 1536, 9, 3, 64), "1.7B": (2048, 8192, 32, 32, 64), "7B": (4096, 11008, 32, 32, 128)}


@dataclass
class Clock:
    kind: str  # "wall" or "cpu"
    min_time: float = 0.3
    max_reps: int = 40

    def now(self) -> float:
        return time.perf_counter() if self.kind == "wall" else time.thread_time()

    def median(self, fn: Callable[[int], object]) -> float:
        fn(0)
        ts: list[float] = []
        start = self.now()
        i = 1
        while len(ts) < 3 or (self.now() - start < self.min_time and len(ts) < self.max_reps):
            t0 = self.now()
            fn(i)
            ts.append(self.now() - t0)
            i += 1
        return statistics.median(ts)


def linears(size: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of one layer's linears as the model runs them (qkv and gate_up fused)."""
    hidden, inter, heads, kv, hd = SIZES[size]
    return [("qkv", (heads + 2 * kv) * hd, hidden), ("o", hidden, heads * hd), ("gate_up", 2 * inter, hidden),
            ("down", hidden, inter)]


def stream_bandwidth(clock: Clock) -> tuple[float, float]:
    """(read GB/s: a 512 MiB torch sum, read+write GB/s: a 512 MiB copy)."""
    src = torch.ones(128 << 20, dtype=torch.float32)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    return nbytes / clock.median(lambda _: src.sum()) / 1e9, 2 * nbytes / clock.median(lambda _: dst.copy_(src)) / 1e9


def copies(nbytes: int, cold_bytes: int) -> int:
    return max(2, math.ceil(cold_bytes / nbytes))


@dataclass
class Weights:
    """One linear's weight in every form a row compares (M = 1 forms as rotations of cold copies)."""

    packed: list[Any]
    f32: list[torch.Tensor]
    bf16: list[torch.Tensor]


def make_weights(mod: Any, name: str, n: int, k: int, cold_bytes: int, need_cold: bool,
                 with_torch: bool) -> Weights:
    rng = np.random.default_rng(n * 7 + k)
    raw = torch.from_numpy(random_blocks(rng, n, k, name))
    tid = BLOCKS[name][0]
    first = mod.pack_gguf(raw, tid, k)
    nc = copies(first.nbytes, cold_bytes) if need_cold else 1
    packed = [first] + [mod.pack_gguf(raw, tid, k) for _ in range(nc - 1)]
    f32: list[torch.Tensor] = []
    bf16: list[torch.Tensor] = []
    if with_torch:
        wf = first.dequantize()
        f32 = [wf] + [wf.clone() for _ in range(copies(wf.numel() * 4, cold_bytes) - 1 if need_cold else 0)]
        wb = wf.to(torch.bfloat16)
        bf16 = [wb] + [wb.clone() for _ in range(copies(wb.numel() * 2, cold_bytes) - 1 if need_cold else 0)]
    return Weights(packed, f32, bf16)


def rate(seconds: float, m: int, n: int, k: int, nbytes: int) -> str:
    if m == 1:
        return f"{seconds * 1e3:.3f} ms, {nbytes / seconds / 1e9:.1f} GB/s"
    return f"{seconds * 1e3:.3f} ms, {m * n * k / seconds / 1e9:.0f} GMAC/s"


def time_rotating(clock: Clock, ws: list[Any], fn: Callable[[Any], object], m: int) -> float:
    """Median time of fn(weight): at M = 1 cycling through the cold copies, else the first weight."""
    if m == 1:
        return clock.median(lambda i: fn(ws[i % len(ws)]))
    return clock.median(lambda _: fn(ws[0]))


def row_cells(mod: Any, clock: Clock, w: Weights, name: str, m: int, n: int, k: int, levels: list[str],
              baselines: bool) -> tuple[list[str], float, float]:
    """Timings of one (linear, type, M): our kernels per level, then torch fp32, torch bf16 (or
    empty cells). Returns the cells, our best time and torch fp32's time (nan when not run)."""
    x = torch.randn(m, k)
    cells, best = [], math.inf
    for lv in levels:
        mod.set_active_isa(lv)
        t = time_rotating(clock, w.packed, lambda pw: pw.forward(x), m)
        best = min(best, t)
        cells.append(rate(t, m, n, k, w.packed[0].nbytes))
    mod.set_active_isa(mod.cpu_isa())
    t32 = math.nan
    if baselines:
        t32 = time_rotating(clock, w.f32, lambda wf: F.linear(x, wf), m)
        xb = x.to(torch.bfloat16)
        tb = time_rotating(clock, w.bf16, lambda wb: F.linear(xb, wb), m)
        cells += [rate(t32, m, n, k, n * k * 4), rate(tb, m, n, k, n * k * 2)]
    else:
        cells += ["", ""]
    return cells, best, t32


def run_size(mod: Any, clock: Clock, size: str, types: list[str], ms: list[int], levels: list[str],
             cold_bytes: int) -> None:
    print(f"\n### {size}: hidden {SIZES[size][0]}, intermediate {SIZES[size][1]}\n")
    print("| linear N x K | type | packed MB (x GGUF) | M | " + " | ".join(f"qgemm {lv}" for lv in levels)
          + " | torch fp32 | torch bf16 | best qgemm vs fp32 |")
    print("|---" * (len(levels) + 7) + "|")
    for lin, n, k in linears(size):
        for ti, name in enumerate(types):
            if k % BLOCKS[name][1]:
                continue
            w = make_weights(mod, name, n, k, cold_bytes, 1 in ms, with_torch=ti == 0)
            ratio = w.packed[0].nbytes / (n * k // BLOCKS[name][1] * BLOCKS[name][2])
            for m in ms:
                cells, best, t32 = row_cells(mod, clock, w, name, m, n, k, levels, ti == 0)
                speed = f"{t32 / best:.1f}x" if not math.isnan(t32) else ""
                print(f"| {lin} {n} x {k} | {name} | {w.packed[0].nbytes / 1e6:.1f} ({ratio:.3f}) | {m} | "
                      + " | ".join(cells) + f" | {speed} |", flush=True)
            del w


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="135M,1.7B,7B")
    ap.add_argument("--types", default="Q4_0,Q4_K,Q6_K,Q8_0")
    ap.add_argument("--ms", default="1,4,16,32,64,512")
    ap.add_argument("--levels", default=None, help="ISA levels to run (default: avx2 and up, as the CPU has)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--cold-mib", type=int, default=512)
    args = ap.parse_args()
    mod = K.require()
    clock = Clock(args.clock)
    torch.set_num_threads(1 if args.clock == "cpu" else args.threads)
    levels = args.levels.split(",") if args.levels else [
        lv for lv in ("avx2", "avx512", "amx") if mod.cpu_supports(lv)]
    read_bw, copy_bw = stream_bandwidth(clock)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.processor() or platform.machine()}, "
          f"CPU ISA {mod.cpu_isa()}, {torch.get_num_threads()} threads, {args.clock} clock; stream bandwidth: "
          f"read {read_bw:.1f} GB/s (torch sum of 512 MiB), copy {copy_bw:.1f} GB/s (read+write)")
    for size in args.sizes.split(","):
        run_size(mod, clock, size, args.types.split(","), [int(v) for v in args.ms.split(",")], levels,
                 args.cold_mib << 20)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Decode attention time by KV cache dtype (`--kv-cache-dtype`): fp32, bf16, int8, fp8 (e4m3) side by side.

    PYTHONPATH=. python benchmarks/kv_cache_dtype.py [--threads 2] [--rounds 5] [--isa avx512] [--cpu-time]
        [--cases 8x4096,1x8192] [--cycle 3]

One decode step's attention (reshape_and_cache + paged_attention of every layer) at long context, for the default
model's shape (SmolLM2-135M: 30 layers, 9 query / 3 KV heads of 64) and the 1.7B shape (Qwen3-1.7B: 28 layers,
16 / 8 heads of 128): batch 8 at 4k context and batch 1 at 8k. Each format gets caches for `--cycle` layers (cycled,
so the working set is well past the last-level cache and the step reads its KV from memory, as serving does); the
step time is the mean per-layer call times the model's layer count. Formats run interleaved, round after round, so
a busy machine slows them alike; the table gives the median over rounds and the ratio to the first format of the
same round. `--cpu-time`: one kernel thread, timed by the CPU time of the calling thread (the kernels run on it), so
another process on the machine hardly moves the figures; with `--cycle 1` the caches of short contexts stay in L2
and the figures are the kernels' arithmetic, not the memory's.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

import pdserve.kernels as K
from pdserve.model.kv_cache_dtype import is_quantized, quantize_kv

SHAPES = {"smollm2-135m": (30, 9, 3, 64), "qwen3-1.7b": (28, 16, 8, 128),  # layers, Hq, Hkv, head_dim
          "llama-1.7b": (24, 32, 32, 64)}  # SmolLM2-1.7B (MHA): the 1.7B shape of the benchmarks
FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
BS = 16


class Case:
    """`cycle` layers' caches of one format holding `batch` sequences of `ctx` keys, and one decode row each."""

    def __init__(self, shape: tuple[int, int, int, int], batch: int, ctx: int, dtype: torch.dtype, cycle: int) -> None:
        _, hq, hkv, d = shape
        g = torch.Generator().manual_seed(0)
        per_seq = math.ceil((ctx + 1) / BS)
        nb = batch * per_seq
        self.caches = []
        for _ in range(cycle):  # random K/V, stored as the format stores them
            x = torch.randn(2, nb, BS, hkv, d, generator=g)
            self.caches.append(quantize_kv(x, dtype).view(dtype) if is_quantized(dtype) else x.to(dtype))
        self.bt = torch.arange(nb, dtype=torch.int32).view(batch, per_seq)
        self.qsl = torch.arange(batch + 1, dtype=torch.int32)
        self.lens = torch.full((batch,), ctx + 1, dtype=torch.int32)
        self.slots = torch.tensor([s * per_seq * BS + ctx for s in range(batch)])
        self.q = torch.randn(batch, hq, d, generator=g)
        self.k, self.v = torch.randn(batch, hkv, d, generator=g), torch.randn(batch, hkv, d, generator=g)
        self.out = torch.empty_like(self.q)
        self.scale = d ** -0.5
        self.i = 0

    def layer(self, mod: object) -> None:
        cache = self.caches[self.i % len(self.caches)]
        self.i += 1
        mod.reshape_and_cache(self.k, self.v, cache, self.slots)  # type: ignore[attr-defined]
        mod.paged_attention(self.out, self.q, cache, self.bt, self.qsl, self.lens, self.scale)  # type: ignore


def time_layers(mod: object, case: Case, calls: int, clock=time.perf_counter) -> float:
    """Mean seconds per layer call over `calls` back-to-back calls."""
    t0 = clock()
    for _ in range(calls):
        case.layer(mod)
    return (clock() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=0, help="kernel threads (0: torch's choice)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=12, help="layer calls per format per round")
    ap.add_argument("--cycle", type=int, default=3, help="layers' caches cycled per format")
    ap.add_argument("--isa", default=None, help="force a kernel ISA level (default: the CPU's best)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--cases", default="8x4096,1x8192", help="batch x context pairs")
    ap.add_argument("--cpu-time", action="store_true", help="one thread, timed in its CPU time")
    args = ap.parse_args()
    if args.threads or args.cpu_time:
        torch.set_num_threads(1 if args.cpu_time else args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    mod = K.require()
    if args.isa:
        mod.set_active_isa(args.isa)
    formats = args.formats.split(",")
    timing = "CPU" if args.cpu_time else "wall"
    print(f"ISA {mod.active_isa()}, {torch.get_num_threads()} threads ({timing} time), load average "
          f"{open('/proc/loadavg').read().split()[0]}")
    print("| shape | batch x context | " + " | ".join(f"{f} ms/step" for f in formats) + " | "
          + " | ".join(f"{f} / {formats[0]}" for f in formats[1:]) + " |")
    print("|---|---|" + "---:|" * (2 * len(formats) - 1))
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        for batch, ctx in (tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")):
            cases = {f: Case(shape, batch, ctx, FORMATS[f], args.cycle) for f in formats}
            per: dict[str, list[float]] = {f: [] for f in formats}
            for f in formats:
                time_layers(mod, cases[f], max(2, args.cycle))  # warm: pages touched, threads up
            for _ in range(args.rounds):
                for f in formats:
                    per[f].append(time_layers(mod, cases[f], args.calls, clock) * shape[0] * 1e3)
            ratios = [statistics.median(a / b for a, b in zip(per[f], per[formats[0]])) for f in formats[1:]]
            print(f"| {name} | {batch} x {ctx} | " + " | ".join(f"{statistics.median(per[f]):.2f}" for f in formats)
                  + " | " + " | ".join(f"{r:.2f}" for r in ratios) + " |", flush=True)
            del cases


if __name__ == "__main__":
    main()

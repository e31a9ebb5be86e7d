"""Float-weight GEMMs (`pack_float`, csrc/fgemm*.cpp) against torch's F.linear (fp32 and bf16, oneDNN/MKL) and
pdserve/model/cpu_linear.py's pre-packed oneDNN fp32 path, at the gate_up and down shapes of SmolLM2-135M, a 1.7B
(SmolLM2-1.7B) and a 7B (Llama-2-7B) layer.

    OMP_WAIT_POLICY=passive PYTHONPATH=. .venv/bin/python benchmarks/kernels_fgemm.py [--threads 1] \
        [--models 135m,1.7b,7b] [--rows 1,4,16,32,64,512] [--clock cpu|wall] [--cold-mib 768]

M = 1 is a decode step: the call cycles through copies of the weight totalling --cold-mib, so every call reads its
weight from DRAM; the cell is GB/s = bytes stored / time, to compare with the read bandwidth printed first (a
1 GiB torch.sum). M >= 4: one weight, repeated (cache-hot); the cell is GFLOP/s = 2 M N K / time. Every cell is
the best of several samples of one method, methods measured one after another (memory: the cold copies of one
method at a time).
--clock cpu (default): process CPU time, so on a shared machine the time this process was not running is left
out; with --threads > 1 every thread's CPU time is summed (figures per core: the aggregate is about `threads` x
that when the cores are free; OMP_WAIT_POLICY=passive keeps idle OpenMP threads from spinning). --clock wall:
elapsed time.
Columns: torch fp32, torch bf16 (x and W bf16), oneDNN fp32 packed, then pack_float "f32" and "bf16" at each ISA
level this CPU runs that has its own kernel for the format (f32 at avx512_bf16/amx is avx512's kernel).
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import pdserve.kernels as K
from pdserve.model.cpu_linear import pack_weight, packed_linear

# model -> (hidden, intermediate)
MODELS = {"135m": (576, 1536), "1.7b": (2048, 8192), "7b": (4096, 11008)}
F32_LEVELS = ("avx2", "avx512")
BF16_LEVELS = ("avx2", "avx512", "avx512_bf16", "amx")

Clock = Callable[[], float]


def best_time(fn: Callable[[], Any], clock: Clock, budget_s: float = 0.4, min_samples: int = 3) -> float:
    fn()
    samples: list[float] = []
    spent = 0.0
    while len(samples) < min_samples or (spent < budget_s and len(samples) < 50):
        t0 = clock()
        fn()
        dt = clock() - t0
        samples.append(dt)
        spent += dt
    return min(samples)


def read_bandwidth(clock: Clock) -> float:
    buf = torch.ones(256 << 20)  # 1 GiB
    t = best_time(lambda: buf.sum(), clock, budget_s=1.0)
    return buf.numel() * 4 / t / 1e9


class Method:
    """One way to compute y = x @ W.T: `make(w)` builds what the call reads (from the fp32 weight), `call(obj, x)`."""

    def __init__(self, name: str, make: Callable[[torch.Tensor], Any], call: Callable[[Any, torch.Tensor], Any],
                 level: str | None = None, bytes_per: int = 4, bf16_x: bool = False) -> None:
        self.name, self.make, self.call, self.level = name, make, call, level
        self.bytes_per, self.bf16_x = bytes_per, bf16_x


def methods(mod: Any) -> list[Method]:
    out = [
        Method("torch fp32", lambda w: w.clone(), lambda w, x: F.linear(x, w)),
        Method("torch bf16", lambda w: w.bfloat16(), lambda w, x: F.linear(x, w), bytes_per=2, bf16_x=True),
        Method("oneDNN fp32 packed", pack_weight, lambda w, x: packed_linear(x, w, None)),
    ]
    for lv in F32_LEVELS:
        if mod.cpu_supports(lv):
            out.append(Method(f"f32 {lv}", lambda w: mod.pack_float(w, "f32"), lambda p, x: p.forward(x), lv))
    for lv in BF16_LEVELS:
        if mod.cpu_supports(lv):
            out.append(Method(f"bf16 {lv}", lambda w: mod.pack_float(w, "bf16"), lambda p, x: p.forward(x), lv,
                              bytes_per=2))
    return out


def measure(mod: Any, m: Method, w: torch.Tensor, rows: int, clock: Clock, cold_bytes: int) -> float:
    """Seconds per call of method m at `rows` rows (rows == 1: cycling through cold copies)."""
    n, k = w.shape
    x = torch.randn(rows, k)
    if m.bf16_x:
        x = x.bfloat16()
    if m.level is not None:
        mod.set_active_isa(m.level)
    copies = [m.make(w) for _ in range(max(1, cold_bytes // (n * k * m.bytes_per)) if rows == 1 else 1)]

    def run() -> None:
        for c in copies:
            m.call(c, x)

    t = best_time(run, clock) / len(copies)
    copies.clear()
    gc.collect()
    return t


def table(mod: Any, model: str, name: str, n: int, k: int, rows: list[int], clock: Clock, cold_bytes: int) -> None:
    ms = methods(mod)
    print(f"\n{model} {name} [N={n}, K={k}]: M=1 GB/s (weight bytes from DRAM), M>=4 GFLOP/s\n")
    print("| M | " + " | ".join(m.name for m in ms) + " |")
    print("|---:|" + "---:|" * len(ms))
    w = torch.randn(n, k) * 0.05
    for r in rows:
        cells = []
        for m in ms:
            t = measure(mod, m, w, r, clock, cold_bytes)
            cells.append(f"{n * k * m.bytes_per / t / 1e9:.1f}" if r == 1 else f"{2 * r * n * k / t / 1e9:.0f}")
        print(f"| {r} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--models", default="135m,1.7b,7b")
    ap.add_argument("--rows", default="1,4,16,32,64,512")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--cold-mib", type=int, default=768)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mod = K.require()
    clock: Clock = time.process_time if args.clock == "cpu" else time.perf_counter
    before = mod.active_isa()
    print(f"threads {args.threads}, clock {args.clock}, CPU ISA {mod.cpu_isa()}, "
          f"read bandwidth {read_bandwidth(clock):.1f} GB/s (1 GiB torch.sum)")
    rows = [int(r) for r in args.rows.split(",")]
    for model in args.models.split(","):
        hidden, inter = MODELS[model]
        for name, n, k in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
            table(mod, model, name, n, k, rows, clock, args.cold_mib << 20)
    mod.set_active_isa(before)


if __name__ == "__main__":
    main()

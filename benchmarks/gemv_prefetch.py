"""Decode GEMVs from DRAM with and without their L2 prefetch (`PDSERVE_PREFETCH_BYTES`), in one process.

    PYTHONPATH=. .venv/bin/python benchmarks/gemv_prefetch.py [--types Q4_0,Q4_K,Q6_K,Q8_0] [--threads 1,2]
        [--levels avx2,avx512] [--distances 0,6144] [--rounds 4] [--matrices 24]

Per type: `--matrices` random GGUF weights of the 1.7B Llama shape's down projection (2048 x 8192, packed by
pack_gguf), each multiplied by one activation row in turn, so every call reads its weight from memory as a decode
step reads its layers (24 x ~10-14 MB: well past the last-level cache). The distances alternate round after round
(set_stream_prefetch_bytes between calls), so load from other users of the machine falls on each alike; the table
gives the median GB/s of the packed bytes over rounds and the ratio to the first distance. "hot" is one 512 x 2048
weight called back to back (it stays in L2): the kernels' arithmetic rate, which no prefetch changes.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np
import torch

import pdserve.kernels as K
from pdserve.kernels.gguf_random import BLOCKS, random_blocks


def cold_rate(ws: list, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    for w in ws:
        w.forward(x, None)
    return sum(w.nbytes for w in ws) / (time.perf_counter() - t0) / 1e9


def hot_rate(w: object, x: torch.Tensor, calls: int = 200) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            w.forward(x, None)  # type: ignore[attr-defined]
        best = min(best, (time.perf_counter() - t0) / calls)
    return w.nbytes / best / 1e9  # type: ignore[attr-defined]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_0,Q4_K,Q6_K,Q8_0")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--levels", default=None, help="ISA levels (default: avx2 and up, as the CPU has)")
    ap.add_argument("--distances", default="0,6144", help="prefetch distances in bytes, the first the reference")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--matrices", type=int, default=24)
    args = ap.parse_args()
    lib = K.require()
    levels = args.levels.split(",") if args.levels else [lv for lv in ("avx2", "avx512") if lib.cpu_supports(lv)]
    dists = [int(d) for d in args.distances.split(",")]
    before = lib.stream_prefetch_bytes()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, CPU ISA {lib.cpu_isa()}, "
          f"default distance {before} bytes")
    print("\n| type | level | threads | hot GB/s | " + " | ".join(f"{d} B: GB/s" for d in dists)
          + " | " + " | ".join(f"{d} / {dists[0]}" for d in dists[1:]) + " |")
    print("|---|---|---|---:|" + "---:|" * (2 * len(dists) - 1))
    rng = np.random.default_rng(0)
    try:
        for name in args.types.split(","):
            ws = [lib.pack_gguf(torch.from_numpy(random_blocks(rng, 2048, 8192, name)), BLOCKS[name][0], 8192)
                  for _ in range(args.matrices)]
            small = lib.pack_gguf(torch.from_numpy(random_blocks(rng, 512, 2048, name)), BLOCKS[name][0], 2048)
            x, xs = torch.randn(1, 8192), torch.randn(1, 2048)
            for level in levels:
                lib.set_active_isa(level)
                for threads in (int(t) for t in args.threads.split(",")):
                    torch.set_num_threads(threads)
                    cold_rate(ws, x)  # first touch, caches warm for the code
                    rates: dict[int, list[float]] = {d: [] for d in dists}
                    for _ in range(args.rounds):
                        for d in dists:
                            lib.set_stream_prefetch_bytes(d)
                            rates[d].append(cold_rate(ws, x))
                    lib.set_stream_prefetch_bytes(before)
                    hot = hot_rate(small, xs)
                    med = {d: statistics.median(r) for d, r in rates.items()}
                    print(f"| {name} | {level} | {threads} | {hot:.1f} | "
                          + " | ".join(f"{med[d]:.1f}" for d in dists) + " | "
                          + " | ".join(f"{med[d] / med[dists[0]]:.2f}x" for d in dists[1:]) + " |", flush=True)
            lib.set_active_isa(lib.cpu_isa())
    finally:
        lib.set_stream_prefetch_bytes(before)
        lib.set_active_isa(lib.cpu_isa())


if __name__ == "__main__":
    main()

"""TTFT-relevant attention time: one layer's paged attention over a whole prompt (512 or 2048 tokens, as one chunk
and as chunks of 512 tokens with their context), at the SmolLM2-135M (9 query / 3 KV heads) and SmolLM2-1.7B
(32 / 32) head shapes, head_dim 64, f32, bf16 and int8 caches, per ISA level this CPU has, optionally against another
checkout's kernels (today's, e.g. /work/main).

    OMP_WAIT_POLICY=passive PYTHONPATH=. .venv/bin/python benchmarks/attention_prefill.py [--threads 1] \
        [--baseline /work/main] [--clock cpu|wall] [--quick]

Cells: milliseconds per layer (best of a few runs; --clock cpu = process CPU time, every thread's summed, so a
shared machine's other work is left out), and the prompt's total over all layers in the last columns of the
summary. Every row is a prompt row (prompt_lens = seq_lens), as in a prefill. Levels without a kernel of their own
for a cache dtype run the level below (f32 caches: avx512 from avx512 up). bf16 caches at avx512_bf16 and amx run
the level's bf16 dot-product kernel (vdpbf16ps, AMX tiles) for prompt rows from --bf16-min-group query heads per KV
head on (default 1: every shape); int8 caches the vdpbf16ps kernel at both (key tiles converted to bf16), the fp32
kernel below. The baseline runs in a subprocess that imports pdserve from that checkout.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import pdserve.kernels as K
from pdserve.model.kv_cache_dtype import quantize_kv

SHAPES = {"135m": (9, 3, 30), "1.7b": (32, 32, 24)}  # (query heads, KV heads, layers)
D, BS = 64, 16
LEVELS = ("avx2", "avx512", "avx512_bf16", "amx")


def cases(quick: bool) -> list[tuple[str, str, int, int]]:
    """(shape, cache dtype, prompt tokens, chunk tokens)."""
    out = []
    for shape in SHAPES:
        for dtype in ("f32", "bf16", "int8"):
            for n, chunk in ((512, 512), (2048, 2048), (2048, 512)):
                if not (quick and n == 2048):
                    out.append((shape, dtype, n, chunk))
    return out


class Prompt:
    """One layer: a prompt of n tokens whose K/V are in the cache, attended chunk by chunk."""

    def __init__(self, hq: int, hkv: int, n: int, dtype: torch.dtype) -> None:
        g = torch.Generator().manual_seed(n + hq)
        nb = math.ceil(n / BS)
        values = torch.randn(2, nb, BS, hkv, D, generator=g)
        self.cache = quantize_kv(values, dtype).view(dtype) if dtype == torch.int8 else values.to(dtype)
        self.bt = torch.randperm(nb, generator=g).to(torch.int32)[None, :]
        self.q = torch.randn(n, hq, D, generator=g)
        self.out = torch.empty_like(self.q)
        self.n = n

    def run(self, mod: Any, chunk: int) -> None:
        for c0 in range(0, self.n, chunk):
            c1 = min(self.n, c0 + chunk)
            qsl = torch.tensor([0, c1 - c0], dtype=torch.int32)
            seq_lens = torch.tensor([c1], dtype=torch.int32)  # every row a prompt row, as in a prefill
            mod.paged_attention(self.out[c0:c1], self.q[c0:c1], self.cache, self.bt, qsl, seq_lens, D ** -0.5, 0,
                                0.0, seq_lens)


def best(fn: Callable[[], Any], clock: Callable[[], float], runs: int = 3) -> float:
    fn()
    times = []
    for _ in range(runs):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times)


def measure(levels: list[str], quick: bool, clock: Callable[[], float]) -> dict[str, float]:
    """{"shape dtype n chunk level": seconds per layer}, for the levels this process's kernels have."""
    mod = K.require()
    before = mod.active_isa()
    res = {}
    for shape, dt, n, chunk in cases(quick):
        hq, hkv, _ = SHAPES[shape]
        p = Prompt(hq, hkv, n, {"f32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}[dt])
        for lv in levels:
            mod.set_active_isa(lv)
            res[f"{shape} {dt} {n} {chunk} {lv}"] = best(functools.partial(p.run, mod, chunk), clock)
    mod.set_active_isa(before)
    return res


def levels_here(mod: Any, levels: tuple[str, ...] = LEVELS) -> list[str]:
    return [lv for lv in levels if mod.cpu_supports(lv)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--baseline", default=None, help="another checkout whose kernels to time as well")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--quick", action="store_true", help="512-token prompts only")
    ap.add_argument("--bf16-min-group", type=int, default=1)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    mod = K.require()
    if hasattr(mod, "set_attention_bf16_min_group"):
        mod.set_attention_bf16_min_group(args.bf16_min_group)
    mine_levels = levels_here(mod)
    if args.child:  # today's kernels: avx2 and avx512 entries only (higher levels ran avx512's)
        print(json.dumps(measure(levels_here(mod, ("avx2", "avx512")), args.quick, clock)))
        return
    base: dict[str, float] = {}
    base_levels: list[str] = []
    if args.baseline:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--threads", str(args.threads),
               "--clock", args.clock] + (["--quick"] if args.quick else [])
        env = dict(os.environ, PYTHONPATH=args.baseline)
        base = json.loads(subprocess.run(cmd, cwd=args.baseline, env=env, check=True, capture_output=True,
                                         text=True).stdout.strip().splitlines()[-1])
        base_levels = sorted({k.rsplit(" ", 1)[1] for k in base}, key=LEVELS.index)
    mine = measure(mine_levels, args.quick, clock)
    print(f"threads {args.threads}, clock {args.clock}, CPU ISA {mod.cpu_isa()}; ms per layer"
          + (f"; baseline = {args.baseline}" if args.baseline else ""))
    cols = [f"baseline {lv}" for lv in base_levels] + list(mine_levels)
    print("\n| head shape, cache, prompt (chunk) | " + " | ".join(cols)
          + " | best / baseline avx512 | prompt ms, best |")
    print("|---|" + "---:|" * (len(cols) + 2))
    for shape, dt, n, chunk in cases(args.quick):
        key = f"{shape} {dt} {n} {chunk}"
        cells = [base.get(f"{key} {lv}", float("nan")) for lv in base_levels]
        cells += [mine[f"{key} {lv}"] for lv in mine_levels]
        top = min(mine[f"{key} {lv}"] for lv in mine_levels)
        ref = base.get(f"{key} avx512", mine.get(f"{key} avx512", float("nan")))
        label = f"{shape}, {dt}, {n} ({'one chunk' if chunk == n else f'chunks of {chunk}'})"
        print(f"| {label} | " + " | ".join(f"{t * 1e3:.2f}" for t in cells)
              + f" | {ref / top:.2f}x | {top * SHAPES[shape][2] * 1e3:.0f} |", flush=True)


if __name__ == "__main__":
    main()

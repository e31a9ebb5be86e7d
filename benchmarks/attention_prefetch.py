"""Decode attention with and without the kernels' K/V prefetch (KvRowsAhead: each head's rows of the next key
tile into L2), one process, the two settings alternating round by round so that other load on the machine falls on
both alike.

    PYTHONPATH=. .venv/bin/python benchmarks/attention_prefetch.py [--threads 2] [--rounds 6] [--levels avx2,avx512]
        [--cases smollm2-135m:32x192:bf16,llama-1.7b:8x500:bf16,...]

A case is shape:batch x context:cache format. Each sequence's blocks are scattered over the cache as a serving
engine's allocator leaves them (a random permutation), and the caches of enough layers are cycled that the step reads
its K/V from memory. Cells: one decode step's attention (every layer), ms, median over rounds; ratio = on / off.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import pdserve.kernels as K
from benchmarks.kv_cache_dtype import FORMATS, SHAPES, Case

CASE_SHAPES = {**SHAPES, "g8-128": (48, 32, 4, 128)}  # Qwen3-30B-A3B's heads: 8 query heads a KV head
DEFAULT_CASES = ("smollm2-135m:32x192:bf16,smollm2-135m:32x192:int8,smollm2-135m:32x192:fp32,smollm2-135m:8x1000:bf16,"
                 "smollm2-135m:1x4096:bf16,llama-1.7b:1x200:bf16,llama-1.7b:1x1000:bf16,llama-1.7b:8x500:bf16,"
                 "qwen3-1.7b:16x256:bf16,g8-128:16x256:bf16")


def scattered(shape: tuple[int, int, int, int], batch: int, ctx: int, fmt: str) -> Case:
    layers, _, hkv, d = shape
    cycle = max(1, min(layers, int(3e8 // (batch * (ctx + 16) * hkv * d * 4))))  # >= ~300 MB of fp32-sized KV
    case = Case(shape, batch, ctx, FORMATS[fmt], cycle)
    perm = torch.randperm(case.bt.numel(), generator=torch.Generator().manual_seed(1)).to(torch.int32)
    case.bt = perm[case.bt.flatten().long()].view_as(case.bt).contiguous()
    case.slots = torch.tensor([int(case.bt[s, ctx // 16]) * 16 + ctx % 16 for s in range(batch)])
    return case


def measure(mod: object, case: Case, layers: int, calls: int, rounds: int) -> tuple[float, float]:
    per: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for on in (False, True):
            mod.set_attention_prefetch(on)  # type: ignore[attr-defined]
            for _ in range(max(1, calls // 2)):
                case.layer(mod)
            t0 = time.perf_counter()
            for _ in range(calls):
                case.layer(mod)
            per[on].append((time.perf_counter() - t0) / calls * layers * 1e3)
    return statistics.median(per[False]), statistics.median(per[True])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--levels", default=None, help="ISA levels (default: the CPU's best)")
    ap.add_argument("--cases", default=DEFAULT_CASES)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mod = K.require()
    best, before = mod.active_isa(), mod.attention_prefetch()
    print(f"{args.threads} threads, load average {open('/proc/loadavg').read().split()[0]}")
    print("| level | shape | batch x context | cache | off ms/step | on ms/step | on / off |")
    print("|---|---|---|---|---:|---:|---:|")
    try:
        for level in (args.levels or best).split(","):
            mod.set_active_isa(level)
            for spec in args.cases.split(","):
                name, bc, fmt = spec.split(":")
                batch, ctx = (int(x) for x in bc.split("x"))
                case = scattered(CASE_SHAPES[name], batch, ctx, fmt)
                calls = max(10, int(2000 / (batch * ctx / 100 + 5)))
                off, on = measure(mod, case, CASE_SHAPES[name][0], calls, args.rounds)
                print(f"| {level} | {name} | {bc} | {fmt} | {off:.2f} | {on:.2f} | {on / off:.2f} |", flush=True)
                del case
    finally:
        mod.set_active_isa(best)
        mod.set_attention_prefetch(before)


if __name__ == "__main__":
    main()

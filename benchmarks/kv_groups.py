"""KV cache groups on a sliding-window model (Gemma 3 270M: 15 local layers with a 512-token window, 3 global ones):
one block table of every layer (`--disable-hybrid-kv-cache-manager`) against groups whose local blocks out of the
window are freed, in one run.

    .venv/bin/python benchmarks/kv_groups.py [--model gemma3-270m] [--context 8000] [--steps 64]
                                             [--requests 12] [--prompt 3000] [--kv-cache-memory 96MiB]

1. Memory of one long conversation: one greedy request of `--context` prompt tokens and `--steps` output tokens;
   the most KV bytes the pool held at once (blocks in use x bytes a block), and the median decode step (model_s of
   the step log) at that context.
2. Capacity: `--requests` requests of `--prompt` tokens (distinct, no prefix hits) and `--steps` outputs sent at
   once into a `--kv-cache-memory` pool: the most requests running at once, preemptions, and the wall time to finish
   them all (offline, whole engine).
Both layouts run the same weights, kernels and threads; greedy outputs are compared.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

from kv_decode_long import cpu_model

from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams


def block_bytes(llm: LLM) -> int:
    cache = llm.engine.runner.kv_cache
    return cache.numel() * cache.element_size() // cache.shape[2]


def run(llm: LLM, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    """Step the engine until the prompts finish; what the pool and the scheduler did meanwhile."""
    eng = llm.engine
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    preempt0 = eng.scheduler.num_preemptions
    reqs = [eng.add_request({"prompt_token_ids": p}, params) for p in prompts]
    peak_blocks = peak_running = 0
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        peak_blocks = max(peak_blocks, eng.block_manager.num_used_blocks)
        peak_running = max(peak_running, eng.scheduler.num_running)
    wall = time.perf_counter() - t0
    recs, _ = eng.step_log.between(t0, time.perf_counter())
    decode = [r.model_s for r in recs if r.num_decodes == len(prompts) and not r.prefill_chunks]
    return {"tokens": [list(r.output_token_ids) for r in reqs], "peak_mib": peak_blocks * block_bytes(llm) / 2**20,
            "peak_running": peak_running, "preemptions": eng.scheduler.num_preemptions - preempt0, "wall_s": wall,
            "decode_ms": 1000 * statistics.median(decode) if decode else float("nan")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=3000)
    ap.add_argument("--kv-cache-memory", default="96MiB")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    print(f"# {cpu_model()}, {os.cpu_count()} CPUs, model {args.model}, dtype {args.dtype}")
    rng = random.Random(0)
    layouts = {"one table": True, "groups": False}
    rows: dict[str, dict[str, Any]] = {}
    for name, disable in layouts.items():
        long_llm = LLM(args.model, dtype=args.dtype, kv_cache_memory=f"{max(256, args.context // 8)}MiB",
                       max_model_len=args.context + args.steps + 16, disable_hybrid_kv_cache_manager=disable,
                       enable_prefix_caching=False)
        vocab = long_llm.engine.arch.vocab_size
        print(f"{name}: {long_llm.engine.kv_layout.num_groups} group(s), {block_bytes(long_llm)} bytes a block")
        rng.seed(1)
        one = run(long_llm, [[rng.randrange(1000, vocab) for _ in range(args.context)]], args.steps)
        del long_llm
        llm = LLM(args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                  max_model_len=args.prompt + args.steps + 16, disable_hybrid_kv_cache_manager=disable,
                  enable_prefix_caching=False)
        rng.seed(2)
        many = run(llm, [[rng.randrange(1000, vocab) for _ in range(args.prompt)] for _ in range(args.requests)],
                   args.steps)
        rows[name] = {"one": one, "many": many}
        del llm
    same = all(rows["groups"][k]["tokens"] == rows["one table"][k]["tokens"] for k in ("one", "many"))
    print(f"\n1. one request, {args.context} prompt + {args.steps} output tokens")
    print("| layout | peak KV held | decode step (median) |\n|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['one']['peak_mib']:.1f} MiB | {r['one']['decode_ms']:.2f} ms |")
    print(f"\n2. {args.requests} requests of {args.prompt} + {args.steps} tokens at once, "
          f"KV pool {args.kv_cache_memory}")
    print("| layout | most running at once | preemptions | wall time |\n|---|---|---|---|")
    for name, r in rows.items():
        m = r["many"]
        print(f"| {name} | {m['peak_running']} | {m['preemptions']} | {m['wall_s']:.1f} s |")
    print(f"\ngreedy outputs equal: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())

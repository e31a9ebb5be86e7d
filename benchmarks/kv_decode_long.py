"""Batch-1 decode at long context, whole engine, by KV cache dtype: the default model's decode step with an ~8k-token
context in a bf16 KV cache against int8 (and any other `--kv-cache-dtype`), interleaved round by round.

    .venv/bin/python benchmarks/kv_decode_long.py [--context 8000] [--steps 64] [--rounds 4] [--formats bf16,int8]

One engine per format (same weights, the default `--dtype`, kernels and threads); each round sends each engine one
greedy request of `--context` random prompt tokens (fresh per round: no prefix-cache hit) and `--steps` output
tokens, and reads the engine's step log: the median `model_s` (forward + sampling) of its decode-only steps. The
table gives the median over rounds per format and its ratio to the first format of the same round. The model's
weights are the same in every engine, so the difference is the attention reading the KV cache (and writing it).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import subprocess
import time

from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


def decode_step_ms(llm: LLM, prompt: list[int], steps: int) -> float:
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
    steps_seen, _ = llm.engine.step_log.between(t0, time.perf_counter())
    recs = [r for r in steps_seen if r.num_decodes == 1 and not r.prefill_chunks]
    return 1000 * statistics.median(r.model_s for r in recs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--formats", default="bf16,int8")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-memory", default=None, help="per engine (default: enough for the default model)")
    args = ap.parse_args()
    formats = args.formats.split(",")
    memory = args.kv_cache_memory or f"{max(256, args.context // 16)}MiB"
    engines = {f: LLM(args.model, dtype=args.dtype, kv_cache_dtype=f, kv_cache_memory=memory,
                      max_model_len=args.context + args.steps + 16, enable_prefix_caching=False)
               for f in formats}
    vocab = engines[formats[0]].engine.arch.vocab_size
    rng = random.Random(0)
    times: dict[str, list[float]] = {f: [] for f in formats}
    ratios: dict[str, list[float]] = {f: [] for f in formats}
    for r in range(args.rounds):
        prompt = [rng.randrange(100, vocab) for _ in range(args.context)]
        got = {f: decode_step_ms(engines[f], prompt, args.steps) for f in (formats if r % 2 == 0 else formats[::-1])}
        for f in formats:
            times[f].append(got[f])
            ratios[f].append(got[f] / got[formats[0]])
        print(f"round {r}: " + ", ".join(f"{f} {got[f]:.2f} ms" for f in formats), flush=True)
    print(f"\n{cpu_model()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.model}, context {args.context}, "
          f"dtype {args.dtype}")
    print(f"| KV cache | decode step ms (median of {args.rounds}) | / {formats[0]} (median of rounds) |")
    print("|---|---:|---:|")
    for f in formats:
        print(f"| {f} | {statistics.median(times[f]):.2f} | {statistics.median(ratios[f]):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

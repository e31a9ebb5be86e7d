"""Does serving slow the engine down? One decode-heavy load run offline (`LLM.generate`, the engine alone) and served
(`pdserve serve` + the streaming benchmark client), compared by the engine's own step records.

    .venv/bin/python benchmarks/serving_loop.py [--model smollm2-135m] [--concurrency 32] [--prompts 64]
        [--input-len 128] [--output-len 128] [--rounds 2] [--serve-args "..."]

Offline, the steps come from the engine's step log; served, from `GET /v1/stats` over the run's window (the same
StepRecords, aggregated by the server). Per side: decode step p50/p90 (ms), the engine's busy share (step time over
wall time: what is left is the loop between steps), and output tokens/s. If the served decode step is slower than
the offline one, the serving process (HTTP, SSE, detokenizing, the GIL it shares with the engine thread) slows the
engine's work; if the busy share drops, it delays the steps; if neither, the server keeps up and the remaining gap
to a peer lies in the engine itself. Rounds alternate offline / served so that other load falls on both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdserve import SamplingParams
from pdserve.bench.config import BenchConfig
from pdserve.bench.runner import run_benchmark
from pdserve.launch import start_server


def offline(args: argparse.Namespace) -> dict[str, float]:
    from pdserve.llm import LLM

    llm = LLM(args.model, device_peaks="off", max_num_seqs=args.concurrency, **args.llm_options)
    rng = __import__("random").Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(args.input_len)]}
               for _ in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    steps, _ = llm.engine.step_log.between(t0, float("inf"))
    decode = sorted(s.end - s.start for s in steps if s.kind == "decode")
    busy = sum(s.end - s.start for s in steps if s.kind != "idle")
    llm.engine.close()
    return {"decode_p50_ms": 1e3 * statistics.median(decode), "decode_p90_ms": 1e3 * decode[int(0.9 * len(decode))],
            "busy_share": busy / wall, "tok_s": args.prompts * args.output_len / wall, "decode_steps": len(decode)}


def served(args: argparse.Namespace, log_dir: Path) -> dict[str, float]:
    srv = start_server(log_dir, "--model", args.model, "--max-num-seqs", str(args.concurrency), *args.serve_args)
    try:
        cfg = BenchConfig(base_url=srv.base_url, endpoint="/v1/completions", tokenizer="smollm2-135m",
                          dataset_name="random", prompt_token_ids=True, ignore_eos=True, temperature=0.0,
                          num_prompts=args.prompts, random_input_len=args.input_len,
                          random_output_len=args.output_len, max_concurrency=args.concurrency, disable_tqdm=True)
        warm = BenchConfig(**{**cfg.__dict__, "num_prompts": 2, "random_output_len": 4})
        asyncio.run(run_benchmark(warm))
        t0 = time.perf_counter()
        res = asyncio.run(run_benchmark(cfg))
        wall = time.perf_counter() - t0
        stats = httpx.get(f"{srv.base_url}/v1/stats", params={"window": f"{wall:.3f}"}, timeout=30).json()
    finally:
        srv.stop()
    block = next(iter(stats["models"].values())) if "models" in stats else stats
    decode = block["steps"]["by_kind"]["decode"]
    busy = sum(k["busy_share"] for k in block["steps"]["by_kind"].values())
    summary = res.summary()
    return {"decode_p50_ms": decode["step_ms"]["p50"], "decode_p90_ms": decode["step_ms"]["p90"], "busy_share": busy,
            "tok_s": summary["output_throughput"], "decode_steps": decode["steps"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--serve-args", default="", help="extra `pdserve serve` flags (also given to LLM where they map)")
    args = ap.parse_args(argv)
    args.serve_args = args.serve_args.split()
    args.llm_options = {}
    rows: dict[str, list[dict[str, float]]] = {"offline": [], "served": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side in ("offline", "served"):
                out = offline(args) if side == "offline" else served(args, Path(tmp))
                rows[side].append(out)
                print(f"round {r + 1} {side}: " + ", ".join(f"{k} {v:.3g}" for k, v in out.items()), file=sys.stderr,
                      flush=True)
    print(f"# serving loop: {args.model}, c={args.concurrency}, {args.prompts} prompts of {args.input_len} tokens -> "
          f"{args.output_len}; {os.cpu_count()} CPUs; medians of {args.rounds} rounds\n")
    print("| side | decode step p50 ms | p90 ms | engine busy share | output tok/s |\n|---|---:|---:|---:|---:|")
    med = {side: {k: statistics.median(x[k] for x in xs) for k in xs[0]} for side, xs in rows.items()}
    for side, m in med.items():
        print(f"| {side} | {m['decode_p50_ms']:.1f} | {m['decode_p90_ms']:.1f} | {m['busy_share']:.2f} | "
              f"{m['tok_s']:.0f} |")
    o, s = med["offline"], med["served"]
    print(f"\nserved / offline: decode step p50 {s['decode_p50_ms'] / o['decode_p50_ms']:.2f}x, "
          f"busy share {s['busy_share'] / o['busy_share']:.2f}x, tok/s {s['tok_s'] / o['tok_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

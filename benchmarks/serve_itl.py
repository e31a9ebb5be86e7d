"""Does HTTP work stall the engine loop? ITL seen by 32 concurrent streaming clients of `pdserve serve` against the
decode step time of the same engine offline (no HTTP), in one run.

    .venv/bin/python benchmarks/serve_itl.py [--clients 32] [--output-len 128] [--prompt-len 64]

If tokenizing, JSON and SSE writes for many clients ran on the engine's thread, each step would grow by that
work and client ITL would exceed the offline step time; with the engine in its own thread the two should match.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch

from pdserve import SamplingParams
from pdserve.launch import start_server
from pdserve.llm import LLM


def offline_decode_steps(args: argparse.Namespace, prompts: list[list[int]]) -> list[float]:
    llm = LLM(dtype=args.dtype, kv_cache_memory="1GiB", max_num_seqs=args.clients, num_threads=args.threads)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for p in prompts:
        eng.add_request({"prompt_token_ids": p}, params)
    steps: list[float] = []
    while eng.has_unfinished_requests():
        s = eng.step().stats
        if s.kind == "decode" and s.num_decode_tokens == args.clients:
            steps.append(s.duration)
    return steps


async def one_client(http: httpx.AsyncClient, url: str, prompt: list[int], n: int) -> list[float]:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    arrivals: list[float] = []
    async with http.stream("POST", url, json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0]["text"]:
                    arrivals.append(time.perf_counter())
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


async def served_itls(base: str, prompts: list[list[int]], n: int) -> list[float]:
    async with httpx.AsyncClient(timeout=600) as http:
        per = await asyncio.gather(*[one_client(http, base + "/v1/completions", p, n) for p in prompts])
    return [x for itls in per for x in itls]


def server_decode_step_mean(base: str) -> float:
    text = httpx.get(base + "/metrics").text
    vals = {}
    for line in text.splitlines():
        if line.startswith("pdserve:engine_step_time_seconds_") and 'step_kind="decode"' in line:
            key = line.split("{")[0].rsplit("_", 1)[1]
            vals[key] = float(line.rsplit(" ", 1)[1])
    return vals["sum"] / vals["count"]


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [[100 + (7 * i + j) % 40000 for j in range(args.prompt_len)] for i in range(args.clients)]

    steps = offline_decode_steps(args, prompts)
    with tempfile.TemporaryDirectory() as tmp:
        srv = start_server(Path(tmp), "--dtype", args.dtype, "--kv-cache-memory", "1GiB", "--max-num-seqs",
                           str(args.clients), "--num-threads", str(args.threads))
        try:
            asyncio.run(served_itls(srv.base_url, prompts[:4], 8))  # warm-up
            itls = asyncio.run(served_itls(srv.base_url, prompts, args.output_len))
            server_step = server_decode_step_mean(srv.base_url)
        finally:
            srv.stop()

    off = statistics.median(steps) * 1000
    cpu = subprocess.run(["sh", "-c", "lscpu | grep 'Model name' | cut -d: -f2"], capture_output=True, text=True)
    print(f"# serve_itl: {args.clients} streaming clients, prompt {args.prompt_len}, output {args.output_len}, "
          f"dtype {args.dtype}, {args.threads} threads; {cpu.stdout.strip()}, torch {torch.__version__}, "
          f"python {platform.python_version()}, {time.strftime('%Y-%m-%d')}")
    print("| measure | ms |")
    print("| --- | --- |")
    print(f"| offline decode step, batch {args.clients} (median of {len(steps)}) | {off:.1f} |")
    print(f"| served decode step, batch <= {args.clients} (mean, server metrics) | {server_step * 1000:.1f} |")
    print(f"| client ITL p50 / p90 / p99 | {pct(itls, 50):.1f} / {pct(itls, 90):.1f} / {pct(itls, 99):.1f} |")
    print(f"| client ITL p50 / offline step | {pct(itls, 50) / off:.2f}x |")


if __name__ == "__main__":
    main()

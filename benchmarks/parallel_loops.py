"""The kernels' chunk-claiming pool against ATen's OpenMP team (PDSERVE_PARALLEL=omp), on the default model, offline,
in alternating subprocesses of the same checkout: prefill steps of a 512-token prompt and decode steps at batch 1 and
16, 2 threads. The load average is printed beside every round: the pool's point is a machine whose cores are also
busy with something else (the server's own event loop, other processes), so run it both quiet and loaded.

    .venv/bin/python benchmarks/parallel_loops.py [--rounds 3] [--threads 2]
    .venv/bin/python benchmarks/parallel_loops.py --served [--rounds 2]

`--served`: the same two backends as two `pdserve serve` processes (default options) started together and measured
in turn (the idle one sleeps): streamed c=1 ITL (64 tokens out) and c=8 output tok/s (64-word prompts, 32 tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

CHILD = r"""
import json, sys, time, torch
from pdserve import SamplingParams
from pdserve.llm import LLM
threads, reps = int(sys.argv[1]), int(sys.argv[2])
llm = LLM(kv_cache_memory="512MiB", num_threads=threads)
eng = llm.engine

def steps(prompts, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:
        eng.add_request({"prompt_token_ids": p}, params)
    out = []
    while eng.has_unfinished_requests():
        s = eng.step().stats
        out.append((str(s.kind.value), s.num_decode_tokens, s.duration * 1000))
    return out

prompt = lambda n, seed: [(j * 7 + seed * 13) % 40000 + 10 for j in range(n)]
steps([prompt(512, 99)], 2)  # warm-up: first-touch of buffers, AMX set-up
res = {"prefill512": [], "decode1": [], "decode16": []}
for r in range(reps):
    res["prefill512"] += [d for k, _, d in steps([prompt(512, r)], 1) if k == "prefill"]
    res["decode1"] += [d for k, n, d in steps([prompt(64, r)], 32) if k == "decode" and n == 1]
    res["decode16"] += [d for k, n, d in steps([prompt(64, r * 16 + i) for i in range(16)], 32)
                        if k == "decode" and n == 16]
print(json.dumps(res))
"""


def run(backend: str, threads: int, reps: int) -> dict[str, list[float]]:
    env = {**os.environ, "PDSERVE_PARALLEL": backend}
    out = subprocess.run([sys.executable, "-c", CHILD, str(threads), str(reps)], env=env, capture_output=True,
                         text=True, timeout=1800, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


async def _stream(http: Any, port: int, prompt: str, n: int) -> list[float]:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    arrivals: list[float] = []
    async with http.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.perf_counter())
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


async def _level(port: int, c: int, n: int, words: int) -> tuple[list[float], float]:
    import httpx

    async with httpx.AsyncClient(timeout=600) as http:
        t = time.perf_counter()
        res = await asyncio.gather(*[_stream(http, port, " ".join(f"w{i}x{j}" for j in range(words)), n)
                                     for i in range(c)])
        return [x for r in res for x in r], c * n / (time.perf_counter() - t)


def served(rounds: int) -> None:
    import httpx

    ports = {"pool": 8791, "omp": 8792}
    procs = {b: subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--port", str(p)],
                                 env={**os.environ, "PDSERVE_PARALLEL": b}, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL) for b, p in ports.items()}
    try:
        for p in ports.values():
            for _ in range(600):
                try:
                    if httpx.get(f"http://127.0.0.1:{p}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        for r in range(rounds):
            for b in (("pool", "omp") if r % 2 == 0 else ("omp", "pool")):
                load = os.getloadavg()[0]
                itl, _ = asyncio.run(_level(ports[b], 1, 64, 32))
                _, tok_s = asyncio.run(_level(ports[b], 8, 32, 64))
                print(f"round {r} {b}: load {load:.1f}, c=1 ITL p50 {1000 * statistics.median(itl):.1f} ms "
                      f"p90 {1000 * pct(itl, .9):.1f} ms, c=8 {tok_s:.1f} tok/s", flush=True)
    finally:
        for proc in procs.values():
            proc.terminate()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="prompts per kind per round")
    ap.add_argument("--served", action="store_true", help="measure two servers instead of the offline engine")
    args = ap.parse_args()
    if args.served:
        served(args.rounds)
        return 0
    all_res: dict[str, dict[str, list[float]]] = {"pool": {}, "omp": {}}
    for r in range(args.rounds):
        for backend in (("pool", "omp") if r % 2 == 0 else ("omp", "pool")):
            load = os.getloadavg()[0]
            t = time.perf_counter()
            res = run(backend, args.threads, args.reps)
            print(f"round {r} {backend}: load {load:.1f}, {time.perf_counter() - t:.0f} s, "
                  + ", ".join(f"{k} p50 {statistics.median(v):.1f} ms" for k, v in res.items()), flush=True)
            for k, v in res.items():
                all_res[backend].setdefault(k, []).extend(v)
    print("\n| step | pool p50 ms | pool p90 ms | omp p50 ms | omp p90 ms | pool / omp p50 | pool / omp p90 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for k in all_res["pool"]:
        p, o = all_res["pool"][k], all_res["omp"][k]
        print(f"| {k} | {statistics.median(p):.1f} | {pct(p, .9):.1f} | {statistics.median(o):.1f} | {pct(o, .9):.1f} "
              f"| {statistics.median(p) / statistics.median(o):.2f} | {pct(p, .9) / pct(o, .9):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

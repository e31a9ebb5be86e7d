"""Serving ITL of two checkouts of pdserve, measured alternately with the same client: is B slower than A?

    .venv/bin/python benchmarks/serve_itl_ab.py --a /path/to/base --b /path/to/new [--rounds 3] [--clients 1 16]

Each round starts A's server, runs the streaming clients at every concurrency, stops it, then does the same with
B (the order alternates between rounds, so drift on a shared machine hits both). A server runs `python -m
pdserve.cli serve` with the checkout first on PYTHONPATH (the default model, the same options). Reported per
concurrency: each checkout's median over rounds of the round's ITL p50 and p90, and the median over rounds of the
in-round ratio B / A (with its range). With --offline, each round also times the same decode steps with no server
(each checkout's `LLM` in a subprocess: the median step duration of c running decodes), the engine's own share.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pdserve.launch import ServerProc, free_port, start_process

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_itl import served_itls  # noqa: E402


def start(checkout: str, log_dir: Path, args: argparse.Namespace) -> ServerProc:
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), "--dtype", args.dtype,
           "--kv-cache-memory", "1GiB", "--max-num-seqs", str(max(args.clients)), "--num-threads", str(args.threads),
           "--log-level", "warning"]
    return start_process(cmd, f"http://127.0.0.1:{port}", log_dir / f"{Path(checkout).name}-{port}.log",
                         env={"PYTHONPATH": checkout}, timeout=600)


def one_round(checkout: str, log_dir: Path, args: argparse.Namespace) -> dict[int, list[float]]:
    """ITLs (seconds) per concurrency, from a fresh server of `checkout`."""
    srv = start(checkout, log_dir, args)
    try:
        base = srv.base_url
        out = {}
        for c in args.clients:
            prompts = [[100 + (7 * i + j) % 40000 for j in range(args.prompt_len)] for i in range(c)]
            asyncio.run(served_itls(base, prompts[:2], 8))  # warm-up
            out[c] = asyncio.run(served_itls(base, prompts, args.output_len))
        return out
    finally:
        srv.stop()


OFFLINE = """
import json, statistics, sys
from pdserve import SamplingParams
from pdserve.llm import LLM
c_list, n, plen, dtype, threads = json.loads(sys.argv[1])
llm = LLM(dtype=dtype, kv_cache_memory="1GiB", max_num_seqs=max(c_list), num_threads=threads)
out = {}
for c in c_list:
    eng = llm.engine
    for i in range(c):
        eng.add_request({"prompt_token_ids": [100 + (7 * i + j) % 40000 for j in range(plen)]},
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    steps = []
    while eng.has_unfinished_requests():
        s = eng.step().stats
        if s.kind == "decode" and s.num_decode_tokens == c:
            steps.append(s.duration)
    out[c] = statistics.median(steps)
print(json.dumps(out))
"""


def offline_steps(checkout: str, args: argparse.Namespace) -> dict[int, float]:
    """Median decode step (seconds) per concurrency, from `checkout`'s engine in a subprocess."""
    cfg = json.dumps([args.clients, args.output_len, args.prompt_len, args.dtype, args.threads])
    res = subprocess.run([sys.executable, "-c", OFFLINE, cfg], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": checkout})
    return {int(k): v for k, v in json.loads(res.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--a", required=True, help="checkout A (the baseline)")
    ap.add_argument("--b", required=True, help="checkout B")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--offline", action="store_true", help="also time the decode steps offline (no server)")
    args = ap.parse_args()
    res: dict[str, dict[int, list[list[float]]]] = {"a": {c: [] for c in args.clients},
                                                    "b": {c: [] for c in args.clients}}
    steps: dict[str, list[dict[int, float]]] = {"a": [], "b": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side in (("a", "b") if r % 2 == 0 else ("b", "a")):
                for c, itls in one_round(getattr(args, side), Path(tmp), args).items():
                    res[side][c].append(itls)
                if args.offline:
                    steps[side].append(offline_steps(getattr(args, side), args))
    cpu = subprocess.run(["sh", "-c", "lscpu | grep 'Model name' | cut -d: -f2"], capture_output=True, text=True)
    print(f"# serve_itl_ab: A={args.a} B={args.b}, {args.rounds} rounds alternating, prompt {args.prompt_len}, "
          f"output {args.output_len}, dtype {args.dtype}, {args.threads} threads; {cpu.stdout.strip()}, torch "
          f"{torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
    print("| clients | A ITL p50 / p90 (ms) | B ITL p50 / p90 (ms) | B / A p50: median (range) | B / A p90 |")
    print("| --- | --- | --- | --- | --- |")
    for c in args.clients:
        p = {s: [(float(np.percentile(x, 50)) * 1e3, float(np.percentile(x, 90)) * 1e3) for x in res[s][c]]
             for s in ("a", "b")}
        r50 = [b[0] / a[0] for a, b in zip(p["a"], p["b"])]
        r90 = [b[1] / a[1] for a, b in zip(p["a"], p["b"])]
        med = {s: (statistics.median(v[0] for v in p[s]), statistics.median(v[1] for v in p[s])) for s in p}
        print(f"| {c} | {med['a'][0]:.1f} / {med['a'][1]:.1f} | {med['b'][0]:.1f} / {med['b'][1]:.1f} | "
              f"{statistics.median(r50):.3f} ({min(r50):.3f}-{max(r50):.3f}) | {statistics.median(r90):.3f} |")
    if args.offline:
        print("\n| clients | A offline decode step (ms) | B offline decode step (ms) | B / A: median (range) |")
        print("| --- | --- | --- | --- |")
        for c in args.clients:
            a, b = [x[c] for x in steps["a"]], [x[c] for x in steps["b"]]
            ratio = [y / x for x, y in zip(a, b)]
            print(f"| {c} | {statistics.median(a) * 1e3:.1f} | {statistics.median(b) * 1e3:.1f} | "
                  f"{statistics.median(ratio):.3f} ({min(ratio):.3f}-{max(ratio):.3f}) |")


if __name__ == "__main__":
    main()

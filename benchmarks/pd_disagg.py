"""PD disaggregation under a mixed load: short chat requests decode while long prompts arrive.

    .venv/bin/python benchmarks/pd_disagg.py [--duration 40] [--short-clients 4] [--long-len 1024]
                                             [--long-every 4] [--out bench-pd.json]

Two set-ups on the same machine and model, each driven by the same load for `--duration` seconds:
  colocated  one `pdserve serve` using both cores (--num-threads 2)
  1P1D       `--role prefill` pinned to core 0 and `--role decode` pinned to core 1 (taskset, --num-threads 1 each),
             behind `pdserve router` (unpinned; it only relays bytes)
Load: `--short-clients` closed-loop clients, each sending a short chat request (~30 prompt tokens, 64 output
tokens, streamed) after the previous one ends; plus one open-loop sender that starts a long prompt (`--long-len`
tokens, 8 output tokens, unique so the prefix cache cannot help) every `--long-every` seconds.
Reported: p50/p99 TTFT and ITL of the short requests (client side), TTFT of the long ones, output throughput, and
the KV transfer time and bytes per request (the decode instance's /metrics). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from pdserve.launch import ServerProc, free_port, start_pdserve


def start(tmp: Path, name: str, args: list[str], cpus: str | None, url_port: int) -> ServerProc:
    return start_pdserve(tmp, name, args, f"http://127.0.0.1:{url_port}", 240,
                         prefix=["taskset", "-c", cpus] if cpus is not None else None)


MODEL: list[str] = []  # --model/--dtype passed through to the servers


def serve_args(port: int, threads: int, extra: list[str]) -> list[str]:
    return ["serve", "--port", str(port), "--num-threads", str(threads), "--kv-cache-memory", "512MiB",
            "--max-model-len", "4096", "--log-level", "warning", *MODEL, *extra]


WORDS = ("alpha beta gamma delta river mountain cloud stone paper window garden silver market music winter "
         "orange planet engine bridge forest").split()


async def short_client(http: httpx.AsyncClient, url: str, stop: float, out: list[dict[str, Any]], i: int) -> None:
    n = 0
    while time.perf_counter() < stop:
        body = {"messages": [{"role": "user", "content": f"Request {i}-{n}: write a short poem about the sea."}],
                "max_tokens": 64, "temperature": 0.0, "ignore_eos": True, "stream": True}
        n += 1
        t0 = time.perf_counter()
        times: list[float] = []
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                        times.append(time.perf_counter())
        if times:
            out.append({"ttft": times[0] - t0, "itl": list(np.diff(times)), "tokens": len(times), "end": times[-1]})


async def long_sender(http: httpx.AsyncClient, url: str, stop: float, every: float, length: int,
                      out: list[dict[str, Any]]) -> None:
    rng = random.Random(0)
    tasks = []

    async def one(k: int) -> None:
        prompt = f"Document {k}. " + " ".join(rng.choice(WORDS) for _ in range(length))
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "stream": True}
        t0 = time.perf_counter()
        first = None
        async with http.stream("POST", url + "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if first is None and line.startswith("data: ") and '"text": "' in line:
                    first = time.perf_counter()
        out.append({"ttft": (first or time.perf_counter()) - t0, "e2e": time.perf_counter() - t0})

    k = 0
    while time.perf_counter() < stop:
        tasks.append(asyncio.create_task(one(k)))
        k += 1
        await asyncio.sleep(every)
    await asyncio.gather(*tasks)


def metric_sum(text: str, name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{"))


async def drive(url: str, args: argparse.Namespace) -> dict[str, Any]:
    short: list[dict[str, Any]] = []
    long: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=300) as http:
        # warm-up: one short and one long request
        await short_client(http, url, time.perf_counter() + 0.01, [], -1)
        t0 = time.perf_counter()
        stop = t0 + args.duration
        await asyncio.gather(*(short_client(http, url, stop, short, i) for i in range(args.short_clients)),
                             long_sender(http, url, stop, args.long_every, args.long_len, long))
        wall = time.perf_counter() - t0
    itl = [x for r in short for x in r["itl"]]
    ttft = [r["ttft"] for r in short]
    pct = lambda v, q: float(np.percentile(v, q)) * 1000 if v else float("nan")  # noqa: E731
    return {"short_requests": len(short), "long_requests": len(long),
            "short_ttft_p50_ms": pct(ttft, 50), "short_ttft_p99_ms": pct(ttft, 99),
            "short_itl_p50_ms": pct(itl, 50), "short_itl_p99_ms": pct(itl, 99),
            "long_ttft_p50_ms": pct([r["ttft"] for r in long], 50),
            "output_tok_s": (sum(r["tokens"] for r in short) + 8 * len(long)) / wall, "wall_s": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=40)
    ap.add_argument("--short-clients", type=int, default=4)
    ap.add_argument("--long-len", type=int, default=1024, help="words in a long prompt (about as many tokens)")
    ap.add_argument("--long-every", type=float, default=4.0)
    ap.add_argument("--connector", default="zmq", help="zmq or nixl")
    ap.add_argument("--setups", default="colocated,pd", help="which set-ups to run (comma-separated)")
    ap.add_argument("--model", default=None, help="model for the servers (default: smollm2-135m)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    MODEL[:] = (["--model", args.model] if args.model else []) + ["--dtype", args.dtype]
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"pd-bench-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}

    setups = args.setups.split(",")
    if "colocated" in setups:
        port = free_port()
        colo = start(tmp, "colocated", serve_args(port, 2, []), None, port)
        try:
            results["colocated (2 cores)"] = asyncio.run(drive(colo.base_url, args))
        finally:
            colo.stop()
    if "pd" in setups:
        run_pd(tmp, args, results)
    print_results(args, results)
    return 0


def run_pd(tmp: Path, args: argparse.Namespace, results: dict[str, Any]) -> None:
    pp, dp, rp = free_port(), free_port(), free_port()
    procs: list[ServerProc] = []  # stopped in reverse order, also when a later one fails to start
    try:
        procs.append(pre := start(tmp, "prefill", serve_args(pp, 1, ["--role", "prefill", "--kv-connector",
                                                                     args.connector]), "0", pp))
        procs.append(dec := start(tmp, "decode", serve_args(dp, 1, ["--role", "decode", "--kv-connector",
                                                                    args.connector]), "1", dp))
        procs.append(router := start(tmp, "router", ["router", "--port", str(rp), "--prefill", pre.base_url,
                                                     "--decode", dec.base_url, "--log-level", "warning"], None, rp))
        res = asyncio.run(drive(router.base_url, args))
        m = httpx.get(dec.base_url + "/metrics").text
        n = metric_sum(m, "pdserve:kv_transfer_seconds_count")
        res["kv_transfer_ms_per_request"] = metric_sum(m, "pdserve:kv_transfer_seconds_sum") / max(n, 1) * 1000
        res["kv_transfer_mib_per_request"] = metric_sum(m, "pdserve:kv_transfer_bytes_total") / max(n, 1) / 2**20
        res["kv_transfers"] = n
        res["kv_transfer_failures"] = metric_sum(m, "pdserve:kv_transfer_failures_total")
        results[f"1P1D {args.connector} (1 core each)"] = res
    finally:
        for p in reversed(procs):
            p.stop()


def print_results(args: argparse.Namespace, results: dict[str, Any]) -> None:
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores", "args": vars(args)}
    print(json.dumps({"meta": meta, "results": results}, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    cols = ["short_ttft_p50_ms", "short_ttft_p99_ms", "short_itl_p50_ms", "short_itl_p99_ms", "long_ttft_p50_ms",
            "output_tok_s", "short_requests", "long_requests"]
    print("\n| set-up | " + " | ".join(cols) + " | KV transfer ms/req | KV MiB/req |")
    print("|---" * (len(cols) + 3) + "|")
    for name, r in results.items():
        kv = (f"{r['kv_transfer_ms_per_request']:.1f} | {r['kv_transfer_mib_per_request']:.2f}"
              if "kv_transfer_ms_per_request" in r else "– | –")
        print(f"| {name} | " + " | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols)
              + f" | {kv} |")


if __name__ == "__main__":
    sys.exit(main())

"""Prefix-aware against least-loaded routing on the same two instances: multi-turn chats over shared system prompts.

    .venv/bin/python benchmarks/prefix_routing.py --model DIR [--conversations 16] [--systems 4] [--system-words 600]
                                                  [--turns 3] [--concurrency 8] [--rounds 2] [--out bench.json]
                                                  [--kv-offload off|own|shared] [--think-time S]

Two `pdserve serve` instances (`--num-threads 1` each, pinned to cores 0 and 1 when the machine has two or more) and
two `pdserve router`s over both (no prefill pool: colocated), one `--routing prefix --tokenizer DIR`, one
`--routing least-loaded`. Each run drives one router: `--conversations` chats, each on one of `--systems` system
prompts (`--system-words` random words, new for every run so no run finds another's blocks), `--turns` user turns
of which each sends the whole conversation so far, `--concurrency` chats at a time, 16 streamed output tokens a turn.
With `--think-time S` each chat is a user who reads and types: its first turn starts at a uniform time in [0, S), each
later one an exponential time of mean S after the previous answer (seeded), so the offered load stays below what the
instances serve instead of a closed loop that queues every request behind the others.
Runs alternate (least-loaded, prefix, prefix, least-loaded, ...). Reported per run: the client's TTFT p50/p90 over
every turn, the prefix-hit rate (both instances' prefix_cache_hits / prefix_cache_queries gained during the run), the
requests an instance held while another computed their prefix (prefix_cache_inflight_waits), and requests per
second; then prefix / least-loaded ratios of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from pdserve.launch import ServerProc, free_port, start_pdserve

WORDS = ("alpha beta gamma delta river mountain cloud stone paper window garden silver market music winter orange "
         "planet engine bridge forest harbor lantern meadow copper signal thunder velvet canyon ember glacier").split()


def metric_sum(text: str, name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith(name) and ln[len(name)] in "{ ")


async def turn(http: httpx.AsyncClient, url: str, messages: list[dict[str, str]]) -> tuple[float, str]:
    """One streamed chat turn: (TTFT seconds, the answer's text)."""
    body = {"messages": messages, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True, "stream": True}
    t0, ttft, out = time.perf_counter(), None, []
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = (json.loads(line[6:])["choices"] or [{}])[0].get("delta") or {}
            if delta.get("content"):
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                out.append(delta["content"])
    assert ttft is not None
    return ttft, "".join(out)


async def conversation(http: httpx.AsyncClient, url: str, system: str, turns: int, rng: random.Random,
                       ttfts: list[float], think: float = 0.0) -> None:
    messages = [{"role": "system", "content": system}]
    for t in range(turns):
        if think > 0:  # the user's reading and typing time (the first turns spread over [0, think))
            await asyncio.sleep(rng.uniform(0, think) if t == 0 else rng.expovariate(1.0 / think))
        messages.append({"role": "user", "content": f"Question {t}: " + " ".join(rng.choices(WORDS, k=12))})
        ttft, answer = await turn(http, url, messages)
        ttfts.append(ttft)
        messages.append({"role": "assistant", "content": answer})


async def run(router: str, instances: list[str], args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    systems = [" ".join(rng.choices(WORDS, k=args.system_words)) for _ in range(args.systems)]
    async with httpx.AsyncClient(timeout=600) as http:
        before = [(await http.get(u + "/metrics")).text for u in instances]
        ttfts: list[float] = []
        sem = asyncio.Semaphore(args.concurrency)

        async def one(i: int) -> None:
            async with sem:
                await conversation(http, router, systems[i % len(systems)], args.turns, random.Random(seed * 1000 + i),
                                   ttfts, args.think_time)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(args.conversations)))
        wall = time.perf_counter() - t0
        after = [(await http.get(u + "/metrics")).text for u in instances]
        routed = (await http.get(router + "/metrics")).text
    gained = {k: sum(metric_sum(a, f"pdserve:prefix_cache_{k}_total") - metric_sum(b, f"pdserve:prefix_cache_{k}_total")
                     for a, b in zip(after, before, strict=True)) for k in ("hits", "queries", "inflight_waits")}
    decisions = {r: metric_sum(routed, f'pdserve:router_routing_decisions_total{{pool="decode",reason="{r}"}}')
                 for r in ("prefix", "no_match", "no_prefix")}
    return {"ttft_p50_s": float(np.percentile(ttfts, 50)), "ttft_p90_s": float(np.percentile(ttfts, 90)),
            "prefix_hit_rate": gained["hits"] / max(gained["queries"], 1.0), "requests": len(ttfts),
            "requests_per_s": len(ttfts) / wall, "wall_s": wall, "decisions_so_far": decisions,
            "inflight_waits": gained["inflight_waits"]}


def start_all(tmp: Path, args: argparse.Namespace) -> tuple[list[ServerProc], dict[str, ServerProc]]:
    pin = (os.cpu_count() or 1) >= 2
    insts = []
    for core in (0, 1):
        port = free_port()
        offload = [] if args.kv_offload == "off" else [  # the prefix cache's disk tier: each its own, or one shared
            "--kv-offload-dir", str(tmp / ("kv" if args.kv_offload == "shared" else f"kv-{core}"))]
        insts.append(start_pdserve(tmp, f"inst-{port}", [
            "serve", "--port", str(port), "--model", args.model, "--num-threads", "1", "--kv-cache-memory",
            args.kv_cache_memory, "--log-level", "warning", "--device-peaks", "off", *offload],
            f"http://127.0.0.1:{port}", 300, prefix=["taskset", "-c", str(core)] if pin else None))
    routers = {}
    for mode in ("least-loaded", "prefix"):
        port = free_port()
        routers[mode] = start_pdserve(tmp, f"router-{mode}", [
            "router", "--port", str(port), "--decode", *[i.base_url for i in insts], "--routing", mode,
            "--tokenizer", args.model, "--log-level", "warning"], f"http://127.0.0.1:{port}", 60)
    return insts, routers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a model directory (with tokenizer.json, for the router)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--systems", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=600)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="pairs of runs (least-loaded and prefix, alternating)")
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--think-time", type=float, default=0.0,
                    help="mean seconds a user takes between an answer and the next turn (0: none, a closed loop)")
    ap.add_argument("--kv-offload", choices=("off", "own", "shared"), default="off",
                    help="the instances' disk tier (--kv-offload-dir): none, one directory each, or one shared")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    insts, routers = start_all(tmp, args)
    results: dict[str, list[dict[str, Any]]] = {"least-loaded": [], "prefix": []}
    try:
        order = [m for r in range(args.rounds) for m in (("least-loaded", "prefix") if r % 2 == 0
                                                         else ("prefix", "least-loaded"))]
        for seed, mode in enumerate(order, start=1):
            res = asyncio.run(run(routers[mode].base_url, [i.base_url for i in insts], args, seed))
            results[mode].append(res)
            print(f"{mode:>13}: TTFT p50 {res['ttft_p50_s'] * 1e3:7.0f} ms  p90 {res['ttft_p90_s'] * 1e3:7.0f} ms  "
                  f"hit rate {res['prefix_hit_rate']:.2f}  {res['requests_per_s']:.2f} req/s  held for an in-flight "
                  f"prefix {res['inflight_waits']:.0f}  routed so far "
                  f"{res['decisions_so_far']}", flush=True)
    finally:
        for s in [*routers.values(), *insts]:
            s.stop()
    summary = {m: {k: float(np.median([r[k] for r in rs])) for k in ("ttft_p50_s", "ttft_p90_s", "prefix_hit_rate",
                                                                      "requests_per_s")} for m, rs in results.items()}
    ll, px = summary["least-loaded"], summary["prefix"]
    print(f"\nmedian over runs | least-loaded | prefix | prefix / least-loaded\n---|---|---|---\n"
          f"TTFT p50 | {ll['ttft_p50_s'] * 1e3:.0f} ms | {px['ttft_p50_s'] * 1e3:.0f} ms | "
          f"{px['ttft_p50_s'] / ll['ttft_p50_s']:.2f}\nTTFT p90 | {ll['ttft_p90_s'] * 1e3:.0f} ms | "
          f"{px['ttft_p90_s'] * 1e3:.0f} ms | {px['ttft_p90_s'] / ll['ttft_p90_s']:.2f}\n"
          f"prefix-hit rate | {ll['prefix_hit_rate']:.2f} | {px['prefix_hit_rate']:.2f} | "
          f"{px['prefix_hit_rate'] / max(ll['prefix_hit_rate'], 1e-9):.2f}\nrequests/s | "
          f"{ll['requests_per_s']:.2f} | {px['requests_per_s']:.2f} | "
          f"{px['requests_per_s'] / ll['requests_per_s']:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "machine": platform.processor() or platform.machine(),
                                              "runs": results, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

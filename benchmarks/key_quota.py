"""Per-key limits under load (issue 30): two named keys on one `pdserve serve`, key A within its limits and key B far
over its requests/min, tokens/min and concurrency quota at the same time. Does B get 429s (with Retry-After) while
A's latency stays what it is without B?

    .venv/bin/python benchmarks/key_quota.py [--model PATH] [--a-clients 2] [--a-requests 6] [--output-len 32]
                                             [--b-clients 8] [--b-rate 20]
                                             [--b-limits "rpm=6 tpm=600 concurrent=1"]

Phases, on one server: A alone, A with B's flood, A alone again (the two A-alone runs bound the machine's drift;
it is shared). A: `--a-clients` closed-loop streaming clients, `--a-requests` completions each (`--output-len`
tokens, ignore_eos). B: `--b-clients` clients sending completions at `--b-rate` a second in all (0: back to
back), never waiting out a Retry-After, until A's clients are done. Reported per phase and key: requests, 200s,
429s and how many of those carried Retry-After, other statuses; A's TTFT and ITL p50/p99; the CPU
seconds of the server (process and children) and of this process (the clients); the load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

from pdserve.launch import start_server

KEY_A, KEY_B = "sk-bench-a", "sk-bench-b"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. 写一个关于灯塔的故事。"


@dataclass
class KeyTally:
    requests: int = 0
    ok: int = 0
    rate_limited: int = 0
    with_retry_after: int = 0
    other: dict[int, int] = field(default_factory=dict)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    def count(self, r: httpx.Response) -> None:
        self.requests += 1
        if r.status_code == 200:
            self.ok += 1
        elif r.status_code == 429:
            self.rate_limited += 1
            self.with_retry_after += int(r.headers.get("retry-after", "0")) >= 1
        else:
            self.other[r.status_code] = self.other.get(r.status_code, 0) + 1

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"requests": self.requests, "200": self.ok, "429": self.rate_limited,
                               "429_with_retry_after": self.with_retry_after, "other": self.other}
        for name, xs in (("ttft_ms", self.ttft), ("itl_ms", self.itl)):
            if xs:
                out[name] = {"p50": round(1000 * float(np.percentile(xs, 50)), 1),
                             "p99": round(1000 * float(np.percentile(xs, 99)), 1), "n": len(xs)}
        return out


def body(n: int, stream: bool) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": stream}


async def a_client(http: httpx.AsyncClient, n_requests: int, output_len: int, tally: KeyTally) -> None:
    """Streaming requests one after another, timing the first token and the gaps between tokens."""
    for _ in range(n_requests):
        t0 = time.perf_counter()
        arrivals: list[float] = []
        async with http.stream("POST", "/v1/completions", json=body(output_len, True),
                               headers={"Authorization": f"Bearer {KEY_A}"}) as r:
            if r.status_code == 200:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        if json.loads(line[6:])["choices"][0]["text"]:
                            arrivals.append(time.perf_counter())
            else:
                await r.aread()
            tally.count(r)
        if arrivals:
            tally.ttft.append(arrivals[0] - t0)
            tally.itl.extend(b - a for a, b in zip(arrivals, arrivals[1:], strict=False))


async def b_client(http: httpx.AsyncClient, output_len: int, tally: KeyTally, stop: asyncio.Event,
                   interval: float) -> None:
    """A request every `interval` seconds (0: back to back), never waiting out a Retry-After: far over any
    quota."""
    next_t = time.perf_counter()
    while not stop.is_set():
        r = await http.post("/v1/completions", json=body(output_len, False),
                            headers={"Authorization": f"Bearer {KEY_B}"})
        tally.count(r)
        next_t += interval
        if (wait := next_t - time.perf_counter()) > 0:
            await asyncio.sleep(wait)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of the server process and its children so far."""
    proc = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in [proc, *proc.children(recursive=True)])


async def phase(base: str, args: argparse.Namespace, with_b: bool, pid: int) -> dict[str, Any]:
    a, b = KeyTally(), KeyTally()
    cpu0, own0 = cpu_seconds(pid), sum(psutil.Process().cpu_times()[:2])
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=args.a_clients + args.b_clients + 4)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as http:
        interval = args.b_clients / args.b_rate if args.b_rate > 0 else 0.0
        flood = [asyncio.create_task(b_client(http, args.output_len, b, stop, interval))
                 for _ in range(args.b_clients if with_b else 0)]
        t0 = time.perf_counter()
        await asyncio.gather(*[a_client(http, args.a_requests, args.output_len, a) for _ in range(args.a_clients)])
        wall = time.perf_counter() - t0
        stop.set()
        await asyncio.gather(*flood)
    out = {"wall_s": round(wall, 2), "server_cpu_s": round(cpu_seconds(pid) - cpu0, 2),
           "client_cpu_s": round(sum(psutil.Process().cpu_times()[:2]) - own0, 2), "a": a.summary()}
    if with_b:
        out["b"] = {**b.summary(), "per_s": round(b.requests / wall, 1)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: pdserve's default model)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None, help="--num-threads of the server")
    ap.add_argument("--a-clients", type=int, default=2)
    ap.add_argument("--a-requests", type=int, default=6, help="requests per A client")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--b-clients", type=int, default=8)
    ap.add_argument("--b-rate", type=float, default=20.0,
                    help="B's requests a second, all clients together (0: back to back, as fast as they answer)")
    ap.add_argument("--b-limits", default="rpm=6 tpm=600 concurrent=1", help="key B's limits (key-file words)")
    ap.add_argument("--json", default=None, help="write the results here as JSON too")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.txt"
        keys.write_text(f"a:{KEY_A}\nb:{KEY_B} {args.b_limits}\n")
        keys.chmod(0o600)
        extra = ["--model", args.model] if args.model else []
        extra += ["--num-threads", str(args.threads)] if args.threads else []
        srv = start_server(Path(tmp), "--dtype", args.dtype, "--kv-cache-memory", "256MiB", "--max-model-len", "2048",
                           "--api-key-file", str(keys), *extra)
        try:
            load_before = os.getloadavg()
            pid = srv.proc.pid
            warm = argparse.Namespace(**{**vars(args), "a_requests": 1})
            asyncio.run(phase(srv.base_url, warm, False, pid))
            runs = {"a_alone": asyncio.run(phase(srv.base_url, args, False, pid)),
                    "a_with_b": asyncio.run(phase(srv.base_url, args, True, pid)),
                    "a_alone_again": asyncio.run(phase(srv.base_url, args, False, pid))}
            load_after = os.getloadavg()
        finally:
            srv.stop()
    result = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "cpus": os.cpu_count(),
              "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in load_after],
              "runs": runs}
    print(json.dumps(result, indent=2, ensure_ascii=False))
    for name, run in runs.items():
        a = run["a"]
        line = (f"{name:14s} CPU server {run['server_cpu_s']} s, clients {run['client_cpu_s']} s in "
                f"{run['wall_s']} s; "
                f"A: {a['200']}/{a['requests']} ok, TTFT p50 {a['ttft_ms']['p50']} ms p99 "
                f"{a['ttft_ms']['p99']} ms, ITL p50 {a['itl_ms']['p50']} ms p99 {a['itl_ms']['p99']} ms")
        if "b" in run:
            b = run["b"]
            line += (f" | B: {b['requests']} requests ({b['per_s']}/s), {b['200']} ok, {b['429']} x 429 "
                     f"({b['429_with_retry_after']} with Retry-After), other {b['other']}")
        print(line)
    ratio = statistics.mean(runs[k]["a"]["itl_ms"]["p50"] for k in ("a_alone", "a_alone_again"))
    print(f"A's ITL p50 with B / without: {runs['a_with_b']['a']['itl_ms']['p50'] / ratio:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()

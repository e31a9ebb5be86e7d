"""The Ray Serve ingress against `pdserve router` on the same 1P1D instances, and the application's start-up time.

    .venv/bin/python benchmarks/ray_serve.py [--model M] [--duration 30] [--clients 2] [--rounds 2] [--out f.json]

A local Ray (`ray.init(num_cpus=2)`) runs the disaggregated application of pdserve.deploy.ray: one prefill and one
decode replica (1 CPU, 1 thread each) and the ingress. `pdserve router` is then started on the same two replicas'
URLs, so both paths reach the very same engines. The same closed-loop load (`--clients` clients, short chat requests,
64 streamed output tokens; pd_disagg.py's short client) goes through each path for `--duration` seconds, the two
alternating for `--rounds` rounds, so that both see the same machine. Reported, client side: TTFT and ITL p50/p99
per path (all rounds pooled), and the start-up times: ray.init, and `serve.run` until the application is RUNNING
(engines loaded and healthy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from pd_disagg import short_client

from pdserve.launch import free_port, start_pdserve


def app_config(args: argparse.Namespace) -> Any:
    from pdserve.deploy.ray.config import config_from_dict

    engine: dict[str, Any] = {"kv_cache_memory": "512MiB", "max_model_len": 4096, "log_level": "warning"}
    if args.model:
        engine["model"] = args.model
    group = {"num_cpus": 1, "num_threads": 1}
    return config_from_dict({"name": "bench", "topology": "disaggregated", "engine": engine, "prefill": group,
                             "decode": group, "ingress": {"num_cpus": 0}, "host": "127.0.0.1",
                             "port": args.port, "router": {"poll_interval": 0.5}})


async def drive(url: str, clients: int, duration: float) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=300) as http:
        await short_client(http, url, time.perf_counter() + 0.01, [], -1)  # warm-up
        stop = time.perf_counter() + duration
        await asyncio.gather(*(short_client(http, url, stop, out, i) for i in range(clients)))
    return out


def summary(records: list[dict[str, Any]]) -> dict[str, float]:
    ttft = [r["ttft"] for r in records]
    itl = [x for r in records for x in r["itl"]]

    def pct(v: list[float], q: float) -> float:
        return float(np.percentile(v, q)) * 1000 if v else float("nan")

    return {"requests": len(records), "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="pdserve's --model (default: the default model)")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of load per path and round")
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=8765, help="Serve's HTTP port")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import ray

    from pdserve.deploy.ray.app import delete_app, deploy

    t0 = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, namespace="pdserve", log_to_driver=False)
    ray_init_s = time.monotonic() - t0
    cfg = app_config(args)
    startup_s = deploy(cfg)
    ingress = f"http://127.0.0.1:{args.port}"
    reps = {r["role"]: r["url"] for r in httpx.get(ingress + "/v1/replicas").json()["data"]}
    port = free_port()
    router = start_pdserve(Path(tempfile.mkdtemp()), "router", ["router", "--port", str(port), "--prefill",
                           reps["prefill"], "--decode", reps["decode"], "--log-level", "warning"],
                           f"http://127.0.0.1:{port}", 120)
    paths = {"Ray Serve ingress": ingress, "pdserve router": router.base_url}
    records: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
    try:
        for _ in range(args.rounds):
            for name, url in paths.items():
                records[name] += asyncio.run(drive(url, args.clients, args.duration))
    finally:
        router.stop()
        delete_app(cfg.name)
        ray.shutdown()
    results = {name: summary(r) for name, r in records.items()}
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine":
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", "load_avg": os.getloadavg(),
            "ray_init_s": ray_init_s, "app_startup_s": startup_s, "args": vars(args)}
    print(json.dumps({"meta": meta, "results": results}, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"\nray.init {ray_init_s:.1f} s; application RUNNING {startup_s:.1f} s after serve.run\n")
    print("| path | requests | TTFT p50 / p99 ms | ITL p50 / p99 ms |\n|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['requests']} | {r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} | "
              f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Model lifecycle on a real `pdserve serve`: load time over the admin API, alias switch and rollback time, and the
process's RSS before a load, after it and after each unload.

    .venv/bin/python benchmarks/lifecycle.py [--cycles 8] [--model smollm2-135m] [--out out/lifecycle.json]
        [--env MALLOC_ARENA_MAX=2 ...]

The server starts with one model (`base`, the default) and the admin API; each cycle loads `cycle` (the same model
under a new version) with `?wait=true`, sends one request to it, points the alias `chat` at it and rolls the alias
back, then unloads it. RSS is read with psutil from outside the server. `--env` runs the server under extra
environment variables (to compare allocator settings side by side).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from pdserve.launch import start_server
from pdserve.roofline import machine_info

KEY = "bench-admin-key"
ADMIN = {"Authorization": f"Bearer {KEY}"}
MIB = 2**20


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / MIB


def rss_parts_mib(pid: int) -> dict[str, float]:
    """RssAnon (heap, tensors) and RssFile (mapped files: the GGUF, libraries) from /proc (Linux)."""
    parts = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("RssAnon:", "RssFile:")):
            parts[line.split(":")[0]] = int(line.split()[1]) / 1024
    return parts


def run(model: str, cycles: int, env: dict[str, str], kv: str) -> dict[str, Any]:
    d = Path(tempfile.mkdtemp(prefix="pdserve-lifecycle-"))
    cfg = d / "models.json"
    cfg.write_text(json.dumps({"models": [{"name": "base", "path": model, "version": "0"}],
                               "aliases": {"chat": "base"}}), encoding="utf-8")
    t0 = time.perf_counter()
    srv = start_server(d, "--models-config", str(cfg), "--admin-api-key", KEY, "--kv-cache-memory", kv,
                       "--audit-log", str(d / "audit.jsonl"), env=env)
    out: dict[str, Any] = {"env": env, "start_to_healthy_s": time.perf_counter() - t0, "cycles": []}
    try:
        pid, http = srv.proc.pid, httpx.Client(base_url=srv.base_url, timeout=600)
        http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4}).raise_for_status()
        out["rss_start_mib"] = rss_mib(pid)
        for i in range(cycles):
            c: dict[str, Any] = {"rss_before_mib": rss_mib(pid)}
            t = time.perf_counter()
            r = http.post("/admin/models", params={"wait": "true"}, headers=ADMIN,
                          json={"name": "cycle", "path": model, "version": str(i + 1)})
            r.raise_for_status()
            c["load_s"] = time.perf_counter() - t
            http.post("/v1/completions", json={"model": "cycle", "prompt": "你好", "max_tokens": 4}).raise_for_status()
            c["rss_loaded_mib"] = rss_mib(pid)
            t = time.perf_counter()
            sw = http.put("/admin/aliases/chat", json={"model": "cycle"}, headers=ADMIN).json()
            c["switch_http_s"] = time.perf_counter() - t  # the admin call as the client sees it
            rb = http.post("/admin/aliases/chat/rollback", headers=ADMIN).json()
            c["switch_s"], c["rollback_s"] = sw["switch_s"], rb["switch_s"]  # inside the server (the audit's)
            t = time.perf_counter()
            http.delete("/admin/models/cycle", headers=ADMIN).raise_for_status()
            c["unload_s"] = time.perf_counter() - t
            c["rss_after_unload_mib"] = rss_mib(pid)
            c.update({f"{k}_after_unload_mib": v for k, v in rss_parts_mib(pid).items()})
            c["threads"] = psutil.Process(pid).num_threads()
            out["cycles"].append(c)
            print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in c.items()}), flush=True)
    finally:
        srv.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--cycles", type=int, default=8)
    ap.add_argument("--kv-cache-memory", default="128MiB")
    ap.add_argument("--env", nargs="*", default=[], help="NAME=VALUE for the server process")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    env = dict(e.split("=", 1) for e in args.env)
    res = {"machine": machine_info(), "model": args.model, **run(args.model, args.cycles, env, args.kv_cache_memory)}
    cyc = res["cycles"]
    grew = [round(c["rss_loaded_mib"] - c["rss_before_mib"]) for c in cyc]
    print(f"start RSS {res['rss_start_mib']:.0f} MiB; loaded +{grew}; "
          f"after unload vs start {[round(c['rss_after_unload_mib'] - res['rss_start_mib'], 1) for c in cyc]} MiB; "
          f"load {[round(c['load_s'], 2) for c in cyc]} s; switch {[round(c['switch_s'] * 1e3, 3) for c in cyc]} ms "
          f"(HTTP {[round(c['switch_http_s'] * 1e3, 1) for c in cyc]} ms)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()

"""Checks under load: the concurrency sweep up to the knee (judged by `pdserve diagnose`'s rules), and per-tenant
traffic whose numbers the server must count under the right tenant."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.config import BenchConfig
from pdserve.bench.datasets import SampleRequest
from pdserve.bench.diagnose.rules import Thresholds, analyze, sweep_knees
from pdserve.bench.diagnose.stats import RunStats, stats_from_result
from pdserve.bench.report import BenchResult, compute_metrics
from pdserve.bench.runner import run_load
from pdserve.bench.server_metrics import scrape, server_deltas
from pdserve.poc.check import FAIL, FILLER, PASS, CheckResult, RunLog, error_counts, prompt
from pdserve.poc.config import PocConfig
from pdserve.poc.target import PocTarget

TENANT_METRICS = ("tenant_requests_total", "tenant_queue_time_seconds_sum", "tenant_generation_tokens_total")


async def _sample_gauges(t: PocTarget, stop: asyncio.Event, out: list[dict[str, float]]) -> None:
    while not stop.is_set():
        s = await t.load_state()
        out.append({k: v for k, v in (("kv_cache_usage_perc", s.kv_usage), ("num_requests_running", s.running),
                                      ("num_requests_waiting", s.waiting)) if v is not None})
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except TimeoutError:
            pass


async def _level(t: PocTarget, cfg: PocConfig, log: RunLog, level: int) -> tuple[RunStats, BenchResult]:
    p = cfg.sizes
    n = max(1, round(p.requests_per_level * level))
    words = " ".join(FILLER.split()[: max(1, p.sweep_prompt_len // 2)])
    samples = [SampleRequest(f"[{level}.{i}] {words} {prompt(i)}", None, p.sweep_output_len) for i in range(n)]
    bc = BenchConfig(base_url=t.base_url, model=t.model, max_concurrency=level, ignore_eos=True, seed=cfg.seed,
                     disable_tqdm=True, server_metrics=False)
    gauges: list[dict[str, float]] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_gauges(t, stop, gauges))
    before = await scrape(t.http, t.base_url)  # the server's split of TTFT into queue and prefill, preemptions
    try:
        records, duration = await run_load(t.http, t.target(cfg.tenants[0]), samples, bc)
    finally:
        stop.set()
        await sampler
    after = await scrape(t.http, t.base_url)
    for r in records:
        log.add("concurrency", cfg.tenants[0], r)
    res = BenchResult(bc, t.model, None, records, duration, server_deltas(before, after))
    return stats_from_result(res, f"c={level}", p.sweep_prompt_len, p.sweep_output_len, level,
                             gauges if any(gauges) else None), res


async def check_concurrency(t: PocTarget, cfg: PocConfig, log: RunLog, res: CheckResult) -> None:
    """Sweep the concurrency levels, stopping after the first knee; no request may fail below the admission
    limit. The knee and the verdict come from diagnose's rules (bench/diagnose/rules.py)."""
    th = Thresholds()
    runs: list[RunStats] = []
    for level in cfg.sizes.sweep_levels:
        stats, _ = await _level(t, cfg, log, level)
        runs.append(stats)
        if len(runs) >= 2 and sweep_knees([r for r in runs if r.completed], th):
            break  # up to the knee: past it, latency is queueing, not the server's capacity
    verdict, knee, findings, _ = analyze([], [], runs, th)
    log.sweep = runs
    log.knee = next(({"knee_concurrency": f.knee_concurrency, "kind": f.kind.value if f.kind else None}
                     for f in findings if f.knee_concurrency), None)
    failed = sum(r.failed for r in runs)
    res.evidence = {"levels": [{"concurrency": r.concurrency, "requests": r.num_requests, "failed": r.failed,
                                "median_ttft_ms": round(r.median_ttft_ms, 1), "p99_ttft_ms": round(r.p99_ttft_ms, 1),
                                "median_itl_ms": round(r.median_itl_ms, 1), "p99_itl_ms": round(r.p99_itl_ms, 1),
                                "median_e2el_ms": round(r.median_e2el_ms, 1),
                                "output_tok_s": round(r.output_throughput, 1), "kv_usage_peak": r.kv_usage_peak,
                                "waiting_peak": r.waiting_peak, "errors": r.errors[:3]} for r in runs],
                    "knee_concurrency": knee, "verdict": verdict.value,
                    "findings": [str(f) for f in findings]}
    res.status = FAIL if failed else PASS
    top = runs[-1]
    res.summary = (f"levels {', '.join(str(r.concurrency) for r in runs)}: {failed} failed; at c={top.concurrency} "
                   f"TTFT p50 {top.median_ttft_ms:.0f} ms, ITL p50 {top.median_itl_ms:.1f} ms, "
                   f"{top.output_throughput:.1f} tok/s; verdict {verdict.value}"
                   + (f", knee at c={knee}" if knee else ""))


async def tenant_metrics(t: PocTarget) -> dict[str, dict[str, float]] | None:
    """{tenant: {metric: value summed over models/status}} from `pdserve:tenant_*`; None without them."""
    try:
        resp = await t.http.get(t.base_url + "/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(resp.text):
        for s in fam.samples:
            name = s.name.split(":", 1)[-1]
            if name in TENANT_METRICS and "tenant" in s.labels:
                row = out.setdefault(s.labels["tenant"], {})
                row[name] = row.get(name, 0.0) + s.value
    return out or None


def tenant_table(log: RunLog, tenants: tuple[str, ...], server: dict[str, dict[str, float]] | None) -> list[dict[str,
                                                                                                                Any]]:
    """Per tenant over the whole run: requests, errors, TTFT/TPOT/ITL p50/p99, output tokens, queue share."""
    queue_total = sum(v.get("tenant_queue_time_seconds_sum", 0.0) for v in (server or {}).values())
    rows = []
    for tenant in tenants:
        recs = [r.record for r in log.requests if r.tenant == tenant]
        m = compute_metrics(recs, 1.0, {}, (50.0, 99.0))
        srv = (server or {}).get(tenant, {})
        rows.append({"tenant": tenant, "requests": len(recs), "errors": m["failed"],
                     "output_tokens": m["total_output_tokens"],
                     **{f"{k}_{q}_ms": round(m[f"p{q}_{k}_ms"], 1) for k in ("ttft", "tpot", "itl") for q in (50, 99)},
                     "server_requests": srv.get("tenant_requests_total"),
                     "queue_share": (round(srv.get("tenant_queue_time_seconds_sum", 0.0) / queue_total, 3)
                                     if queue_total > 0 else None)})
    return rows


async def check_tenants(t: PocTarget, cfg: PocConfig, log: RunLog, res: CheckResult) -> None:
    """The same load under every tenant id, interleaved: every request succeeds and, when the server exports
    per-tenant metrics, it counted exactly the requests each tenant sent."""
    p = cfg.sizes
    before = await tenant_metrics(t)
    t0 = time.perf_counter()
    slots = asyncio.Semaphore(p.tenant_concurrency)

    async def one(tenant: str, i: int) -> None:
        async with slots:
            log.add(res.name, tenant, await t.stream(prompt(i), p.tenant_output_len, tenant, i, t0))

    await asyncio.gather(*(one(tn, i) for i in range(p.tenant_requests) for tn in cfg.tenants))
    after = await tenant_metrics(t)
    recs = log.records(res.name)
    sent = {tn: p.tenant_requests for tn in cfg.tenants}
    counted = None
    if after is not None:
        counted = {tn: (after.get(tn, {}).get("tenant_requests_total", 0.0)
                        - (before or {}).get(tn, {}).get("tenant_requests_total", 0.0)) for tn in cfg.tenants}
    mismatch = {tn: {"sent": sent[tn], "counted": counted[tn]} for tn in cfg.tenants
                if counted is not None and counted[tn] != sent[tn]}
    res.evidence = {"sent": sent, "server_counted": counted, "errors": error_counts(recs), "mismatch": mismatch,
                    "table": tenant_table(log, cfg.tenants, after)}
    failed = sum(not r.success for r in recs)
    res.status = FAIL if failed or mismatch else PASS
    res.summary = (f"{len(recs) - failed}/{len(recs)} succeeded under {len(cfg.tenants)} tenants; "
                   + ("the server exports no per-tenant metrics (client-side numbers only)" if counted is None else
                      f"server counts {'match' if not mismatch else 'differ: ' + str(mismatch)}"))

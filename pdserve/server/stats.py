"""Live statistics over a sliding window, for `GET /v1/stats` and the dashboard: rates and percentiles computed
server-side from what the engine thread reports (the same events that feed the Prometheus metrics).

Storage is bounded twice: samples older than MAX_WINDOW_S are dropped as new ones arrive, and every series is a
deque with a maximum length (a very busy server keeps only its newest samples; `truncated` says when a window
asked for more than is kept). Recording happens on the engine thread, snapshots on the event loop: one lock.

The bottleneck verdict is `pdserve diagnose`'s rule code (bench/diagnose/rules.analyze_window) applied to the
window's numbers, so the dashboard and `diagnose` cannot disagree on what "prefill-bound" means.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.api.dashboard_page import DEFAULT_WINDOW_S, MAX_WINDOW_S
from pdserve.bench.diagnose.rules import Thresholds, analyze_window, ttft_limit_ms
from pdserve.bench.diagnose.stats import RunStats
from pdserve.engine.client import KVOffloadStats, StepStats
from pdserve.outputs import RequestOutput
from pdserve.roofline import DeviceSpec, RooflineMeter

SNAPSHOT_MAX_AGE_S = 1.0  # /v1/stats answers from a snapshot at most this old
MAX_STEPS = 30_000  # ~15 min of 30 ms steps
MAX_REQUESTS = 20_000
MAX_ITL = 100_000
MAX_TENANTS = 64  # more distinct tenants than this are counted under OTHER_TENANT
OTHER_TENANT = "(other)"
LATENCIES = ("ttft", "itl", "tpot", "e2e", "queue", "prefill", "decode", "kv_transfer")


@dataclass(frozen=True)
class StepSample:
    """One engine step (or an idle tick, kind "idle") and the engine's gauges and counters after it."""

    t: float
    kind: str
    duration: float
    model_time: float
    flops: float
    nbytes: float
    prefill_tokens: int
    decode_tokens: int
    running: int
    waiting: int
    kv_usage: float
    prefix_queries: int  # running totals; a window's figure is last - first
    prefix_hits: int
    preemptions: int
    disk_lookups: int = 0  # the prefix cache's disk tier (--kv-offload-dir): blocks looked up there, found there
    disk_hits: int = 0
    disk_bytes: int = -1  # its files' bytes now (-1: no disk tier)


@dataclass(frozen=True)
class RequestSample:
    """One finished request: its phase times (seconds, None where it never got there) and token counts."""

    t: float
    tenant: str | None
    finish_reason: str
    prompt_tokens: int
    output_tokens: int
    ttft: float | None
    tpot: float | None
    e2e: float | None
    queue: float | None
    prefill: float | None
    decode: float | None


@dataclass(frozen=True)
class KVLoadSample:
    t: float
    ok: bool
    seconds: float
    nbytes: int


def _prune(series: deque[Any], cutoff: float) -> None:
    while series and series[0].t < cutoff:
        series.popleft()


def percentiles(values: Iterable[float], scale: float = 1000.0) -> dict[str, float | int | None]:
    """count, mean, p50, p90, p99, max of `values` x `scale` (seconds -> ms by default); None when empty."""
    arr = np.fromiter(values, dtype=float)
    if arr.size == 0:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    p50, p90, p99 = np.percentile(arr, [50, 90, 99]) * scale
    return {"count": int(arr.size), "mean": float(arr.mean() * scale), "p50": float(p50), "p90": float(p90),
            "p99": float(p99), "max": float(arr.max() * scale)}


@dataclass
class _Series:
    steps: deque[StepSample] = field(default_factory=lambda: deque(maxlen=MAX_STEPS))
    requests: deque[RequestSample] = field(default_factory=lambda: deque(maxlen=MAX_REQUESTS))
    tenant_requests: deque[RequestSample] = field(default_factory=lambda: deque(maxlen=MAX_REQUESTS))
    itl: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=MAX_ITL))  # (t, gap)
    kv_loads: deque[KVLoadSample] = field(default_factory=lambda: deque(maxlen=MAX_REQUESTS))
    errors: deque[tuple[float, str]] = field(default_factory=lambda: deque(maxlen=MAX_REQUESTS))
    # single-stream decode steps over the server's life: the unloaded decode step, the rules' ITL_ref
    solo_decode: deque[float] = field(default_factory=lambda: deque(maxlen=256))


class LiveStats:
    """One model's windowed statistics. `record_*` from the engine thread; `snapshot(window_s)` from anywhere."""

    def __init__(self, model_name: str, clock: Callable[[], float] = time.perf_counter) -> None:
        self.model_name, self.clock = model_name, clock
        self._s = _Series()
        self._lock = threading.Lock()
        self._tenants: set[str] = set()
        self.started = clock()
        self.device: DeviceSpec | None = None
        self.peak_flops = 0.0
        self._cached: dict[tuple[float, Thresholds | None], tuple[float, dict[str, Any]]] = {}

    def set_peaks(self, device: DeviceSpec | None, peak_flops: float) -> None:
        self.device, self.peak_flops = device, peak_flops

    # ---- recording (engine thread) -------------------------------------------------------------------------
    def record_step(self, step: StepStats, running: int, waiting: int, kv_usage: float, prefix_queries: int,
                    prefix_hits: int, preemptions: int, disk: KVOffloadStats | None = None) -> None:
        now = self.clock()
        tier = (disk.lookups, disk.hits, disk.disk_bytes) if disk is not None else (0, 0, -1)
        s = StepSample(now, str(step.kind), step.duration, step.model_time, step.flops, step.bytes,
                       step.num_prefill_tokens, step.num_decode_tokens, running, waiting, kv_usage, prefix_queries,
                       prefix_hits, preemptions, *tier)
        with self._lock:
            _prune(self._s.steps, now - MAX_WINDOW_S)
            self._s.steps.append(s)
            if s.kind == "decode" and s.decode_tokens == 1 and running == 1:
                self._s.solo_decode.append(step.duration)

    def record_itl(self, gap: float) -> None:
        now = self.clock()
        with self._lock:
            while self._s.itl and self._s.itl[0][0] < now - MAX_WINDOW_S:
                self._s.itl.popleft()
            self._s.itl.append((now, gap))

    def _sample(self, out: RequestOutput, tenant: str | None) -> RequestSample:
        t, comp = out.metrics, out.outputs[0]
        return RequestSample(self.clock(), tenant, comp.finish_reason or "error", len(out.prompt_token_ids),
                             len(comp.token_ids), t.ttft, t.tpot, t.e2e, t.queue_time, t.prefill_time, t.decode_time)

    def record_finished(self, out: RequestOutput) -> None:
        s = self._sample(out, None)
        with self._lock:
            _prune(self._s.requests, s.t - MAX_WINDOW_S)
            self._s.requests.append(s)

    def record_tenant(self, out: RequestOutput, tenant: str) -> None:
        """A finished request of a tenant (the serving layer knows it; the per-tenant view). Past MAX_TENANTS
        distinct tenants, new ones count under OTHER_TENANT."""
        if tenant not in self._tenants:
            if len(self._tenants) >= MAX_TENANTS:
                tenant = OTHER_TENANT
            else:
                self._tenants.add(tenant)
        s = self._sample(out, tenant)
        with self._lock:
            _prune(self._s.tenant_requests, s.t - MAX_WINDOW_S)
            self._s.tenant_requests.append(s)

    def record_kv_load(self, ok: bool, seconds: float, nbytes: int) -> None:
        now = self.clock()
        with self._lock:
            _prune(self._s.kv_loads, now - MAX_WINDOW_S)
            self._s.kv_loads.append(KVLoadSample(now, ok, seconds, nbytes))

    def record_error(self, kind: str) -> None:
        now = self.clock()
        with self._lock:
            while self._s.errors and self._s.errors[0][0] < now - MAX_WINDOW_S:
                self._s.errors.popleft()
            self._s.errors.append((now, kind))

    # ---- snapshot ------------------------------------------------------------------------------------------
    def cached_snapshot(self, window_s: float = DEFAULT_WINDOW_S, thresholds: Thresholds | None = None,
                        max_age_s: float = SNAPSHOT_MAX_AGE_S) -> dict[str, Any]:
        """`snapshot`, reused while younger than max_age_s: with full buffers a snapshot costs up to ~0.2 s of
        the event loop, and every open dashboard polls it. Keyed by (window, thresholds); a few keys at most."""
        key, now = (window_s, thresholds), self.clock()
        hit = self._cached.get(key)
        if hit is not None and now - hit[0] < max_age_s:
            return hit[1]
        block = self.snapshot(window_s, thresholds)
        if len(self._cached) >= 16:  # arbitrary ?window= values must not grow it
            self._cached.clear()
        self._cached[key] = (now, block)
        return block

    def snapshot(self, window_s: float = DEFAULT_WINDOW_S, thresholds: Thresholds | None = None) -> dict[str, Any]:
        """The model's block of /v1/stats over the last `window_s` seconds (clamped to (0, MAX_WINDOW_S])."""
        window_s = min(max(window_s, 1e-3), MAX_WINDOW_S)
        thresholds = thresholds or Thresholds()
        now = self.clock()
        cutoff = now - window_s
        with self._lock:
            all_steps = list(self._s.steps)
            reqs = [r for r in self._s.requests if r.t >= cutoff]
            by_tenant = [r for r in self._s.tenant_requests if r.t >= cutoff]
            itl = [g for t, g in self._s.itl if t >= cutoff]
            loads = [x for x in self._s.kv_loads if x.t >= cutoff]
            errors = [k for t, k in self._s.errors if t >= cutoff]
            solo = list(self._s.solo_decode)
        steps = [s for s in all_steps if s.t >= cutoff]
        before = [s for s in all_steps if s.t < cutoff]
        # counters: the window's increase = last total - the total just before the window (0 before any step)
        base = before[-1] if before else None
        span = min(window_s, now - self.started)  # a server younger than the window: rates over its life
        block = {
            "window_s": window_s,
            "span_s": span,
            "truncated": bool(all_steps) and all_steps[0].t > cutoff and len(all_steps) == MAX_STEPS,
            "requests": self._requests(reqs, errors, span),
            "latency_ms": self._latencies(reqs, itl, loads),
            "load": self._load(steps, all_steps),
            "kv_cache": self._kv(steps, all_steps, thresholds.kv_full),
            "prefix_cache": self._prefix(steps, base),
            "preemptions": (steps[-1].preemptions - (base.preemptions if base else 0)) if steps else 0,
            "steps": self._steps(steps, span),
            "kv_transfer": self._kv_transfer(loads, span),
            "tenants": self._by_tenant(by_tenant, span),
        }
        itl_ref_ms = float(np.median(solo)) * 1000 if solo else None
        block["verdict"] = self._verdict(block, window_s, itl_ref_ms, thresholds)
        return block

    @staticmethod
    def _requests(reqs: list[RequestSample], errors: list[str], span: float) -> dict[str, Any]:
        reasons: dict[str, int] = {}
        for r in reqs:
            reasons[r.finish_reason] = reasons.get(r.finish_reason, 0) + 1
        per_s = 1 / span if span > 0 else 0.0
        return {"finished": len(reqs), "per_s": len(reqs) * per_s, "finish_reasons": reasons,
                "errors": len(errors), "prompt_tokens_per_s": sum(r.prompt_tokens for r in reqs) * per_s,
                "generation_tokens_per_s": sum(r.output_tokens for r in reqs) * per_s,
                "mean_prompt_tokens": float(np.mean([r.prompt_tokens for r in reqs])) if reqs else None,
                "mean_generation_tokens": float(np.mean([r.output_tokens for r in reqs])) if reqs else None}

    @staticmethod
    def _latencies(reqs: list[RequestSample], itl: list[float], loads: list[KVLoadSample]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in ("ttft", "tpot", "e2e", "queue", "prefill", "decode"):
            out[name] = percentiles(v for r in reqs if (v := getattr(r, name)) is not None)
        out["itl"] = percentiles(itl)
        out["kv_transfer"] = percentiles(x.seconds for x in loads if x.ok)
        return out

    @staticmethod
    def _load(steps: list[StepSample], all_steps: list[StepSample]) -> dict[str, Any]:
        last = all_steps[-1] if all_steps else None
        return {"running": last.running if last else 0, "waiting": last.waiting if last else 0,
                "running_peak": max((s.running for s in steps), default=0),
                "waiting_peak": max((s.waiting for s in steps), default=0)}

    @staticmethod
    def _kv(steps: list[StepSample], all_steps: list[StepSample], full: float) -> dict[str, Any]:
        usage = all_steps[-1].kv_usage if all_steps else 0.0
        when_full = [s.waiting for s in steps if s.kv_usage >= full]
        return {"usage": usage, "watermark": max((s.kv_usage for s in steps), default=usage),
                "full_at": full, "waiting_when_full": max(when_full) if when_full else 0}

    @staticmethod
    def _prefix(steps: list[StepSample], base: StepSample | None) -> dict[str, Any]:
        if not steps:
            return {"queries": 0, "hits": 0, "hit_rate": None, "disk": None}
        last = steps[-1]
        q = last.prefix_queries - (base.prefix_queries if base else 0)
        h = last.prefix_hits - (base.prefix_hits if base else 0)
        disk = None
        if last.disk_bytes >= 0:  # blocks: a lookup there follows a miss in memory; a hit becomes a memory hit
            dq = last.disk_lookups - (base.disk_lookups if base else 0)
            dh = last.disk_hits - (base.disk_hits if base else 0)
            disk = {"lookups": dq, "hits": dh, "hit_rate": dh / dq if dq else None, "bytes": last.disk_bytes}
        return {"queries": q, "hits": h, "hit_rate": h / q if q else None, "disk": disk}

    def _steps(self, steps: list[StepSample], span: float) -> dict[str, Any]:
        """Per step kind: count, time share, tokens/s, step-time percentiles, and the live roofline (achieved
        FLOP/s, B/s, MFU, MBU, the nearer roof) computed by the engine's RooflineMeter."""
        meter = RooflineMeter.with_peak(self.device, self.peak_flops)
        by_kind: dict[str, list[StepSample]] = {}
        for s in steps:
            if s.kind != "idle":
                by_kind.setdefault(s.kind, []).append(s)
                meter.add(s.kind, s.model_time, s.flops, s.nbytes)
        roof = meter.summary()
        out: dict[str, Any] = {}
        for kind, ss in sorted(by_kind.items()):
            busy = sum(s.duration for s in ss)
            out[kind] = {"steps": len(ss), "busy_share": busy / span if span > 0 else 0.0,
                         "prefill_tokens_per_s": sum(s.prefill_tokens for s in ss) / span if span > 0 else 0.0,
                         "decode_tokens_per_s": sum(s.decode_tokens for s in ss) / span if span > 0 else 0.0,
                         "step_ms": percentiles(s.duration for s in ss),
                         "model_ms": percentiles(s.model_time for s in ss), **roof.get(kind, {})}
        return {"peak_flops": self.peak_flops or None,
                "peak_bandwidth": self.device.mem_bandwidth if self.device else None, "by_kind": out}

    @staticmethod
    def _kv_transfer(loads: list[KVLoadSample], span: float) -> dict[str, Any]:
        ok = [x for x in loads if x.ok]
        nbytes = sum(x.nbytes for x in ok)
        secs = sum(x.seconds for x in ok)
        return {"pulls": len(loads), "failed": len(loads) - len(ok), "bytes": nbytes,
                "bytes_per_s": nbytes / span if span > 0 else 0.0,
                "pull_gb_per_s": nbytes / secs / 1e9 if secs else None}

    @staticmethod
    def _by_tenant(reqs: list[RequestSample], span: float) -> dict[str, Any]:
        groups: dict[str, list[RequestSample]] = {}
        for r in reqs:
            if r.tenant is not None:
                groups.setdefault(r.tenant, []).append(r)
        return {tenant: {"finished": len(rs), "per_s": len(rs) / span if span > 0 else 0.0,
                         "generation_tokens_per_s": sum(r.output_tokens for r in rs) / span if span > 0 else 0.0,
                         "ttft_ms": percentiles(r.ttft for r in rs if r.ttft is not None),
                         "tpot_ms": percentiles(r.tpot for r in rs if r.tpot is not None)}
                for tenant, rs in sorted(groups.items())}

    @staticmethod
    def run_stats(block: dict[str, Any], window_s: float) -> RunStats:
        """The window's numbers as the diagnose rules read them (one "level": the load the window saw)."""
        lat, req, load, kv = block["latency_ms"], block["requests"], block["load"], block["kv_cache"]
        ok = sum(n for reason, n in req["finish_reasons"].items() if reason != "error")

        def v(name: str, key: str) -> float:
            x = lat[name][key]
            return 0.0 if x is None else float(x)

        queue, prefill = lat["queue"]["mean"], lat["prefill"]["mean"]
        return RunStats(
            label=f"last {window_s:g} s", prompt_len=round(req["mean_prompt_tokens"] or 0),
            output_len=round(req["mean_generation_tokens"] or 0), num_requests=req["finished"],
            concurrency=max(load["running_peak"], 1), completed=ok, failed=req["finished"] - ok + req["errors"],
            mean_ttft_ms=v("ttft", "mean"), median_ttft_ms=v("ttft", "p50"), p99_ttft_ms=v("ttft", "p99"),
            max_ttft_ms=v("ttft", "max"), median_tpot_ms=v("tpot", "p50"), median_itl_ms=v("itl", "p50"),
            p99_itl_ms=v("itl", "p99"), median_e2el_ms=v("e2e", "p50"), p99_e2el_ms=v("e2e", "p99"),
            output_throughput=req["generation_tokens_per_s"], duration_s=block["span_s"],
            server_queue_ms=queue, server_prefill_ms=prefill, preemptions=float(block["preemptions"]),
            kv_usage_peak=kv["watermark"], waiting_peak=float(load["waiting_peak"]),
            waiting_when_full=float(kv["waiting_when_full"]), running_peak=float(load["running_peak"]))

    def _verdict(self, block: dict[str, Any], window_s: float, itl_ref_ms: float | None,
                 th: Thresholds) -> dict[str, Any]:
        r = self.run_stats(block, window_s)
        verdict, findings = analyze_window(r, itl_ref_ms, th)
        decode = block["steps"]["by_kind"].get("decode", {})
        prefill = block["steps"]["by_kind"].get("prefill", {})
        return {
            "verdict": verdict.value,
            "findings": [{"kind": f.kind.value if f.kind else None, "text": f.text} for f in findings],
            "numbers": {
                "ttft_p50_ms": r.median_ttft_ms, "ttft_limit_ms": ttft_limit_ms(itl_ref_ms, th),
                "itl_p50_ms": r.median_itl_ms, "itl_ref_ms": itl_ref_ms,
                "itl_limit_ms": th.itl_factor * itl_ref_ms if itl_ref_ms else th.slo_tpot_ms,
                "tpot_p50_ms": r.median_tpot_ms, "queue_share": r.queue_share, "preemptions": r.preemptions,
                "kv_watermark": r.kv_usage_peak, "waiting_when_full": r.waiting_when_full,
                "decode_mbu": decode.get("mbu"), "decode_mfu": decode.get("mfu"),
                "prefill_mfu": prefill.get("mfu"), "prefill_mbu": prefill.get("mbu")},
        }

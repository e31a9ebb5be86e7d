"""The numbers of one experiment run: a benchmark result and its /metrics samples reduced to what the rules read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunStats:
    """One run_benchmark call reduced to what the rules read. Times in ms; server values None without /metrics."""

    label: str
    prompt_len: int
    output_len: int
    num_requests: int
    concurrency: int | None = None  # None: all at once
    completed: int = 0
    failed: int = 0
    mean_ttft_ms: float = 0.0
    median_ttft_ms: float = 0.0
    p99_ttft_ms: float = 0.0
    max_ttft_ms: float = 0.0
    median_tpot_ms: float = 0.0
    median_itl_ms: float = 0.0
    p99_itl_ms: float = 0.0
    median_e2el_ms: float = 0.0
    p99_e2el_ms: float = 0.0
    output_throughput: float = 0.0  # tok/s
    duration_s: float = 0.0
    server_queue_ms: float | None = None  # mean
    server_prefill_ms: float | None = None  # mean
    preemptions: float | None = None
    kv_usage_peak: float | None = None  # sampled gauges (c only)
    waiting_peak: float | None = None
    waiting_when_full: float | None = None  # most requests waiting in a sample that also saw KV usage >= kv_full
    running_peak: float | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def prefill_share(self) -> float | None:
        """Server prefill / (queue + prefill): >= 0.5 means prefill dominates TTFT."""
        q, p = self.server_queue_ms, self.server_prefill_ms
        if q is None or p is None or q + p <= 0:
            return None
        return p / (q + p)

    @property
    def queue_share(self) -> float | None:
        s = self.prefill_share
        return None if s is None else 1.0 - s

    @property
    def has_server_metrics(self) -> bool:
        return self.server_queue_ms is not None or self.preemptions is not None


def stats_from_result(res: Any, label: str, prompt_len: int, output_len: int, concurrency: int | None,
                      gauges: list[dict[str, float]] | None = None, kv_full: float = 0.9) -> RunStats:
    """`gauges`: the /metrics samples taken during the run (None when not sampled)."""
    m = res.summary()
    ok = [r for r in res.records if r.success]

    def peak(name: str, samples: list[dict[str, float]]) -> float | None:
        values = [g[name] for g in samples if name in g]
        return max(values) if values else (None if gauges is None else 0.0)

    every = gauges or []
    full = [g for g in every if g.get("kv_cache_usage_perc", 0.0) >= kv_full]
    return RunStats(
        label=label, prompt_len=prompt_len, output_len=output_len, num_requests=len(res.records),
        concurrency=concurrency, completed=m["completed"], failed=m["failed"],
        mean_ttft_ms=m["mean_ttft_ms"], median_ttft_ms=m["median_ttft_ms"], p99_ttft_ms=m["p99_ttft_ms"],
        max_ttft_ms=max((r.ttft for r in ok), default=0.0) * 1000, median_tpot_ms=m["median_tpot_ms"],
        median_itl_ms=m["median_itl_ms"], p99_itl_ms=m["p99_itl_ms"], median_e2el_ms=m["median_e2el_ms"],
        p99_e2el_ms=m["p99_e2el_ms"], output_throughput=m["output_throughput"], duration_s=m["duration"],
        server_queue_ms=m.get("server_mean_queue_ms"), server_prefill_ms=m.get("server_mean_prefill_ms"),
        preemptions=m.get("server_preemptions"), kv_usage_peak=peak("kv_cache_usage_perc", every),
        waiting_peak=peak("num_requests_waiting", every), running_peak=peak("num_requests_running", every),
        waiting_when_full=peak("num_requests_waiting", full),
        errors=sorted({r.error for r in res.records if not r.success}))

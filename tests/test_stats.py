"""LiveStats (GET /v1/stats): windows, percentiles, counter deltas, bounded storage, and the verdict computed by the
diagnose rules (rules.analyze_window) — without a server."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.bench.diagnose import RunStats, Thresholds, Verdict, analyze_window
from pdserve.engine.client import KVOffloadStats, StepStats
from pdserve.engine.request import RequestStatus
from pdserve.model.inputs import StepKind
from pdserve.outputs import CompletionOutput, RequestOutput, RequestTimes
from pdserve.roofline import DeviceSpec
from pdserve.server import stats as stats_mod
from pdserve.server.stats import LiveStats, percentiles


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def finished(rid: str, arrival: float, queue: float, prefill: float, itl: float, n_out: int,
             reason: RequestStatus = RequestStatus.FINISHED_LENGTH) -> RequestOutput:
    """A request's final output, as the engine client reports it."""
    t = RequestTimes(arrival=arrival)
    t.first_scheduled = arrival + queue
    t.first_token = t.first_scheduled + prefill
    t.token_times = [t.first_token + i * itl for i in range(n_out)]
    t.finished = t.token_times[-1]
    comp = CompletionOutput(0, "", [7] * n_out, finish_reason=reason.finish_reason)
    return RequestOutput(rid, None, [1, 2, 3, 4], [comp], True, t)


def step(kind: StepKind, duration: float, prefill: int = 0, decode: int = 0, flops: float = 0.0,
         nbytes: float = 0.0, model_time: float | None = None) -> StepStats:
    return StepStats(kind, prefill, decode, 0, duration, model_time=duration if model_time is None else model_time,
                     flops=flops, bytes=nbytes)


def test_percentiles_and_empty() -> None:
    p = percentiles([0.010, 0.020, 0.030, 0.040])
    assert p["count"] == 4 and p["p50"] == pytest.approx(25.0) and p["max"] == pytest.approx(40.0)
    assert p["p99"] == pytest.approx(float(np.percentile([10, 20, 30, 40], 99)))
    assert percentiles([])["p50"] is None


def test_window_drops_old_samples_and_counters_are_deltas() -> None:
    clock = Clock()
    live = LiveStats("m", clock)
    live.record_step(step(StepKind.PREFILL, 0.1, prefill=32), 1, 0, 0.2, prefix_queries=100, prefix_hits=10,
                     preemptions=1)
    live.record_finished(finished("old", clock.t - 1, 0.5, 0.1, 0.02, 5))
    live.record_itl(0.5)
    clock.t += 120  # the first samples leave a 60 s window
    live.record_step(step(StepKind.DECODE, 0.02, decode=2), 2, 1, 0.5, prefix_queries=160, prefix_hits=40,
                     preemptions=3)
    live.record_finished(finished("new", clock.t - 1, 0.01, 0.05, 0.02, 5, RequestStatus.FINISHED_STOPPED))
    for gap in (0.02, 0.03):
        live.record_itl(gap)
    b = live.snapshot(60)
    assert b["requests"]["finished"] == 1 and b["requests"]["finish_reasons"] == {"stop": 1}
    assert b["latency_ms"]["itl"]["count"] == 2 and b["latency_ms"]["itl"]["p50"] == pytest.approx(25.0)
    assert b["latency_ms"]["queue"]["p50"] == pytest.approx(10.0)
    # counters over the window: totals after its last step minus totals before it
    assert b["prefix_cache"] == {"queries": 60, "hits": 30, "hit_rate": 0.5, "disk": None}
    assert b["preemptions"] == 2
    assert b["load"] == {"running": 2, "waiting": 1, "running_peak": 2, "waiting_peak": 1}
    assert b["kv_cache"]["usage"] == 0.5 and b["kv_cache"]["watermark"] == 0.5
    assert set(b["steps"]["by_kind"]) == {"decode"}
    whole = live.snapshot(600)  # a longer window sees both
    assert whole["requests"]["finished"] == 2 and whole["preemptions"] == 3
    assert whole["kv_cache"]["watermark"] == 0.5 and whole["prefix_cache"]["hit_rate"] == pytest.approx(40 / 160)


def test_the_disk_tier_in_the_window() -> None:
    clock = Clock()
    live = LiveStats("m", clock)
    live.record_step(step(StepKind.PREFILL, 0.1, prefill=32), 1, 0, 0.2, 100, 10, 0,
                     KVOffloadStats(lookups=10, hits=4, disk_bytes=1000))
    clock.t += 120
    live.record_step(step(StepKind.PREFILL, 0.1, prefill=32), 1, 0, 0.2, 200, 60, 0,
                     KVOffloadStats(lookups=30, hits=19, disk_bytes=5000))
    assert live.snapshot(60)["prefix_cache"]["disk"] == {"lookups": 20, "hits": 15, "hit_rate": 0.75, "bytes": 5000}


def test_storage_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    live = LiveStats("m", clock)
    for _ in range(50):  # older than MAX_WINDOW_S: pruned as new samples arrive
        live.record_itl(0.01)
    clock.t += stats_mod.MAX_WINDOW_S + 1
    live.record_itl(0.02)
    assert len(live._s.itl) == 1
    n = stats_mod.MAX_STEPS
    for _ in range(n + 10):  # within the window: the deque's cap holds
        live.record_step(step(StepKind.DECODE, 0.01, decode=1), 1, 0, 0.1, 0, 0, 0)
    assert len(live._s.steps) == n
    for i in range(stats_mod.MAX_TENANTS + 5):
        live.record_tenant(finished(f"r{i}", clock.t - 1, 0.0, 0.01, 0.01, 2), f"租户{i}")
    tenants = live.snapshot(60)["tenants"]
    assert len(tenants) == stats_mod.MAX_TENANTS + 1 and tenants[stats_mod.OTHER_TENANT]["finished"] == 5
    assert tenants["租户0"]["finished"] == 1


def test_roofline_per_step_kind_against_the_peaks() -> None:
    live = LiveStats("m", Clock())
    live.set_peaks(DeviceSpec("test", peak_flops=1e12, mem_bandwidth=1e11, memory=1e9), 1e12)
    live.record_step(step(StepKind.PREFILL, 0.5, prefill=512, flops=2.5e11, nbytes=1e9), 1, 0, 0.1, 0, 0, 0)
    for _ in range(4):
        live.record_step(step(StepKind.DECODE, 0.1, decode=1, flops=1e9, nbytes=5e9), 1, 0, 0.1, 0, 0, 0)
    kinds = live.snapshot(60)["steps"]["by_kind"]
    assert kinds["prefill"]["model_ms"]["p50"] == pytest.approx(500.0)
    assert kinds["prefill"]["mfu"] == pytest.approx(0.5) and kinds["prefill"]["nearer_roof"] == "compute"
    assert kinds["decode"]["mbu"] == pytest.approx(0.5) and kinds["decode"]["nearer_roof"] == "bandwidth"
    assert kinds["decode"]["steps"] == 4 and kinds["decode"]["step_ms"]["p50"] == pytest.approx(100.0)


def test_step_time_and_its_forward_apart() -> None:
    """model_ms is the forward pass and sampling of each step, step_ms the whole step (scheduling and output
    processing included): the difference is the engine's own time."""
    live = LiveStats("m", Clock())
    for _ in range(3):
        live.record_step(step(StepKind.DECODE, 0.040, decode=32, model_time=0.034), 32, 0, 0.1, 0, 0, 0)
    decode = live.snapshot(60)["steps"]["by_kind"]["decode"]
    assert decode["step_ms"]["p50"] == pytest.approx(40.0) and decode["model_ms"]["p50"] == pytest.approx(34.0)


def level(ttft: float, itl: float, queue: float, prefill: float, preemptions: float = 0.0,
          kv_peak: float = 0.3, waiting_full: float = 0.0) -> RunStats:
    return RunStats("last 60 s", 100, 50, 10, concurrency=4, completed=10, median_ttft_ms=ttft, max_ttft_ms=ttft,
                    median_itl_ms=itl, median_tpot_ms=itl, server_queue_ms=queue, server_prefill_ms=prefill,
                    preemptions=preemptions, kv_usage_peak=kv_peak, waiting_when_full=waiting_full)


@pytest.mark.parametrize("r, verdict", [
    (level(40, 20, 5, 30), Verdict.HEALTHY),
    (level(900, 20, 800, 100), Verdict.QUEUEING),
    (level(900, 20, 100, 800), Verdict.PREFILL),
    (level(40, 90, 5, 30), Verdict.DECODE),
    (level(900, 20, 800, 100, preemptions=3), Verdict.KV_CAPACITY),
    (level(40, 20, 5, 30, kv_peak=0.95, waiting_full=2), Verdict.KV_CAPACITY),
])
def test_live_verdict_uses_the_diagnose_rules(r: RunStats, verdict: Verdict) -> None:
    v, findings = analyze_window(r, itl_ref=20.0, th=Thresholds())
    assert v == verdict
    assert any(f.kind == verdict for f in findings) or verdict == Verdict.HEALTHY
    assert all(f.text for f in findings)


def test_snapshot_verdict_reads_the_window() -> None:
    """A window with preemptions and slow queued requests reads kv-capacity-bound; ITL_ref is the median of the
    single-stream decode steps seen."""
    clock = Clock()
    live = LiveStats("m", clock)
    for _ in range(5):
        live.record_step(step(StepKind.DECODE, 0.02, decode=1), 1, 0, 0.2, 0, 0, 0)
    assert live.snapshot(60)["verdict"]["verdict"] == "healthy"  # nothing finished yet
    live.record_step(step(StepKind.MIXED, 0.3, prefill=64, decode=3), 4, 6, 0.97, 0, 0, preemptions=2)
    for i in range(4):
        live.record_finished(finished(f"r{i}", clock.t - 3, 2.0, 0.2, 0.03, 10))
    v = live.snapshot(60)["verdict"]
    assert v["verdict"] == "kv-capacity-bound"
    assert v["numbers"]["itl_ref_ms"] == pytest.approx(20.0) and v["numbers"]["preemptions"] == 2
    assert v["numbers"]["kv_watermark"] == pytest.approx(0.97)
    assert any("2 preemptions" in f["text"] for f in v["findings"])


def test_cached_snapshot_is_reused_for_a_second_then_recomputed() -> None:
    clock = Clock()
    live = LiveStats("m", clock)
    live.record_finished(finished("a", clock.t - 1, 0.01, 0.05, 0.02, 5))
    first = live.cached_snapshot(60)
    live.record_finished(finished("b", clock.t - 1, 0.01, 0.05, 0.02, 5))
    clock.t += 0.5
    assert live.cached_snapshot(60) is first  # younger than max_age_s: the same block, "b" not yet in it
    assert live.cached_snapshot(30)["requests"]["finished"] == 2  # another window is its own entry
    clock.t += 0.6
    fresh = live.cached_snapshot(60)
    assert fresh is not first and fresh["requests"]["finished"] == 2
    for w in range(1, 40):  # arbitrary windows keep the cache bounded
        live.cached_snapshot(float(w))
    assert len(live._cached) <= 16

"""`pdserve diagnose`: run the seeds' three experiments against a server and say which phase limits it.

    from pdserve.bench.diagnose import DiagnoseConfig, diagnose
    result = asyncio.run(diagnose(DiagnoseConfig(base_url=..., scale=0.25)))
    result.verdict, result.knee_concurrency, result.findings

Experiments (every prompt is random token ids of an exact length sent to /v1/completions with ignore_eos, so
lengths are exact; each run draws its own ids, so the prefix cache never hits across runs):
  (a) prompt shapes: the same total prompt tokens T as 1×T, 2×T/2 and 4×T/4 prompts, all sent at once, short
      outputs. Reads TTFT (mean, max) and the server's split of TTFT into queue and prefill time.
  (b) output lengths: one stream (concurrency 1), outputs 128 / 512 / 2048 tokens. Reads TPOT, ITL, tokens/s.
  (c) concurrency sweep: fixed prompt/output lengths, `2 × level` requests at each level with at most `level` in
      flight. Reads median/p99 TTFT, ITL, E2EL, throughput, server queue time, preemptions, and the peaks of the
      `kv_cache_usage_perc` / `num_requests_waiting` gauges sampled from /metrics during the run.
`--scale` multiplies every prompt and output length (not the concurrency levels).

Rules (the seeds': TTFT high + ITL normal -> prefill/queueing; TTFT normal + ITL high -> decode/scheduling; both
high -> capacity; a sudden knee in the sweep -> KV capacity). Every number is a `Thresholds` field:
  ITL_ref        the smallest median ITL of a single-stream run ((b), level 1 of (c), the 1×T run of (a)):
                 the server's unloaded decode step.
  TTFT high      > slo_ttft_ms when given, else > max(10 × ITL_ref, 250 ms): the first token costs more than ten
                 decode steps, and is slow enough for a person to notice.
  ITL high       median TPOT > slo_tpot_ms when given, else median ITL > 3 × ITL_ref (not 2×: on a CPU a batch of
                 one decodes on a faster matrix-vector path, so two streams alone can cost 1.7× one; 3× means the
                 streams really slow each other down).
  prefill share  server prefill time / (queue + prefill) time; >= 0.5 means prefill dominates TTFT, else queue.
  (a) prefill-bound: the 1×T run's TTFT is high, prefill share >= 0.5, ITL not high.
      queueing: the 1×T run's TTFT is high with queue share >= 0.5 (a lone request waited), or the 4×T/4 run's max
      TTFT is >= 1.5 × the 1×T run's, the extra is itself over the TTFT limit, and its queue share is >= 0.5
      (splitting the same tokens into requests costs time: the scheduler serializes them).
  (b) decode-bound: median ITL of the longest output >= 1.5 × that of the shortest and >= 5 ms more (decode slows
      as the KV cache grows), or median TPOT > slo_tpot_ms. The shortest runs first and again last; the slower of
      the two is the baseline (a machine that got busier meanwhile is not decode slowing down).
  (c) knee: a level where a latency (median TTFT, p99 TTFT, median E2EL, p99 ITL: waiting for admission shows in
      TTFT, a preemption's recompute stall in the ITL tail and E2EL) rises, from the level below, by more than
      3 × the trend's rise, by more than 50 ms, and to at least 1.5 × the level below. The trend is the slope of
      the segment below (successive slopes; at least 0.05 × y0/level0 against noise), and for the second level
      the proportional slope y0/level0. Growth within the trend is contention, not a knee.
      KV evidence at a level: preemptions > 0, or a /metrics sample with KV usage >= 0.9 and requests waiting.
      The first knee with KV evidence at its level -> kv-capacity-bound, at that concurrency. Else the first knee:
      a TTFT/E2EL knee with queue share >= 0.5 and a queue-time rise >= 0.5 × the latency rise -> queueing
      (slots, not memory); on a server without /metrics -> kv-capacity-bound, unconfirmed (the seeds' reading).
      No knee, but KV evidence at a level whose latency rose >= 1.5 × the level below -> kv-capacity-bound from
      there (a server whose throughput saturated early grows linearly right through its KV limit).
      Then, at the highest level: ITL high -> decode-bound (both high: compute contention); TTFT high only ->
      queueing or prefill-bound by the share.
Primary verdict: the first found of kv-capacity-bound, prefill-bound, queueing, decode-bound; else healthy. Every
finding is listed with the numbers that led to it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

from pdserve.bench.config import COMPLETIONS_ENDPOINT, BenchConfig, BenchError

EXPERIMENTS = ("a", "b", "c")
GAUGES = ("kv_cache_usage_perc", "num_requests_waiting", "num_requests_running")


class Verdict(StrEnum):
    KV_CAPACITY = "kv-capacity-bound"
    PREFILL = "prefill-bound"
    QUEUEING = "queueing"
    DECODE = "decode-bound"
    HEALTHY = "healthy"


PRIORITY = (Verdict.KV_CAPACITY, Verdict.PREFILL, Verdict.QUEUEING, Verdict.DECODE)


@dataclass(frozen=True)
class Thresholds:
    ttft_factor: float = 10.0  # TTFT high: > ttft_factor × ITL_ref ...
    ttft_floor_ms: float = 250.0  # ... and > this
    itl_factor: float = 3.0  # ITL high: median ITL > itl_factor × ITL_ref
    share: float = 0.5  # prefill (or queue) share of TTFT that "dominates"
    split_overhead: float = 1.5  # (a): 4 pieces' max TTFT vs 1 piece's
    tpot_growth: float = 1.5  # (b): ITL(longest output) / ITL(shortest)
    tpot_growth_min_ms: float = 5.0
    knee_ratio: float = 3.0  # (c): actual rise / trend-predicted rise
    knee_min_jump_ms: float = 50.0
    knee_min_growth: float = 1.5  # y_knee / y_below
    knee_slope_floor: float = 0.05  # trend slope >= this × y0 / level0
    kv_full: float = 0.9  # KV usage peak that counts as full
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None


@dataclass
class DiagnoseConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = COMPLETIONS_ENDPOINT
    model: str | None = None  # None: the first model of GET /v1/models
    tokenizer: str | None = None  # None: the served model's
    api_key: str | None = None
    scale: float = 1.0  # multiplies every prompt and output length below
    experiments: tuple[str, ...] = EXPERIMENTS
    # (a) the same total prompt tokens as 1, 2 and 4 prompts
    shape_total_tokens: int = 2048
    shape_pieces: tuple[int, ...] = (1, 2, 4)
    shape_output_len: int = 16
    # (b) one stream, these output lengths
    decode_prompt_len: int = 32
    decode_output_lens: tuple[int, ...] = (128, 512, 2048)
    # (c) concurrency sweep
    concurrency_levels: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    sweep_prompt_len: int = 128
    sweep_output_len: int = 64
    requests_per_level: float = 2.0  # requests at a level = max(1, round(this × level))
    gauge_interval_s: float = 0.25  # /metrics sampling during (c)
    out_dir: str | None = None  # None: ./diagnose-<date>
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    rules: Thresholds = field(default_factory=Thresholds)  # the judging thresholds; the SLOs above override its
    seed: int = 0
    request_timeout: float = 600.0

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        self.experiments = tuple(e.strip().lower() for e in self.experiments if e.strip())
        bad = [e for e in self.experiments if e not in EXPERIMENTS]
        if bad or not self.experiments:
            raise BenchError(f"--experiments takes a subset of a,b,c; got {','.join(self.experiments) or 'none'}")
        if not self.scale > 0:
            raise BenchError(f"--scale must be > 0, got {self.scale}")
        if not self.concurrency_levels or min(self.concurrency_levels) < 1:
            raise BenchError(f"--concurrency-levels must be positive integers, got {self.concurrency_levels}")
        self.concurrency_levels = tuple(sorted(set(self.concurrency_levels)))
        if not self.shape_pieces or min(self.shape_pieces) < 1:
            raise BenchError("shape_pieces must be positive")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise BenchError(f"--{name.replace('_', '-')} must be > 0, got {v}")

    def scaled(self, n: int, minimum: int) -> int:
        return max(minimum, round(n * self.scale))

    @property
    def thresholds(self) -> Thresholds:
        slos = {k: v for k, v in (("slo_ttft_ms", self.slo_ttft_ms), ("slo_tpot_ms", self.slo_tpot_ms)) if v}
        return dataclasses.replace(self.rules, **slos)


# ---- the numbers of one run -------------------------------------------------------------------------------------
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


# ---- rules (pure functions of the numbers) ----------------------------------------------------------------------
@dataclass
class Finding:
    kind: Verdict | None  # None: informational
    text: str
    experiment: str  # "a", "b", "c" or "" (overall)
    knee_concurrency: int | None = None

    def __str__(self) -> str:
        return f"[{self.kind.value if self.kind else 'info'}] ({self.experiment or '-'}) {self.text}"


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f} ms" if v >= 100 else f"{v:.1f} ms"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.0f}%"


def itl_reference(a: Sequence[RunStats], b: Sequence[RunStats], c: Sequence[RunStats]) -> float | None:
    """The unloaded decode step: the smallest median ITL of the single-stream runs."""
    single = [r for r in b if r.completed]
    single += [r for r in c if r.concurrency == 1 and r.completed]
    single += [r for r in a if r.num_requests == 1 and r.completed]
    values = [r.median_itl_ms for r in single if r.median_itl_ms > 0]
    return min(values) if values else None


def ttft_limit_ms(itl_ref: float | None, th: Thresholds) -> float:
    if th.slo_ttft_ms is not None:
        return th.slo_ttft_ms
    return max(th.ttft_factor * (itl_ref or 0.0), th.ttft_floor_ms)


def ttft_high(ttft_ms: float, itl_ref: float | None, th: Thresholds) -> bool:
    return ttft_ms > ttft_limit_ms(itl_ref, th)


def itl_high(r: RunStats, itl_ref: float | None, th: Thresholds) -> bool:
    if th.slo_tpot_ms is not None:
        return r.median_tpot_ms > th.slo_tpot_ms
    return itl_ref is not None and r.median_itl_ms > th.itl_factor * itl_ref


def _itl_rule(th: Thresholds, itl_ref: float | None) -> str:
    if th.slo_tpot_ms is not None:
        return f"TPOT SLO {_ms(th.slo_tpot_ms)}"
    return f"limit {th.itl_factor:g} × ITL_ref = {_ms(th.itl_factor * itl_ref) if itl_ref else 'n/a'}"


def _ttft_rule(th: Thresholds, itl_ref: float | None) -> str:
    if th.slo_ttft_ms is not None:
        return f"TTFT SLO {_ms(th.slo_ttft_ms)}"
    return f"limit max({th.ttft_factor:g} × ITL_ref, {th.ttft_floor_ms:g} ms) = {_ms(ttft_limit_ms(itl_ref, th))}"


def knee_points(levels: Sequence[int], values: Sequence[float], th: Thresholds = Thresholds()) -> list[int]:
    """Indices of the levels where `values` jumps above the trend of the levels below (see the module doc); empty
    when growth stays within the trend (linear contention) or there are fewer than two levels."""
    if len(levels) < 2 or levels[0] <= 0 or values[0] <= 0:
        return []
    base_slope = values[0] / levels[0]  # growth proportional to load, from the origin
    slope = base_slope  # the trend the next rise is compared with
    knees = []
    for i in range(1, len(levels)):
        step = levels[i] - levels[i - 1]
        rise = values[i] - values[i - 1]
        if (rise > th.knee_ratio * slope * step and rise > th.knee_min_jump_ms
                and values[i] >= th.knee_min_growth * values[i - 1]):
            knees.append(i)
        slope = max(rise / step, th.knee_slope_floor * base_slope)  # successive slopes, floored against noise
    return knees


def find_knee(levels: Sequence[int], values: Sequence[float], th: Thresholds = Thresholds()) -> int | None:
    """Index of the first knee, or None."""
    knees = knee_points(levels, values, th)
    return knees[0] if knees else None


def analyze_shapes(runs: Sequence[RunStats], itl_ref: float | None, th: Thresholds) -> list[Finding]:
    """(a): is the first token's cost prefill compute (it follows the longest prompt) or waiting (queue)?"""
    ok = sorted((r for r in runs if r.completed), key=lambda r: r.num_requests)
    if not ok:
        return [Finding(None, "no successful run; nothing to judge", "a")]
    one, many = ok[0], ok[-1]
    shapes = ", ".join(f"{r.label}: mean {_ms(r.mean_ttft_ms)} / max {_ms(r.max_ttft_ms)}" for r in ok)
    findings = [Finding(None, f"TTFT per shape — {shapes}", "a")]
    high = ttft_high(one.max_ttft_ms, itl_ref, th)
    decode_high = itl_high(one, itl_ref, th)
    share = one.prefill_share
    split = (f"server queue {_ms(one.server_queue_ms)} + prefill {_ms(one.server_prefill_ms)} "
             f"(prefill share {_pct(share)})")
    numbers = (f"{one.label}: TTFT {_ms(one.max_ttft_ms)} ({_ttft_rule(th, itl_ref)}; ITL_ref {_ms(itl_ref)}), "
               f"{split}; median ITL {_ms(one.median_itl_ms)} ({_itl_rule(th, itl_ref)})")
    if high and decode_high:
        findings.append(Finding(None, f"both TTFT and ITL high → capacity; {numbers}", "a"))
    elif high and (share is None or share >= th.share):
        rate = one.prompt_len / (one.server_prefill_ms / 1000) if one.server_prefill_ms else None
        tps = f"; prefill ≈ {rate:.0f} prompt tok/s" if rate else ""
        findings.append(Finding(Verdict.PREFILL, f"TTFT high, prefill-dominated, ITL normal — {numbers}{tps}",
                                "a"))
    elif high:
        findings.append(Finding(Verdict.QUEUEING, f"a lone request's TTFT is mostly queue time — {numbers}", "a"))
    extra = many.max_ttft_ms - one.max_ttft_ms
    if (many is not one and many.max_ttft_ms >= th.split_overhead * one.max_ttft_ms
            and ttft_high(extra, itl_ref, th) and (many.queue_share or 0.0) >= th.share):
        findings.append(Finding(
            Verdict.QUEUEING,
            f"the same tokens as {many.label} take {many.max_ttft_ms / one.max_ttft_ms:.1f}× the max TTFT of "
            f"{one.label} ({_ms(many.max_ttft_ms)} vs {_ms(one.max_ttft_ms)}; limit {th.split_overhead:g}×, and "
            f"the extra {_ms(extra)} is itself over the TTFT limit {_ms(ttft_limit_ms(itl_ref, th))}), queue share "
            f"{_pct(many.queue_share)}: requests are serialized by the scheduler", "a"))
    return findings


def analyze_output_lengths(runs: Sequence[RunStats], itl_ref: float | None, th: Thresholds) -> list[Finding]:
    """(b): a healthy decoder keeps ITL flat as the output (and its KV cache) grows."""
    ok = sorted((r for r in runs if r.completed and r.output_len > 1), key=lambda r: r.output_len)
    if not ok:
        return [Finding(None, "no successful run; nothing to judge", "b")]
    per = ", ".join(f"{r.output_len} tok{' (again)' if r.label.endswith('again') else ''}: TPOT "
                    f"{_ms(r.median_tpot_ms)}, ITL {_ms(r.median_itl_ms)} (p99 {_ms(r.p99_itl_ms)}), "
                    f"{r.output_throughput:.1f} tok/s" for r in ok)
    findings = [Finding(None, f"single stream — {per}", "b")]
    # the shortest output may run twice (first and last): the slower one is the baseline, so a machine that got
    # busier while the long outputs ran does not read as decode slowing down with its KV cache
    short = max((r for r in ok if r.output_len == ok[0].output_len), key=lambda r: r.median_itl_ms)
    long_ = ok[-1]
    if long_.output_len > short.output_len and short.median_itl_ms > 0:
        growth = long_.median_itl_ms / short.median_itl_ms
        if growth >= th.tpot_growth and long_.median_itl_ms - short.median_itl_ms >= th.tpot_growth_min_ms:
            findings.append(Finding(
                Verdict.DECODE,
                f"ITL grows {growth:.2f}× from {short.output_len} to {long_.output_len} output tokens "
                f"({_ms(short.median_itl_ms)} → {_ms(long_.median_itl_ms)}; limit {th.tpot_growth:g}×): decode "
                "slows as the KV cache it reads grows", "b"))
    if th.slo_tpot_ms is not None:
        over = [r for r in ok if r.median_tpot_ms > th.slo_tpot_ms]
        if over:
            findings.append(Finding(
                Verdict.DECODE, f"single-stream TPOT over the SLO {_ms(th.slo_tpot_ms)}: "
                + ", ".join(f"{r.output_len} tok {_ms(r.median_tpot_ms)}" for r in over), "b"))
    return findings


def kv_evidence(r: RunStats, th: Thresholds) -> str | None:
    """Why this level ran out of KV memory, or None."""
    if r.preemptions:
        return f"{r.preemptions:.0f} preemptions"
    if r.kv_usage_peak is not None and r.kv_usage_peak >= th.kv_full and (r.waiting_when_full or 0) > 0:
        return f"KV usage {_pct(r.kv_usage_peak)} with {r.waiting_when_full:.0f} requests waiting at the same time"
    return None


def _level_line(r: RunStats) -> str:
    return (f"c={r.concurrency}: TTFT p50 {_ms(r.median_ttft_ms)}, E2EL p50 {_ms(r.median_e2el_ms)}, "
            f"ITL p50 {_ms(r.median_itl_ms)}, queue mean {_ms(r.server_queue_ms)}, preemptions "
            f"{'n/a' if r.preemptions is None else f'{r.preemptions:.0f}'}, KV peak {_pct(r.kv_usage_peak)}, "
            f"waiting peak {'n/a' if r.waiting_peak is None else f'{r.waiting_peak:.0f}'}")


# Where a knee shows: waiting for admission lifts TTFT (median, tail); a preempted request stalls for a whole
# recompute, which lifts the ITL tail and E2EL.
KNEE_METRICS = {"median_ttft_ms": "median TTFT", "p99_ttft_ms": "p99 TTFT", "median_e2el_ms": "median E2EL",
                "p99_itl_ms": "p99 ITL"}
WAITING_METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_e2el_ms")  # latencies a queue adds to


def sweep_knees(runs: Sequence[RunStats], th: Thresholds) -> list[tuple[int, str]]:
    """(level index, latency field) of every knee in every KNEE_METRICS series, by level, then KNEE_METRICS order."""
    levels = [r.concurrency or 0 for r in runs]
    series = {attr: [float(getattr(r, attr)) for r in runs] for attr in KNEE_METRICS}
    order = list(KNEE_METRICS)
    hits = [(i, attr) for attr, values in series.items() for i in knee_points(levels, values, th)]
    return sorted(hits, key=lambda h: (h[0], order.index(h[1])))


def _grew(r: RunStats, below: RunStats, th: Thresholds) -> bool:
    """Some latency of KNEE_METRICS at r rose to at least knee_min_growth × the level below."""
    return any(getattr(r, a) >= th.knee_min_growth * getattr(below, a) > 0 for a in KNEE_METRICS)


def analyze_sweep(runs: Sequence[RunStats], itl_ref: float | None, th: Thresholds) -> list[Finding]:
    """(c): linear growth = contention; a knee = capacity: KV memory when the server shows preemption or a full
    pool at that level, request slots when its queue time jumps without them."""
    ok = sorted((r for r in runs if r.completed and r.concurrency), key=lambda r: r.concurrency or 0)
    if len(ok) < 2:
        return [Finding(None, "fewer than two successful levels; no trend to judge", "c")]
    knees = sweep_knees(ok, th)
    # the first knee whose level shows KV evidence; else the first knee, read by queueing or left unexplained
    kv_knee = next(((i, a) for i, a in knees if kv_evidence(ok[i], th)), None)
    if kv_knee is not None or knees:
        i, attr = kv_knee or knees[0]
        knee = _knee_finding(ok, i, attr, th)
        if knee.kind is not None:
            return [knee]
        findings = [knee]
    else:
        first, last = ok[0], ok[-1]
        findings = [Finding(None, f"no knee: latency grows within its trend (contention) — median TTFT "
                            f"{_ms(first.median_ttft_ms)} → {_ms(last.median_ttft_ms)}, median E2EL "
                            f"{_ms(first.median_e2el_ms)} → {_ms(last.median_e2el_ms)}, p99 ITL "
                            f"{_ms(first.p99_itl_ms)} → {_ms(last.p99_itl_ms)} from c={first.concurrency} to "
                            f"c={last.concurrency}", "c")]
    # A server whose throughput saturated early grows linearly right through its KV limit (the waiting requests
    # just continue the line); the server's own evidence still says where memory ran out.
    kv = next(((i, e) for i in range(1, len(ok)) if (e := kv_evidence(ok[i], th)) and _grew(ok[i], ok[i - 1], th)),
              None)
    if kv is not None:
        i, e = kv
        findings.append(Finding(Verdict.KV_CAPACITY,
                                f"KV exhausted from concurrency {ok[i].concurrency} (last level without: "
                                f"{ok[i - 1].concurrency}): {e}, latency ≥ {th.knee_min_growth:g}× the level below;"
                                f" no sharper knee there (latency was already growing with load: compute saturated "
                                f"first); {_level_line(ok[i])}", "c", ok[i].concurrency))
    return findings + _top_level_findings(ok[-1], itl_ref, th)


def _knee_finding(ok: Sequence[RunStats], k: int, attr: str, th: Thresholds) -> Finding:
    """Read the knee at level index k (seen in `attr`) by the server's evidence at that level."""
    knee, below = ok[k], ok[k - 1]
    at = f"knee at concurrency {knee.concurrency} (last level within the trend: {below.concurrency})"
    jump = (f"{KNEE_METRICS[attr]} {_ms(getattr(below, attr))} → {_ms(getattr(knee, attr))} (> {th.knee_ratio:g}× "
            "the trend's rise)")
    evidence = kv_evidence(knee, th)
    if evidence is not None:
        return Finding(Verdict.KV_CAPACITY, f"{at}: {jump}; KV exhausted there: {evidence}; {_level_line(knee)}",
                       "c", knee.concurrency)
    queue_rise = (knee.server_queue_ms or 0.0) - (below.server_queue_ms or 0.0)
    latency_rise = getattr(knee, attr) - getattr(below, attr)
    if (attr in WAITING_METRICS and (knee.queue_share or 0.0) >= th.share
            and queue_rise >= th.share * latency_rise):
        return Finding(Verdict.QUEUEING, f"{at}: {jump}; queue time rose {_ms(queue_rise)} (queue share "
                       f"{_pct(knee.queue_share)}) without preemption or a full KV pool → request slots or "
                       f"scheduling, not memory; {_level_line(knee)}", "c", knee.concurrency)
    if not knee.has_server_metrics:
        return Finding(Verdict.KV_CAPACITY, f"{at}: {jump}; the server exports no /metrics, so preemption or "
                       "queueing is unconfirmed (a knee is the seeds' sign of KV capacity)", "c", knee.concurrency)
    return Finding(None, f"{at}: {jump}, but no preemption, full KV pool or queue-time jump at that level: compute "
                   f"contention or noise (e.g. prefills mixed into decode steps, for an ITL tail); "
                   f"{_level_line(knee)}", "c", knee.concurrency)


def _top_level_findings(r: RunStats, itl_ref: float | None, th: Thresholds) -> list[Finding]:
    """The seeds' TTFT/ITL table at the highest level of a sweep without a knee."""
    t_high, i_high = ttft_high(r.median_ttft_ms, itl_ref, th), itl_high(r, itl_ref, th)
    numbers = (f"at c={r.concurrency}: TTFT p50 {_ms(r.median_ttft_ms)} ({_ttft_rule(th, itl_ref)}), ITL p50 "
               f"{_ms(r.median_itl_ms)} / TPOT p50 {_ms(r.median_tpot_ms)} ({_itl_rule(th, itl_ref)}), queue share "
               f"{_pct(r.queue_share)}")
    if i_high:
        what = "both TTFT and ITL high, growing linearly → compute contention" if t_high else "ITL high, TTFT normal"
        return [Finding(Verdict.DECODE, f"{what} — {numbers}", "c")]
    if t_high and (r.queue_share or 0.0) >= th.share:
        return [Finding(Verdict.QUEUEING, f"TTFT high and mostly queue time, ITL normal — {numbers}", "c")]
    if t_high:
        return [Finding(Verdict.PREFILL, f"TTFT high and mostly prefill, ITL normal — {numbers}", "c")]
    return []


def decide(findings: Sequence[Finding]) -> tuple[Verdict, int | None]:
    """The primary verdict (first of PRIORITY found, else healthy) and the knee's concurrency when KV-bound."""
    for v in PRIORITY:
        hit = next((f for f in findings if f.kind == v), None)
        if hit is not None:
            return v, hit.knee_concurrency
    return Verdict.HEALTHY, None


def healthy_summary(a: Sequence[RunStats], b: Sequence[RunStats], c: Sequence[RunStats], itl_ref: float | None,
                    th: Thresholds) -> str:
    """The numbers behind a healthy verdict: the worst TTFT and ITL seen against their limits."""
    runs = [r for r in (*a, *b, *c) if r.completed]
    if not runs:
        return "no successful request: nothing was measured"
    worst_ttft = max(runs, key=lambda r: r.max_ttft_ms)
    worst_itl = max(runs, key=lambda r: r.median_itl_ms)
    pre = sum(r.preemptions or 0 for r in runs)
    sweep = "no knee with KV or queue evidence, " if c else ""
    return (f"worst TTFT {_ms(worst_ttft.max_ttft_ms)} ({worst_ttft.label}; {_ttft_rule(th, itl_ref)}), worst "
            f"median ITL {_ms(worst_itl.median_itl_ms)} ({worst_itl.label}; ITL_ref {_ms(itl_ref)}, "
            f"{_itl_rule(th, itl_ref)}), {sweep}{pre:.0f} preemptions")


def analyze(a: Sequence[RunStats], b: Sequence[RunStats], c: Sequence[RunStats],
            th: Thresholds) -> tuple[Verdict, int | None, list[Finding], float | None]:
    """(verdict, knee concurrency, findings, ITL_ref) from the experiments' numbers."""
    itl_ref = itl_reference(a, b, c)
    findings: list[Finding] = []
    if a:
        findings += analyze_shapes(a, itl_ref, th)
    if b:
        findings += analyze_output_lengths(b, itl_ref, th)
    if c:
        findings += analyze_sweep(c, itl_ref, th)
    failed = sum(r.failed for r in (*a, *b, *c))
    if failed:
        errs = sorted({e for r in (*a, *b, *c) for e in r.errors})
        findings.append(Finding(None, f"{failed} requests failed: {'; '.join(errs)[:300]}", ""))
    verdict, knee = decide(findings)
    if verdict == Verdict.HEALTHY:
        findings.append(Finding(None, "healthy: " + healthy_summary(a, b, c, itl_ref, th), ""))
    return verdict, knee, findings, itl_ref


# ---- running the experiments -----------------------------------------------------------------------------------
@dataclass
class DiagnoseResult:
    verdict: Verdict
    knee_concurrency: int | None
    findings: list[str]
    evidence: dict[str, Any]
    shapes: list[RunStats] = field(default_factory=list)  # (a)
    output_lengths: list[RunStats] = field(default_factory=list)  # (b)
    sweep: list[RunStats] = field(default_factory=list)  # (c)
    report_path: Path | None = None

    def verdict_lines(self) -> list[str]:
        head = f"Verdict: {self.verdict.value}"
        if self.knee_concurrency is not None:
            head += f" (knee at concurrency {self.knee_concurrency})"
        return [head, *(f"  - {f}" for f in self.findings)]


class _Session:
    """What every run shares: the target, the model, its tokenizer, and the seed stream."""

    def __init__(self, cfg: DiagnoseConfig, model: str, max_model_len: int | None, tokenizer: Any) -> None:
        self.cfg, self.model, self.max_model_len, self.tokenizer = cfg, model, max_model_len, tokenizer
        self.runs = 0

    def bench_config(self, concurrency: int | None, server_metrics: bool = True) -> BenchConfig:
        c = self.cfg
        return BenchConfig(base_url=c.base_url, endpoint=c.endpoint, model=self.model,
                           tokenizer=c.tokenizer or self.model, api_key=c.api_key, ignore_eos=True,
                           max_concurrency=concurrency, disable_tqdm=True, seed=c.seed,
                           request_timeout=c.request_timeout, server_metrics=server_metrics)

    def samples(self, n: int, prompt_len: int, output_len: int) -> list[Any]:
        """Fresh random prompts: every call uses its own seed, so no run hits another's prefix cache."""
        from pdserve.bench.datasets import random_dataset

        self.runs += 1
        seed = self.cfg.seed * 1000 + self.runs
        chat = self.cfg.endpoint != COMPLETIONS_ENDPOINT
        return random_dataset(self.tokenizer, n, prompt_len, output_len, 0.0, seed, token_ids=not chat)

    def fit(self, prompt_len: int, output_len: int) -> tuple[int, int]:
        """Clip (prompt, output) so prompt + output <= the server's max_model_len (prompt first kept)."""
        if self.max_model_len is None or prompt_len + output_len <= self.max_model_len:
            return prompt_len, output_len
        prompt_len = min(prompt_len, self.max_model_len - 2)
        return prompt_len, max(2, self.max_model_len - prompt_len)

    async def run(self, label: str, n: int, prompt_len: int, output_len: int, concurrency: int | None,
                  sample_gauges: bool = False) -> RunStats:
        from pdserve.bench.runner import run_benchmark

        print(f"pdserve diagnose: {label}: {n} requests, prompt {prompt_len}, output {output_len}, "
              f"concurrency {concurrency or 'all'}", file=sys.stderr, flush=True)
        samples = await asyncio.to_thread(self.samples, n, prompt_len, output_len)
        gauges: list[dict[str, float]] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(self._sample(stop, gauges)) if sample_gauges else None
        try:
            res = await run_benchmark(self.bench_config(concurrency), samples)
        finally:
            stop.set()
            if sampler is not None:
                await sampler
        return stats_from_result(res, label, prompt_len, output_len, concurrency, gauges if sampler else None,
                                 self.cfg.thresholds.kv_full)

    async def _sample(self, stop: asyncio.Event, gauges: list[dict[str, float]]) -> None:
        """Append one {gauge: value} sample of GAUGES every gauge_interval_s while the run lasts."""
        import httpx

        from pdserve.bench.server_metrics import scrape

        async with httpx.AsyncClient() as http:
            while not stop.is_set():
                s = await scrape(http, self.cfg.base_url)
                if s is not None and s.prefix:
                    gauges.append({g: v for g in GAUGES if (v := s.values.get(f"{s.prefix}:{g}")) is not None})
                try:
                    await asyncio.wait_for(stop.wait(), self.cfg.gauge_interval_s)
                except TimeoutError:
                    pass


async def _server_info(cfg: DiagnoseConfig) -> tuple[str, int | None]:
    """(model, max_model_len) from GET /v1/models."""
    import httpx

    from pdserve.bench.runner import discover_model

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    async with httpx.AsyncClient(headers=headers) as http:
        model = cfg.model or await discover_model(http, cfg.base_url)
        try:
            data = (await http.get(cfg.base_url + "/v1/models", timeout=30.0)).json().get("data") or []
            entry: dict[str, Any] = next((d for d in data if d.get("id") == model), {})
            max_len = entry.get("max_model_len")
        except (httpx.HTTPError, ValueError, AttributeError):
            max_len = None
    return model, int(max_len) if max_len else None


async def run_shapes(s: _Session) -> list[RunStats]:
    c = s.cfg
    piece_unit = c.scaled(c.shape_total_tokens // max(c.shape_pieces), 4)  # the smallest piece
    total = piece_unit * max(c.shape_pieces)
    out_len = c.scaled(c.shape_output_len, 4)
    total, out_len = s.fit(total, out_len)
    runs = []
    for k in c.shape_pieces:
        plen = total // k
        runs.append(await s.run(f"(a) {k}×{plen}", k, plen, out_len, None))
    return runs


async def run_output_lengths(s: _Session) -> list[RunStats]:
    c = s.cfg
    runs = []
    lengths = sorted(c.decode_output_lens)
    for i, n in enumerate([*lengths, lengths[0]] if len(lengths) > 1 else lengths):
        plen, olen = s.fit(c.scaled(c.decode_prompt_len, 8), c.scaled(n, 4))
        again = " again" if i == len(lengths) else ""  # the shortest, repeated last: a baseline against drift
        runs.append(await s.run(f"(b) output {olen}{again}", 1, plen, olen, 1))
    return runs


async def run_sweep(s: _Session) -> list[RunStats]:
    c = s.cfg
    # >= 16 output tokens: the median ITL must be a decode step, not the few steps that mix in others' prefills
    plen, olen = s.fit(c.scaled(c.sweep_prompt_len, 8), c.scaled(c.sweep_output_len, 16))
    runs = []
    for level in c.concurrency_levels:
        n = max(1, round(c.requests_per_level * level))
        runs.append(await s.run(f"(c) concurrency {level}", n, plen, olen, level, sample_gauges=True))
    return runs


async def diagnose(cfg: DiagnoseConfig) -> DiagnoseResult:
    """Run cfg.experiments against cfg.base_url, judge them, and write the report (when cfg.out_dir is set or
    by default to ./diagnose-<date>)."""
    from pdserve.bench.runner import load_bench_tokenizer

    model, max_len = await _server_info(cfg)
    tokenizer = await asyncio.to_thread(load_bench_tokenizer, cfg.tokenizer or model)
    s = _Session(cfg, model, max_len, tokenizer)
    t0 = time.perf_counter()
    warm = await asyncio.to_thread(s.samples, 1, 8, 2)  # first-request costs (allocations) out of the numbers
    from pdserve.bench.runner import run_benchmark

    await run_benchmark(s.bench_config(None, server_metrics=False), warm)
    a = await run_shapes(s) if "a" in cfg.experiments else []
    b = await run_output_lengths(s) if "b" in cfg.experiments else []
    c = await run_sweep(s) if "c" in cfg.experiments else []
    th = cfg.thresholds
    verdict, knee, findings, itl_ref = analyze(a, b, c, th)
    evidence = {
        "model": model, "base_url": cfg.base_url, "max_model_len": max_len, "scale": cfg.scale,
        "duration_s": time.perf_counter() - t0, "date": datetime.now().isoformat(timespec="seconds"),
        "itl_ref_ms": itl_ref, "ttft_limit_ms": ttft_limit_ms(itl_ref, th), "thresholds": dataclasses.asdict(th),
        "findings": [{"kind": f.kind.value if f.kind else None, "experiment": f.experiment, "text": f.text,
                      "knee_concurrency": f.knee_concurrency} for f in findings],
        "a": [dataclasses.asdict(r) for r in a], "b": [dataclasses.asdict(r) for r in b],
        "c": [dataclasses.asdict(r) for r in c],
    }
    result = DiagnoseResult(verdict, knee, [str(f) for f in findings], evidence, a, b, c)
    out = Path(cfg.out_dir or f"diagnose-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    result.report_path = await asyncio.to_thread(write_report, result, out)
    return result


# ---- report ------------------------------------------------------------------------------------------------------
def _plot_shapes(runs: Sequence[RunStats], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    x = list(range(len(runs)))
    queue = [r.server_queue_ms or 0.0 for r in runs]
    prefill = [r.server_prefill_ms or 0.0 for r in runs]
    ax.bar(x, queue, width=0.35, color="#bbbbbb", label="server queue (mean)")
    ax.bar(x, prefill, width=0.35, bottom=queue, color="#f28e2b", label="server prefill (mean)")
    ax.plot([i + 0.3 for i in x], [r.mean_ttft_ms for r in runs], "o", color="#4e79a7", label="client TTFT mean")
    ax.plot([i + 0.3 for i in x], [r.max_ttft_ms for r in runs], "^", color="#e15759", label="client TTFT max")
    ax.set_xticks(x, [r.label.removeprefix("(a) ") for r in runs])
    ax.set(title="(a) same total prompt tokens, different shapes", ylabel="ms")
    ax.legend(fontsize="small")
    return _save(fig, path)


def _plot_output_lengths(runs: Sequence[RunStats], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    runs = sorted(runs, key=lambda r: r.output_len)  # the repeated shortest output sits next to the first
    x = [r.output_len for r in runs]
    ax.plot(x, [r.median_tpot_ms for r in runs], "o-", label="TPOT (median)")
    ax.plot(x, [r.median_itl_ms for r in runs], "s--", label="ITL (median)")
    ax.plot(x, [r.p99_itl_ms for r in runs], "^:", label="ITL (p99)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(x)), [str(v) for v in sorted(set(x))])
    ax.set_ylim(bottom=0)
    ax.set(title="(b) single stream: decode pace vs output length", xlabel="output tokens", ylabel="ms")
    ax.legend(fontsize="small")
    return _save(fig, path)


def _plot_sweep(runs: Sequence[RunStats], knee: dict[str, Any] | None, path: Path) -> Path:
    """`knee`: the knee finding (evidence form); red when it has a verdict, grey when it is an unexplained jump."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = [r.concurrency or 0 for r in runs]
    for attr, style, label in (("median_ttft_ms", "o-", "TTFT p50"), ("p99_ttft_ms", "o:", "TTFT p99"),
                               ("median_e2el_ms", "s-", "E2EL p50"), ("median_itl_ms", "^-", "ITL p50"),
                               ("p99_itl_ms", "^:", "ITL p99")):
        ax1.plot(x, [getattr(r, attr) for r in runs], style, label=label)
    ax2.plot(x, [r.output_throughput for r in runs], "o-", color="#59a14f", label="output tok/s")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(v) for v in x])
        if knee is not None:
            c, kind = knee["knee_concurrency"], knee["kind"]
            ax.axvline(c, color="#e15759" if kind else "#999999", linestyle="--",
                       label=f"knee (c={c}): {kind}" if kind else f"jump (c={c}), unexplained")
        ax.set_xlabel("concurrency")
        ax.legend(fontsize="small")
    ax1.set_yscale("log")
    ax1.set(title="(c) latency vs concurrency", ylabel="ms")
    ax2.set(title="(c) throughput vs concurrency", ylabel="output tokens/s")
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "n/a"
        if isinstance(v, float):
            return f"{v:.1f}" if math.isfinite(v) else str(v)
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _kv(v: float | None) -> float | None:
    return None if v is None else 100 * v


def report_markdown(res: DiagnoseResult, plots: dict[str, str]) -> str:
    ev = res.evidence
    lines = [f"# pdserve diagnose: {ev.get('model')}", "",
             f"Server {ev.get('base_url')}, max_model_len {ev.get('max_model_len')}, scale {ev.get('scale')}, "
             f"{ev.get('date')}, {ev.get('duration_s', 0):.0f} s. ITL_ref (unloaded decode step) "
             f"{_ms(ev.get('itl_ref_ms'))}; TTFT counts as high above {_ms(ev.get('ttft_limit_ms'))}.", "",
             f"Verdict: **{res.verdict.value}** (its evidence is at the end).", ""]
    if res.shapes:
        lines += ["## (a) Same total prompt tokens: 1 long, 2 medium, 4 short", "",
                  _table(["shape", "ok/failed", "TTFT mean", "TTFT max", "server queue", "server prefill",
                          "prefill share %", "ITL p50", "out tok/s"],
                         [[r.label.removeprefix("(a) "), f"{r.completed}/{r.failed}", r.mean_ttft_ms, r.max_ttft_ms,
                           r.server_queue_ms, r.server_prefill_ms, _kv(r.prefill_share), r.median_itl_ms,
                           r.output_throughput] for r in res.shapes]), "", f"![TTFT per shape]({plots['a']})", ""]
    if res.output_lengths:
        lines += ["## (b) Output length, one stream", "",
                  _table(["output tokens", "ok/failed", "TTFT", "TPOT p50", "ITL p50", "ITL p99", "E2EL",
                          "out tok/s"],
                         [[r.label.removeprefix("(b) output "), f"{r.completed}/{r.failed}", r.median_ttft_ms,
                           r.median_tpot_ms,
                           r.median_itl_ms, r.p99_itl_ms, r.median_e2el_ms, r.output_throughput]
                          for r in res.output_lengths]), "", f"![TPOT vs output length]({plots['b']})", ""]
    if res.sweep:
        r0 = res.sweep[0]
        lines += [f"## (c) Concurrency sweep (prompt {r0.prompt_len}, output {r0.output_len})", "",
                  _table(["concurrency", "requests", "ok/failed", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
                          "E2EL p50", "out tok/s", "queue mean", "preemptions", "KV peak %", "waiting peak"],
                         [[r.concurrency, r.num_requests, f"{r.completed}/{r.failed}", r.median_ttft_ms,
                           r.p99_ttft_ms, r.median_itl_ms, r.p99_itl_ms, r.median_e2el_ms, r.output_throughput,
                           r.server_queue_ms, r.preemptions, _kv(r.kv_usage_peak), r.waiting_peak]
                          for r in res.sweep]), "",
                  f"Knee: {_knee_text(res)}.",
                  "", f"![latency and throughput vs concurrency]({plots['c']})", ""]
    lines += ["## Verdict", "", f"**{res.verdict.value}**"
              + (f" — knee at concurrency {res.knee_concurrency}" if res.knee_concurrency is not None else ""), ""]
    lines += [f"- {f}" for f in res.findings]
    lines += ["", "Thresholds: " + ", ".join(f"{k}={v}" for k, v in ev.get("thresholds", {}).items()), ""]
    return "\n".join(lines)


def _knee(res: DiagnoseResult) -> dict[str, Any] | None:
    """The sweep's knee finding (evidence form), if any."""
    return next((f for f in res.evidence.get("findings", []) if f.get("knee_concurrency")), None)


def _knee_text(res: DiagnoseResult) -> str:
    k = _knee(res)
    if k is None:
        return "none (latency grows within its trend)"
    return f"concurrency {k['knee_concurrency']}, read as {k['kind'] or 'unexplained (no verdict)'}"


def write_report(res: DiagnoseResult, out_dir: Path) -> Path:
    """report.md, its PNGs and diagnose.json (every number) in out_dir; returns the report's path."""
    import matplotlib

    matplotlib.use("Agg")
    out_dir.mkdir(parents=True, exist_ok=True)
    plots: dict[str, str] = {}
    if res.shapes:
        plots["a"] = _plot_shapes(res.shapes, out_dir / "a_prompt_shapes.png").name
    if res.output_lengths:
        plots["b"] = _plot_output_lengths(res.output_lengths, out_dir / "b_output_length.png").name
    if res.sweep:
        plots["c"] = _plot_sweep(res.sweep, _knee(res), out_dir / "c_concurrency.png").name
    (out_dir / "diagnose.json").write_text(
        json.dumps({"verdict": res.verdict.value, "knee_concurrency": res.knee_concurrency,
                    "findings": res.findings, "evidence": res.evidence}, ensure_ascii=False, indent=2),
        encoding="utf-8")
    path = out_dir / "report.md"
    path.write_text(report_markdown(res, plots), encoding="utf-8")
    return path


# ---- command line ------------------------------------------------------------------------------------------------
DESCRIPTION = """Run the seeds' experiments against a running server — (a) the same prompt tokens as 1/2/4 prompts,
(b) output length 128/512/2048, (c) a concurrency sweep with knee detection — and write a Markdown report with
plots ending in a verdict: prefill-bound, decode-bound, kv-capacity-bound, queueing, or healthy."""


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_diagnose_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("diagnose", help="find what limits a running server (prefill, decode, KV, queue)",
                              description=DESCRIPTION)
    d = DiagnoseConfig()
    p.add_argument("--base-url", default=d.base_url)
    p.add_argument("--endpoint", default=d.endpoint, choices=["/v1/completions", "/v1/chat/completions"],
                   help="completions sends token ids (exact lengths); chat sends random text")
    p.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    p.add_argument("--tokenizer", default=None, help="for the random prompts (default: the served model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--scale", type=float, default=d.scale,
                   help="multiply every prompt/output length (e.g. 0.25 on a small CPU machine)")
    p.add_argument("--experiments", type=_names, default=d.experiments, help="subset of a,b,c (default: all)")
    p.add_argument("--concurrency-levels", type=_ints, default=d.concurrency_levels,
                   help="sweep levels, e.g. 1,2,4,8 (default 1,2,4,8,16,32)")
    p.add_argument("--out", dest="out_dir", default=None, help="report directory (default ./diagnose-<date>)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT above this is high")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT above this is high")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout)
    p.set_defaults(func=run_diagnose_cli)
    return p


def config_from_args(args: argparse.Namespace) -> DiagnoseConfig:
    names = {f.name for f in dataclasses.fields(DiagnoseConfig)}
    return DiagnoseConfig(**{k: v for k, v in vars(args).items() if k in names})


def run_diagnose_cli(args: argparse.Namespace) -> int:
    """0 with a verdict, 2 when the diagnosis could not run."""
    from pdserve.bench.datasets import DatasetError

    try:
        result = asyncio.run(diagnose(config_from_args(args)))
    except (BenchError, DatasetError) as e:
        print(f"pdserve diagnose: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(result.verdict_lines()))
    print(f"report: {result.report_path}", flush=True)
    return 0

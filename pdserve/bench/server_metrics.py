"""The server's own view of a run: /metrics scraped before and after, reduced to deltas.

Works for pdserve (`pdserve:` prefix) and vLLM (`vllm:`), which share metric names. Deltas count every request the
server finished in between, the benchmark's and anyone else's; run against an otherwise idle server. Percentiles
are estimated from histogram buckets by linear interpolation, as Prometheus' histogram_quantile does.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

PREFIXES = ("pdserve", "vllm")
PHASES = {"queue": "request_queue_time_seconds", "prefill": "request_prefill_time_seconds",
          "ttft": "time_to_first_token_seconds", "decode": "request_decode_time_seconds"}


@dataclass
class Scrape:
    """One /metrics read: every sample summed over labels other than `le`, and histogram buckets by `le`."""

    values: dict[str, float]
    buckets: dict[str, dict[float, float]]  # histogram name -> {le: cumulative count}

    @property
    def prefix(self) -> str | None:
        for p in PREFIXES:
            if any(k.startswith(p + ":") for k in self.values):
                return p
        return None


def parse_metrics(text: str) -> Scrape:
    values: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            if s.name.endswith("_bucket") and "le" in s.labels:
                b = buckets.setdefault(s.name[:-len("_bucket")], {})
                le = float(s.labels["le"])
                b[le] = b.get(le, 0.0) + s.value
            else:
                values[s.name] = values.get(s.name, 0.0) + s.value
    return Scrape(values, buckets)


async def scrape(http: httpx.AsyncClient, base_url: str) -> Scrape | None:
    """The server's /metrics, or None when it has none (not every OpenAI-compatible server exports them)."""
    try:
        resp = await http.get(base_url + "/metrics", timeout=10.0)
        if resp.status_code != 200:
            return None
        s = parse_metrics(resp.text)
    except (httpx.HTTPError, ValueError):
        return None
    return s if s.prefix else None


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The q-quantile (0..1) of a cumulative bucket histogram; None when it holds no observation."""
    les = sorted(buckets)
    if not les or buckets[les[-1]] <= 0:
        return None
    total = buckets[les[-1]]
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le in les:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return prev_le  # beyond the last finite bound: the bound is the best estimate
            width = count - prev_count
            return le if width <= 0 else prev_le + (le - prev_le) * (rank - prev_count) / width
        prev_le, prev_count = le, count
    return prev_le


@dataclass
class PhaseStats:
    """One server histogram over the run (ms). Percentiles are bucket estimates."""

    count: float
    mean_ms: float | None  # None when no request finished this phase
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None


@dataclass
class ServerStats:
    prefix: str
    num_requests: float  # request_success_total delta (all finish reasons)
    prompt_tokens: float
    generation_tokens: float
    num_errors: float | None  # request_errors_total delta (pdserve only)
    preemptions: float | None
    prefix_cache_hit_rate: float | None  # hits / queries over the run
    phases: dict[str, PhaseStats]  # queue, prefill, ttft, decode
    # speculative decoding: 1 + accepted drafts / speculating decode rows over the run (vLLM's mean acceptance
    # length); None when the server exposes no spec_decode counters or drafted nothing
    spec_mean_acceptance_length: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _delta(before: Scrape, after: Scrape, name: str) -> float | None:
    if name not in after.values:
        return None
    return after.values[name] - before.values.get(name, 0.0)


def _phase(before: Scrape, after: Scrape, base: str) -> PhaseStats | None:
    count, total = _delta(before, after, base + "_count"), _delta(before, after, base + "_sum")
    if count is None or total is None:
        return None
    b0, b1 = before.buckets.get(base, {}), after.buckets.get(base, {})
    diff = {le: c - b0.get(le, 0.0) for le, c in b1.items()}

    def q(p: float) -> float | None:
        v = histogram_quantile(p, diff)
        return None if v is None else v * 1000

    return PhaseStats(count, total / count * 1000 if count else None, q(0.5), q(0.9), q(0.99))


def server_deltas(before: Scrape | None, after: Scrape | None) -> ServerStats | None:
    if before is None or after is None or after.prefix is None:
        return None
    p = after.prefix

    def d(name: str) -> float | None:
        return _delta(before, after, f"{p}:{name}")

    queries, hits = d("prefix_cache_queries_total"), d("prefix_cache_hits_total")
    phases = {k: s for k, name in PHASES.items() if (s := _phase(before, after, f"{p}:{name}")) is not None}
    drafts, accepted = d("spec_decode_num_drafts_total"), d("spec_decode_num_accepted_tokens_total")
    return ServerStats(
        spec_mean_acceptance_length=1 + accepted / drafts if drafts and accepted is not None else None,
        prefix=p, num_requests=d("request_success_total") or 0.0, prompt_tokens=d("prompt_tokens_total") or 0.0,
        generation_tokens=d("generation_tokens_total") or 0.0, num_errors=d("request_errors_total"),
        preemptions=d("num_preemptions_total"),
        prefix_cache_hit_rate=(hits / queries) if queries and hits is not None else None, phases=phases)

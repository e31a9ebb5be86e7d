"""The router's Prometheus metrics and the per-request trace that feeds them and the request log."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.router.prefix import PrefixQuery

request_log = logging.getLogger("pdserve.requests")

_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
            40.0, 80.0)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pdserve:router_requests", "Routed requests by outcome.", ["outcome"], registry=r)
        self.ttft = Histogram("pdserve:router_time_to_first_token_seconds",
                              "Client-seen TTFT: arrival at the router -> first token relayed (prefill + KV "
                              "hand-off + first decode step).", buckets=_LATENCY, registry=r)
        self.prefill = Histogram("pdserve:router_prefill_seconds", "Prefill request time (incl. queueing there).",
                                 buckets=_LATENCY, registry=r)
        self.e2e = Histogram("pdserve:router_e2e_request_latency_seconds", "Arrival -> last byte relayed.",
                             buckets=_LATENCY, registry=r)
        self.retries = Counter("pdserve:router_retries", "Requests sent again to another instance.", ["stage"],
                               registry=r)
        self.recomputes = Counter("pdserve:router_recomputes", "Requests a decode instance computed from the prompt "
                                  "(no usable prefill hand-off).", registry=r)
        self.up = Gauge("pdserve:router_instance_up", "Instance health as seen by the router's polls.",
                        ["role", "url"], registry=r)
        self.errors = Counter("pdserve:router_request_errors", "Requests the router refused itself, by kind "
                              "(bad_request, payload_too_large, ...).", ["kind"], registry=r)
        self.load = Gauge("pdserve:router_instance_load", "Instance load: running + waiting requests.",
                          ["role", "url"], registry=r)
        self.routing = Counter("pdserve:router_routing_decisions", "Instances chosen, by pool and reason: prefix "
                               "(holds the prompt's leading blocks, router/prefix.py), load (holds none of them, but "
                               "those that do are busier by more than their hit is worth), no_match (none does: least "
                               "loaded), no_prefix (prefix routing off or the prompt not tokenized: least loaded), "
                               "retry.", ["pool", "reason"], registry=r)
        self.prefix_hit_tokens = Counter("pdserve:router_expected_prefix_hit_tokens", "Prompt tokens the chosen "
                                         "instances were expected to hold (published or routed there).", ["pool"],
                                         registry=r)
        for o in ("ok", "error", "client_disconnect"):
            self.requests.labels(o)
        for s in ("prefill", "decode"):
            self.retries.labels(s)

    def error(self, kind: str) -> None:
        """Count a refused request (the server's error middleware and handlers call this)."""
        self.errors.labels(kind).inc()


@dataclass
class RouteTrace:
    """What one routed request did, for the request log line and the metrics."""

    request_id: str
    path: str
    stream: bool
    t0: float = field(default_factory=time.perf_counter)
    prefill_url: str | None = None
    prefill_engine_id: str | None = None
    prefill_s: float | None = None
    decode_url: str | None = None
    decode_attempts: int = 0
    recomputed: bool = False
    ttft_s: float | None = None
    outcome: str = "ok"  # ok | error | client_disconnect
    error: str | None = None
    headers: dict[str, str] = field(default_factory=dict)  # forwarded upstream (API key, tenant)
    prefix: PrefixQuery | None = None  # the prompt's tokens for prefix routing (None: routed by load)
    route: str | None = None  # why the last instance was chosen (Pool.choose's reason)
    prefix_hit_tokens: int = 0  # the prompt tokens it was expected to hold

    def routed(self, pool: str, reason: str, hit_tokens: int, metrics: RouterMetrics) -> None:
        """Count an instance choice in `pool` (pool.Pool.choose's reason, expected hit) and note it for the log."""
        self.route, self.prefix_hit_tokens = reason, hit_tokens
        metrics.routing.labels(pool, reason).inc()
        metrics.prefix_hit_tokens.labels(pool).inc(hit_tokens)

    def finish(self, metrics: RouterMetrics) -> None:
        """Count the request and write its log line; called once, when the request ends in any way."""
        e2e = time.perf_counter() - self.t0
        metrics.requests.labels(self.outcome).inc()
        metrics.e2e.observe(e2e)
        if self.ttft_s is not None and not self.stream:  # streams observe TTFT when the first token goes out
            metrics.ttft.observe(self.ttft_s)
        rec = {"request_id": self.request_id, "router": True, "path": self.path, "stream": self.stream,
               "prefill_url": self.prefill_url, "prefill_engine_id": self.prefill_engine_id,
               "prefill_s": self.prefill_s, "decode_url": self.decode_url, "decode_attempts": self.decode_attempts,
               "recomputed": self.recomputed, "route": self.route, "prefix_hit_tokens": self.prefix_hit_tokens,
               "ttft_s": self.ttft_s, "e2e_s": e2e,
               "outcome": self.outcome, "error": self.error}
        request_log.info(json.dumps(rec, ensure_ascii=False))

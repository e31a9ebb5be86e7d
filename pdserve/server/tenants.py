"""Per-tenant metrics: requests, errors, TTFT, TPOT, queue time and tokens labelled by model and tenant.

The tenant is the `X-Tenant` header, else the body's `user`, else `none`. Label cardinality is bounded: the first
`limit` distinct tenants get their own label, every later one is counted as `other` (so a client that invents a
tenant per request cannot grow /metrics without bound)."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram

from pdserve.outputs import RequestOutput
from pdserve.server.metrics import ITL_BUCKETS, LATENCY_BUCKETS

OTHER = "other"
NO_TENANT = "none"


class TenantMetrics:
    def __init__(self, limit: int = 16, registry: CollectorRegistry | None = None) -> None:
        self.limit = limit
        self.registry = registry or CollectorRegistry()
        self._known: set[str] = set()
        self._lock = threading.Lock()  # tenants are labelled from the event loop and from engine threads
        r, lbl = self.registry, ["model", "tenant"]
        self.requests = Counter("pdserve:tenant_requests", "Requests by model, tenant and status: the finish "
                                "reason (stop, length, abort, error) of an engine request, or the HTTP status of "
                                "an API request refused before it ran.", [*lbl, "status"], registry=r)
        self.ttft = Histogram("pdserve:tenant_time_to_first_token_seconds", "Arrival to first token, by tenant.",
                              lbl, buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve:tenant_time_per_output_token_seconds", "Per request: (E2E - TTFT) / (output "
                              "tokens - 1), by tenant.", lbl, buckets=ITL_BUCKETS, registry=r)
        self.queue = Histogram("pdserve:tenant_queue_time_seconds", "Arrival to first scheduled, by tenant.", lbl,
                               buckets=LATENCY_BUCKETS, registry=r)
        self.gen_tokens = Counter("pdserve:tenant_generation_tokens", "Generated tokens, by tenant.", lbl,
                                  registry=r)

    def label(self, tenant: str | None) -> str:
        """The tenant's label: itself while fewer than `limit` tenants are known, else `other`."""
        if not tenant:
            return NO_TENANT
        with self._lock:
            if tenant in self._known:
                return tenant
            if len(self._known) < self.limit and tenant not in (OTHER, NO_TENANT):
                self._known.add(tenant)
                return tenant
        return OTHER

    def observe_finished(self, model: str, tenant: str | None, out: RequestOutput) -> None:
        """An engine request finished (any way: aborts and errors included): its final output."""
        t, lbl = out.metrics, (model, self.label(tenant))
        self.requests.labels(*lbl, out.outputs[0].finish_reason or "error").inc()
        self.gen_tokens.labels(*lbl).inc(len(out.outputs[0].token_ids))
        for hist, value in ((self.ttft, t.ttft), (self.tpot, t.tpot), (self.queue, t.queue_time)):
            if value is not None:
                hist.labels(*lbl).observe(value)

    def observe_refused(self, model: str, tenant: str | None, status: int) -> None:
        """An API request answered with an error before any engine request ran (400, 404, 429, 503, ...)."""
        self.requests.labels(model, self.label(tenant), str(status)).inc()

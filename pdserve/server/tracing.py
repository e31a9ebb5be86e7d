"""OpenTelemetry traces (optional extra `pdserve[otel]`, `--otlp-traces-endpoint`): one span per finished engine
request, `llm_request`, with child spans `queue`, `kv_transfer` (PD decode role: the prompt's KV pull), `prefill`
(an event per chunk) and `decode`, built after the fact from the timestamps the engine keeps (RequestTimes), so
tracing adds no work to the engine's step. An incoming W3C `traceparent` makes the request span its child (the PD
router sends one to both instances, so prefill and decode land in one trace).

Span names and attributes follow vLLM's (`gen_ai.*`). Timestamps are perf_counter seconds, shifted to epoch ns by an
offset taken once at start.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from pdserve.outputs import RequestOutput

TRACE_HEADERS = ("traceparent", "tracestate")


def trace_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The W3C trace-context headers of an incoming request, if any."""
    found = {k: headers[k] for k in TRACE_HEADERS if k in headers}
    return found or None


class RequestTracer:
    """Turns finished requests into spans. `exporter`: an OpenTelemetry SpanExporter (tests: InMemorySpanExporter,
    exported at once); else OTLP over HTTP to `endpoint`, batched."""

    def __init__(self, endpoint: str | None, service_name: str = "pdserve", exporter: Any = None) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise ValueError("--otlp-traces-endpoint needs OpenTelemetry: pip install 'pdserve[otel]'") from e
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        else:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("pdserve")
        self.propagator = TraceContextTextMapPropagator()
        self._offset_ns = time.time_ns() - time.perf_counter_ns()

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self._offset_ns

    def record(self, out: RequestOutput, headers: Mapping[str, str] | None, attributes: Mapping[str, Any]) -> None:
        """One finished request (its final output) as a span tree (call once, when it finished)."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        t = out.metrics
        end = t.finished if t.finished is not None else time.perf_counter()
        parent = self.propagator.extract(carrier=dict(headers)) if headers else None
        span = self.tracer.start_span("llm_request", context=parent, kind=SpanKind.SERVER,
                                      start_time=self._ns(t.arrival), attributes=dict(attributes))
        ctx = trace.set_span_in_context(span)
        sched = t.first_scheduled
        self._child("queue", ctx, t.arrival, sched if sched is not None else end)
        res = out.kv_transfer_result or {}
        if sched is not None and res and not res.get("do_remote_prefill"):  # PD decode role: the pull began here
            kv_attrs = {k: res[k] for k in ("bytes", "ok", "remote_engine_id") if res.get(k) is not None}
            self._child("kv_transfer", ctx, sched, sched + float(res.get("seconds") or 0.0), kv_attrs)
        if sched is not None:
            events = [("prefill_chunk", {"tokens": n}, self._ns(at)) for at, n in t.prefill_chunks]
            self._child("prefill", ctx, sched, t.first_token if t.first_token is not None else end, {}, events)
        if t.first_token is not None:
            self._child("decode", ctx, t.first_token, end, {"tokens": max(len(t.token_times) - 1, 0)})
        if out.error is not None:
            span.set_status(Status(StatusCode.ERROR, out.error))
        span.end(end_time=self._ns(end))

    def _child(self, name: str, ctx: Any, start: float, end: float, attributes: Mapping[str, Any] | None = None,
               events: list[tuple[str, dict[str, Any], int]] | None = None) -> None:
        span = self.tracer.start_span(name, context=ctx, start_time=self._ns(start), attributes=dict(attributes or {}))
        for name_, attrs, at in events or []:
            span.add_event(name_, attrs, timestamp=at)
        span.end(end_time=self._ns(max(end, start)))

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes the batch exporter

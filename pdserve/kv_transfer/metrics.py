"""Prometheus metrics of KV hand-offs (on the server's registry, `pdserve:` prefix, label `model_name`).

    kv_transfer_bytes_total            counter    bytes pulled into this (decode) instance
    kv_transfer_seconds                histogram  one pull per request: request sent -> blocks in the local cache
    kv_transfer_total{result}          counter    pulls by result: ok | failed
    kv_transfer_failures_total         counter    failed pulls (the request was recomputed or failed, per policy)
    kv_pinned_blocks                   gauge      prefill side: blocks held for decode instances to pull
    kv_pinned_requests                 gauge      prefill side: requests whose blocks are pinned
    kv_pin_timeouts_total              counter    prefill side: pins nobody claimed in time (blocks freed)
    kv_requests_loading                gauge      decode side: requests waiting for their KV (WAITING_FOR_REMOTE_KVS)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.kv_transfer.base import FinishedLoad

_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.0, 30.0)


class LoadRecorder(Protocol):
    """Where pulls are also recorded for windowed statistics (the server's LiveStats)."""

    def record_kv_load(self, ok: bool, seconds: float, nbytes: int) -> None: ...


class KVState(Protocol):
    """The published KV-transfer counts the gauges read (the engine client's KVSnapshot)."""

    @property
    def num_pinned_blocks(self) -> int: ...

    @property
    def num_pinned_requests(self) -> int: ...

    @property
    def num_requests_loading_kv(self) -> int: ...


class KVTransferMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, kv: Callable[[], KVState],
                 live: LoadRecorder | None = None) -> None:
        """`kv`: the engine's latest published KV state (EngineClient.kv_snapshot); the engine reports pulls and
        pin timeouts to `observe_load` and `pin_timeouts.inc` (EngineClient.observe_kv_transfer)."""
        lbl, m = ["model_name"], model_name
        self.bytes = Counter("pdserve:kv_transfer_bytes", "KV bytes pulled into this instance.", lbl,
                             registry=registry).labels(m)
        self.seconds = Histogram("pdserve:kv_transfer_seconds", "Time of one request's KV pull.", lbl,
                                 buckets=_SECONDS, registry=registry).labels(m)
        self.transfers = Counter("pdserve:kv_transfer", "KV pulls by result.", ["model_name", "result"],
                                 registry=registry)
        self.failures = Counter("pdserve:kv_transfer_failures", "Failed KV pulls.", lbl, registry=registry).labels(m)
        self.pin_timeouts = Counter("pdserve:kv_pin_timeouts", "Pinned KV blocks freed unclaimed after the timeout.",
                                    lbl, registry=registry).labels(m)
        Gauge("pdserve:kv_pinned_blocks", "KV blocks pinned for decode instances to pull.", lbl,
              registry=registry).labels(m).set_function(lambda: kv().num_pinned_blocks)
        Gauge("pdserve:kv_pinned_requests", "Requests whose KV blocks are pinned.", lbl,
              registry=registry).labels(m).set_function(lambda: kv().num_pinned_requests)
        Gauge("pdserve:kv_requests_loading", "Requests waiting for their KV to be pulled.", lbl,
              registry=registry).labels(m).set_function(lambda: kv().num_requests_loading_kv)
        for result in ("ok", "failed"):
            self.transfers.labels(m, result)
        self.model_name, self.live = m, live

    def observe_load(self, res: FinishedLoad) -> None:
        self.transfers.labels(self.model_name, "ok" if res.ok else "failed").inc()
        if self.live is not None:
            self.live.record_kv_load(res.ok, res.seconds, res.num_bytes if res.ok else 0)
        if res.ok:
            self.bytes.inc(res.num_bytes)
            self.seconds.observe(res.seconds)
        else:
            self.failures.inc()

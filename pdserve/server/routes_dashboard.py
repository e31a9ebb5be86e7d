"""The server's `GET /v1/stats`: windowed JSON from LiveStats per loaded model (under /v1, so behind `--api-key`).
The page that reads it (`GET /dashboard`) is api/dashboard_page.py, shared with the PD router, whose own /v1/stats
(router/stats.py) puts its instances side by side in the same shape.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from pdserve.api.dashboard_page import WindowQuery, stats_envelope
from pdserve.engine.client import EngineClient
from pdserve.server.metrics import Metrics
from pdserve.server.model_registry import ModelRegistry

stats_router = APIRouter()


@stats_router.get("/v1/stats")
async def stats(raw: Request, window: float = WindowQuery) -> dict[str, Any]:
    """Per loaded model: rates and percentiles over the last `window` seconds, the live roofline per step kind, KV
    and prefix-cache figures, and the bottleneck verdict with the numbers behind it. Models that are not loaded
    (sleeping, loading, failed) have no engine to read: `models_not_loaded` names them with their state."""
    registry: ModelRegistry = raw.app.state.registry
    models: dict[str, Any] = {}
    role = "both"
    for served in registry.models():
        client, metrics = served.client, served.metrics
        if client is None or metrics is None:  # changed state since listed: skip, the next poll shows it
            continue
        models[served.name] = model_block(served.version, metrics, client, window)
        role = client.model_info.kv_role
    not_loaded = {m.name: {"state": m.state, "version": m.version} for m in registry.models()
                  if m.name not in models}
    return {**stats_envelope("server" if role == "both" else role, window), "models": models,
            "models_not_loaded": not_loaded}


def model_block(version: str | None, metrics: Metrics, client: EngineClient, window: float) -> dict[str, Any]:
    """One loaded model's /v1/stats block: LiveStats' snapshot plus the engine thread's last published KV state."""
    block = dict(metrics.live.cached_snapshot(window))  # shallow copy: the cached snapshot is shared
    kv = client.kv_snapshot
    block["kv_cache"] = {**block["kv_cache"], "num_blocks": kv.num_blocks, "used_blocks": kv.num_used_blocks,
                         "cached_blocks": kv.num_cached_blocks}
    block["kv_transfer"] = {**block["kv_transfer"], "pinned_blocks": kv.num_pinned_blocks,
                            "requests_loading": kv.num_requests_loading_kv}
    block["open_requests"] = client.num_unfinished
    block["version"] = version
    return block

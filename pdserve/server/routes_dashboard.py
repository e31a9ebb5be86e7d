"""The live dashboard's routes: `GET /dashboard` (static page shipped in the package, served without the API key:
it holds no data) and `GET /v1/stats` (windowed JSON from LiveStats; under /v1, so behind `--api-key`).

`page_router` is shared with the PD router, whose own /v1/stats (disagg/router_stats.py) puts its instances side by
side in the same shape the page reads.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from pdserve.engine.client import EngineClient
from pdserve.server.errors import APIError
from pdserve.server.metrics import Metrics
from pdserve.server.model_registry import ModelRegistry
from pdserve.server.stats import DEFAULT_WINDOW_S, MAX_WINDOW_S

ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css", "index.html": "text/html"}

page_router = APIRouter()
stats_router = APIRouter()


def asset(name: str) -> bytes:
    """A file of the dashboard package data (pdserve/server/dashboard/)."""
    return (resources.files("pdserve.server") / "dashboard" / name).read_bytes()


@page_router.get("/dashboard")
async def dashboard() -> Response:
    return Response(asset("index.html"), media_type="text/html; charset=utf-8",
                    headers={"Cache-Control": "no-cache"})


@page_router.get("/dashboard/{name}")
async def dashboard_asset(name: str) -> Response:
    if name not in ASSETS:
        raise APIError(404, f"no dashboard file {name!r}", code="not_found", kind="not_found")
    return Response(asset(name), media_type=f"{ASSETS[name]}; charset=utf-8", headers={"Cache-Control": "no-cache"})


WindowQuery = Query(DEFAULT_WINDOW_S, gt=0, le=MAX_WINDOW_S, description="seconds of history the figures cover")


def stats_envelope(role: str, window: float) -> dict[str, Any]:
    """The fields every /v1/stats answer starts with (server and router)."""
    return {"object": "stats", "role": role, "window_s": window, "time": time.time()}


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

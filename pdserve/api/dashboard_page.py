"""The live dashboard's page, shared by the server and the PD router: `GET /dashboard` and its files (static,
shipped in the package under pdserve/api/dashboard/, served without the API key: they hold no data). The page reads
`GET /v1/stats`, which each app answers itself (server: server/routes_dashboard.py, router: router/stats.py) in the
envelope `stats_envelope` starts and over a window that `WindowQuery` bounds.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import Response

from pdserve.api.errors import APIError

MAX_WINDOW_S = 900.0  # the longest window a /v1/stats answer may cover
DEFAULT_WINDOW_S = 60.0
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css", "index.html": "text/html"}

page_router = APIRouter()

WindowQuery = Query(DEFAULT_WINDOW_S, gt=0, le=MAX_WINDOW_S, description="seconds of history the figures cover")


def asset(name: str) -> bytes:
    """A file of the dashboard package data (pdserve/api/dashboard/)."""
    return (resources.files("pdserve.api") / "dashboard" / name).read_bytes()


@page_router.get("/dashboard")
async def dashboard() -> Response:
    return Response(asset("index.html"), media_type="text/html; charset=utf-8",
                    headers={"Cache-Control": "no-cache"})


@page_router.get("/dashboard/{name}")
async def dashboard_asset(name: str) -> Response:
    if name not in ASSETS:
        raise APIError(404, f"no dashboard file {name!r}", code="not_found", kind="not_found")
    return Response(asset(name), media_type=f"{ASSETS[name]}; charset=utf-8", headers={"Cache-Control": "no-cache"})


def stats_envelope(role: str, window: float) -> dict[str, Any]:
    """The fields every /v1/stats answer starts with (server and router)."""
    return {"object": "stats", "role": role, "window_s": window, "time": time.time()}

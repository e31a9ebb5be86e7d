"""The router's `GET /v1/stats`: every instance's own /v1/stats, side by side, for the dashboard's PD view.

The router holds no engine, so it computes nothing itself: it asks each instance (prefill and decode pools) with the
client's Authorization header (instances check the key, as for requests) and the same window. An instance that
does not answer is listed with the reason; a 401 from any instance is the client's missing key and is answered as
such, so the page asks for it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from pdserve.api.dashboard_page import stats_envelope
from pdserve.api.errors import APIError
from pdserve.router.pool import Instance
from pdserve.router.serving import FORWARDED_HEADERS, RouterServing


async def instance_stats(serving: RouterServing, inst: Instance, window: float,
                         headers: dict[str, str]) -> dict[str, Any]:
    row: dict[str, Any] = {"url": inst.url, "role": inst.role, "healthy": inst.healthy, "load": inst.load}
    try:
        r = await serving.client.get(inst.url + "/v1/stats", params={"window": window}, headers=headers,
                                     timeout=serving.cfg.connect_timeout + 2)
    except httpx.HTTPError as exc:
        return {**row, "status": None, "error": f"{type(exc).__name__}: {exc}"}
    if r.status_code != 200:
        return {**row, "status": r.status_code, "error": f"answered {r.status_code}"}
    return {**row, "status": 200, "stats": r.json()}


async def router_stats(serving: RouterServing, window: float, headers: dict[str, str]) -> dict[str, Any]:
    fwd = {k: v for k, v in headers.items() if k.lower() in FORWARDED_HEADERS}
    rows = await asyncio.gather(*(instance_stats(serving, i, window, fwd) for i in serving.registry.instances))
    if any(row["status"] == 401 for row in rows):
        raise APIError(401, "an instance refused the API key (send 'Authorization: Bearer KEY')",
                       "authentication_error", code="invalid_api_key", kind="unauthorized")
    ok, _ = serving.registry.health()
    return {**stats_envelope("router", window), "healthy": ok, "instances": list(rows)}

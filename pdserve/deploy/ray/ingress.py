"""OpenAIIngress: the application's HTTP entry, a Ray Serve ingress deployment whose ASGI app is `pdserve router`'s
(create_router_app): the same choice of instance (prefix-aware, router/prefix.py, else least-loaded), PD hand-off (vLLM
kv_transfer_params), retries of requests that have not streamed a token, clear errors for streams that had, and aborts
on client disconnect. Its instances are the engine replicas advertised in the ReplicaDirectory, re-read before every
load poll, so replicas that Ray adds, restarts or removes join and leave the pools on their own. Prefix routing
tokenizes with `router.tokenizer`, by default the engine's `model` when that is a directory with a tokenizer.json on the
ingress's node.

Extra routes: GET /v1/replicas (each replica's role, URL, node and replica id) and GET /metrics/replicas (every
replica's Prometheus metrics with replica, role and node labels).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import httpx
import ray
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from pdserve.deploy.ray.directory import get_directory, pools
from pdserve.deploy.ray.metrics import merge
from pdserve.kv_transfer.trust import secret_from_env
from pdserve.router.app import create_router_app
from pdserve.router.serving import RouterConfig


class OpenAIIngress:
    def __init__(self, app_name: str, router: dict[str, Any], roles: list[str], startup_timeout_s: float = 600.0,
                 model: str | None = None, **deployments: Any) -> None:
        if "tokenizer" not in router and model and os.path.isfile(os.path.join(model, "tokenizer.json")):
            router = {**router, "tokenizer": model}
        self.directory = get_directory(app_name)
        deadline = time.monotonic() + startup_timeout_s
        urls = pools(ray.get(self.directory.list.remote()))
        while not all(urls[r] for r in roles):  # a replica of each role, so the first requests see the topology
            if time.monotonic() > deadline:
                raise TimeoutError(f"application {app_name!r}: no replica of each of {roles} registered within "
                                   f"{startup_timeout_s:.0f} s")
            time.sleep(0.5)
            urls = pools(ray.get(self.directory.list.remote()))
        self.cfg = RouterConfig(prefill=urls["prefill"], decode=urls["decode"],
                                kv_transfer_secret=secret_from_env(router.get("kv_transfer_secret")),
                                **{k: v for k, v in router.items() if k != "kv_transfer_secret"})

    async def _discover(self) -> dict[str, list[str]]:
        return pools(await self.directory.list.remote())

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = create_router_app(self.cfg)
        app.state.serving.registry.discover = self._discover

        @app.get("/v1/replicas")
        async def replicas() -> dict[str, Any]:
            return {"object": "list", "data": await self.directory.list.remote()}

        @app.get("/metrics/replicas")
        async def replica_metrics() -> PlainTextResponse:
            entries = await self.directory.list.remote()
            async with httpx.AsyncClient(timeout=5.0) as c:
                got = await asyncio.gather(*(c.get(e["url"] + "/metrics") for e in entries), return_exceptions=True)
            texts = [(e, r.text) for e, r in zip(entries, got, strict=True) if isinstance(r, httpx.Response)]
            return PlainTextResponse(merge(texts), media_type="text/plain; version=0.0.4; charset=utf-8")

        return app

"""OpenAI-compatible HTTP API (FastAPI) over the AsyncEngine: completions, chat, models, tokenize, health, metrics.

The app is assembled here: routes (routes.py) are thin and call serving objects (serving*.py), which hold the
request logic; errors leave as OpenAI error bodies (errors.py); AuthAndBodyLimitMiddleware guards the API.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from pdserve.engine.engine import LLMEngine
from pdserve.server.async_engine import AsyncEngine, EngineThread
from pdserve.server.auth_and_body_limit import AuthAndBodyLimitMiddleware
from pdserve.server.errors import install_exception_handlers
from pdserve.server.metrics import Metrics
from pdserve.server.routes import router
from pdserve.server.serving_chat import OpenAIServingChat
from pdserve.server.serving_completion import OpenAIServingCompletion
from pdserve.server.serving_tokenization import OpenAIServingTokenization


@dataclasses.dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_waiting_requests: int | None = 256
    max_body_bytes: int = 8 * 2**20


def create_app(engine: LLMEngine, cfg: ServerConfig, engine_thread: EngineThread | None = None) -> FastAPI:
    metrics = Metrics(cfg.served_model_name)
    if (dev := engine.roofline.device) is not None:
        metrics.set_peaks(engine.roofline.peak_flops, dev.mem_bandwidth, dev)
    aengine = AsyncEngine(engine, metrics, cfg.max_waiting_requests, engine_thread)
    if engine.kv_transfer is not None:  # PD disaggregation role: KV hand-off metrics
        from pdserve.disagg.metrics import KVTransferMetrics

        KVTransferMetrics(metrics.registry, cfg.served_model_name, engine.kv_transfer)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        aengine.start()
        yield
        aengine.shutdown()

    app = FastAPI(title="pdserve", lifespan=lifespan)
    name = cfg.served_model_name
    app.state.engine = aengine
    app.state.metrics = metrics
    app.state.serving_completion = OpenAIServingCompletion(aengine, name, metrics)
    app.state.serving_chat = OpenAIServingChat(aengine, name, metrics)
    app.state.serving_tokenization = OpenAIServingTokenization(aengine, name, metrics)
    app.add_middleware(AuthAndBodyLimitMiddleware, api_key=cfg.api_key, max_body_bytes=cfg.max_body_bytes,
                       metrics=metrics)
    install_exception_handlers(app, metrics)
    app.include_router(router)
    return app

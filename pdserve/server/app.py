"""OpenAI-compatible HTTP API (FastAPI) over the AsyncEngine: completions, chat, models, tokenize, health, metrics.

The app is assembled here: routes (routes.py) are thin and call serving objects (serving*.py), which hold the
request logic; errors leave as OpenAI error bodies (errors.py); AuthAndBodyLimitMiddleware guards the API.
`run_server` serves it under uvicorn with a draining shutdown.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

import uvicorn
from fastapi import FastAPI

from pdserve.engine.engine import LLMEngine
from pdserve.engine.explain import StallThreshold
from pdserve.kernels import kernels_isa
from pdserve.server.async_engine import AsyncEngine, EngineThread
from pdserve.server.auth_and_body_limit import AuthAndBodyLimitMiddleware
from pdserve.server.errors import install_exception_handlers
from pdserve.server.metrics import Metrics
from pdserve.server.routes import router
from pdserve.server.routes_dashboard import page_router, stats_router
from pdserve.server.routes_debug import debug_router
from pdserve.server.serving import ServingOptions
from pdserve.server.serving_chat import OpenAIServingChat
from pdserve.server.serving_completion import OpenAIServingCompletion
from pdserve.server.serving_embedding import OpenAIServingEmbedding
from pdserve.server.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger("pdserve.server")


@dataclasses.dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_waiting_requests: int | None = 256
    max_body_bytes: int = 8 * 2**20
    body_read_timeout: float = 30.0  # seconds to receive a whole body (408 after)
    max_n: int = 128
    max_sequences_per_request: int | None = None  # None: max_waiting_requests (1024 when that is unbounded)
    max_prompt_chars: int | None = None  # None: serving.PROMPT_CHARS_PER_TOKEN x max_model_len
    prefix_cache_isolation: Literal["none", "tenant"] = "none"
    tool_call_parser: str = "hermes"  # tool_parsers.TOOL_PARSERS
    explain_itl_threshold: str = "2x"  # a stall: an ITL gap above this (explain.StallThreshold.parse)
    debug_requests_history: int = 1000  # finished requests kept for GET /debug/requests/{id}
    profiler_dir: str | None = None  # /start_profile traces go here (None: a new temporary directory)
    otlp_traces_endpoint: str | None = None  # OpenTelemetry: export one trace per request (pdserve[otel])

    def serving_options(self) -> ServingOptions:
        seqs = self.max_sequences_per_request or self.max_waiting_requests or 1024
        return ServingOptions(self.max_n, seqs, self.max_prompt_chars, self.prefix_cache_isolation,
                              self.tool_call_parser)


def create_app(engine: LLMEngine, cfg: ServerConfig, engine_thread: EngineThread | None = None) -> FastAPI:
    metrics = Metrics(cfg.served_model_name)
    metrics.set_kernels(engine.kernels, *kernels_isa(engine.kernels))
    if (dev := engine.roofline.device) is not None:
        metrics.set_peaks(engine.roofline.peak_flops, dev.mem_bandwidth, dev)
    aengine = AsyncEngine(engine, metrics, cfg.max_waiting_requests, engine_thread)
    configure_introspection(aengine, cfg)
    if engine.kv_transfer is not None:  # PD disaggregation role: KV hand-off metrics
        from pdserve.disagg.metrics import KVTransferMetrics

        KVTransferMetrics(metrics.registry, cfg.served_model_name, engine.kv_transfer, metrics.live)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        aengine.start()
        yield
        aengine.shutdown()

    app = FastAPI(title="pdserve", lifespan=lifespan)
    name, opts = cfg.served_model_name, cfg.serving_options()
    app.state.engine = aengine
    app.state.metrics = metrics
    app.state.serving_completion = OpenAIServingCompletion(aengine, name, metrics, opts)
    app.state.serving_chat = OpenAIServingChat(aengine, name, metrics, opts)
    app.state.serving_tokenization = OpenAIServingTokenization(aengine, name, metrics, opts)
    app.state.serving_embedding = OpenAIServingEmbedding(aengine, name, metrics, opts)
    app.add_middleware(AuthAndBodyLimitMiddleware, api_key=cfg.api_key, max_body_bytes=cfg.max_body_bytes,
                       metrics=metrics, body_read_timeout=cfg.body_read_timeout)
    install_exception_handlers(app, metrics)
    app.include_router(router)
    app.include_router(debug_router)
    app.include_router(stats_router)
    app.include_router(page_router)
    return app


def configure_introspection(aengine: AsyncEngine, cfg: ServerConfig) -> None:
    """Explanations, profiler and tracing options onto the AsyncEngine."""
    aengine.explainer.threshold = StallThreshold.parse(cfg.explain_itl_threshold)
    aengine.explanations.size = cfg.debug_requests_history
    aengine.profiler_dir = cfg.profiler_dir
    if cfg.otlp_traces_endpoint:
        from pdserve.server.tracing import RequestTracer

        aengine.tracer = RequestTracer(cfg.otlp_traces_endpoint, cfg.served_model_name)


class DrainingServer(uvicorn.Server):
    """uvicorn with a draining shutdown. At SIGTERM the listener stays open: /health answers 503 "draining" (load
    balancers stop sending) while requests, open or arriving, run for up to `grace` seconds; then the streams still
    open end with an error event and [DONE] (non-streamed ones with a 503), new requests get 503, and uvicorn's own
    shutdown closes the connections."""

    FLUSH_S = 2  # after the grace: time for handlers to write their error events

    def __init__(self, config: uvicorn.Config, aengine: AsyncEngine, grace: float) -> None:
        super().__init__(config)
        self.aengine, self.grace = aengine, grace

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.aengine.draining = True
        deadline = time.monotonic() + self.grace
        if self.aengine.num_unfinished:
            logger.info("draining: %d open request(s), up to %.0f s", self.aengine.num_unfinished, self.grace)
        # open HTTP requests (uvicorn's tasks), including ones received but not yet admitted to the engine
        while (self.aengine.num_unfinished or self.server_state.tasks) and time.monotonic() < deadline \
                and not self.force_exit:
            await asyncio.sleep(0.1)
        if self.aengine.num_unfinished:
            logger.warning("shutdown grace ran out: ending %d open request(s)", self.aengine.num_unfinished)
            self.aengine.fail_all("the server is shutting down (grace period ran out)")
        self.config.timeout_graceful_shutdown = self.FLUSH_S
        await super().shutdown(sockets)


def run_server(app: FastAPI, host: str, port: int, log_level: str, grace: float) -> None:
    """Serve until SIGTERM/SIGINT, then drain (DrainingServer)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=5)
    DrainingServer(config, app.state.engine, grace).run()

"""OpenAI-compatible HTTP API (FastAPI) over the EngineClient: completions, chat, models, tokenize, health, metrics.

The app is assembled here: routes (routes.py) are thin and call serving objects (serving*.py), which hold the
request logic; errors leave as OpenAI error bodies (errors.py); AuthAndBodyLimitMiddleware guards the API. The
served models live in a ModelRegistry (model_registry.py; app.state.registry), changed by the admin API (admin.py).
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
from pathlib import Path
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from pdserve.api.api_keys import KeyRing
from pdserve.api.auth_and_body_limit import AuthAndBodyLimitMiddleware
from pdserve.api.dashboard_page import page_router
from pdserve.api.errors import install_exception_handlers
from pdserve.api.http_protocol import HeadLimits, uvicorn_options
from pdserve.api.key_limiter import KeyLimiter
from pdserve.api.log_hygiene import install_log_hygiene
from pdserve.api.request_id import RequestIdMiddleware
from pdserve.cache import cache_root
from pdserve.config import EngineConfig
from pdserve.engine.client import EngineClient, EngineThread, LLMEngine
from pdserve.profiler.traces import ProfilerLimits
from pdserve.server.admin import admin_router
from pdserve.server.allocator import release_memory
from pdserve.server.audit import AuditLog
from pdserve.server.lora_admin import lora_router
from pdserve.server.metrics import merged_registry
from pdserve.server.model_registry import ModelRegistry
from pdserve.server.model_routes import models_router
from pdserve.server.model_spec import ModelSpec
from pdserve.server.response_store import ResponseStore
from pdserve.server.routes import router
from pdserve.server.routes_dashboard import stats_router
from pdserve.server.routes_debug import debug_router
from pdserve.server.serving import ServingOptions
from pdserve.server.tenants import TenantMetrics
from pdserve.server.tracing import RequestTracer

logger = logging.getLogger("pdserve.server")


@dataclasses.dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | list[str] | None = None  # --api-key, each (api_keys.py: names, tenants)
    api_key_file: str | None = None  # --api-key-file: named keys with optional limits (api_keys.py)
    allowed_origins: list[str] | None = None  # CORS (None: no CORS headers)
    allowed_methods: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    max_waiting_requests: int | None = 256
    max_body_bytes: int = 8 * 2**20
    body_read_timeout: float = 30.0  # seconds to receive a whole body (408 after)
    head_limits: HeadLimits = dataclasses.field(default_factory=HeadLimits)  # request line + headers (408, 431)
    max_n: int = 128
    max_sequences_per_request: int | None = None  # None: max_waiting_requests (1024 when that is unbounded)
    max_prompt_chars: int | None = None  # None: serving.PROMPT_CHARS_PER_TOKEN x max_model_len
    max_prompt_logprob_entries: int = 2**17  # prompt tokens x (prompt_logprobs + 1) of one request
    prefix_cache_isolation: Literal["none", "tenant"] = "none"
    tool_call_parser: str = "hermes"  # tool_parsers.TOOL_PARSERS
    reasoning_parser: str | None = None  # reasoning.REASONING_PARSERS: <think> text -> reasoning_content
    default_chat_template_kwargs: dict[str, Any] | None = None  # under each request's chat_template_kwargs
    explain_itl_threshold: str = "2x"  # a stall: an ITL gap above this (explain.StallThreshold.parse)
    debug_requests_history: int = 1000  # finished requests kept for GET /debug/requests/{id}
    profiler_dir: str | None = None  # /start_profile traces go here (None: a new temporary directory)
    profiler_limits: ProfilerLimits = dataclasses.field(default_factory=ProfilerLimits)  # duration, kept traces
    otlp_traces_endpoint: str | None = None  # OpenTelemetry: export one trace per request (pdserve[otel])
    admin_api_key: str | None = None  # None: no admin API (/admin answers 404)
    audit_log: str | None = None  # JSONL path; None: <cache dir>/audit.jsonl with the admin API, else memory; "off"
    tenant_label_limit: int = 16  # distinct tenants labelled in the per-tenant metrics; later ones: "other"
    metrics_public: bool = False  # /metrics and /version without the API key
    responses_store_max_entries: int = 1024  # stored /v1/responses responses (0: none stored)
    responses_store_max_bytes: int = 64 * 2**20  # their JSON, in all
    responses_store_ttl: float = 3600.0  # seconds a stored response lives

    def key_ring(self) -> KeyRing | None:
        flag = [self.api_key] if isinstance(self.api_key, str) else list(self.api_key or [])
        return KeyRing.from_options(flag, self.api_key_file)

    def audit_log_path(self) -> Path | None:
        if self.audit_log == "off" or self.audit_log is None and not self.admin_api_key:
            return None
        return Path(self.audit_log) if self.audit_log else cache_root() / "audit.jsonl"

    def serving_options(self) -> ServingOptions:
        seqs = self.max_sequences_per_request or self.max_waiting_requests or 1024
        return ServingOptions(self.max_n, seqs, self.max_prompt_chars, self.prefix_cache_isolation,
                              self.tool_call_parser, self.reasoning_parser,
                              max_prompt_logprob_entries=self.max_prompt_logprob_entries,
                              default_chat_template_kwargs=self.default_chat_template_kwargs)


def new_registry(base: EngineConfig, cfg: ServerConfig) -> ModelRegistry:
    """An empty model registry with the server's options, audit log and per-tenant metrics."""
    return ModelRegistry(base, cfg.serving_options(), cfg.max_waiting_requests, AuditLog(cfg.audit_log_path()),
                         TenantMetrics(cfg.tenant_label_limit),
                         lambda client, name: configure_introspection(client, cfg, name))


def create_app(engine: LLMEngine, cfg: ServerConfig, engine_thread: EngineThread | None = None) -> FastAPI:
    """The app serving one engine built by the caller, under `cfg.served_model_name`."""
    registry = new_registry(engine.config, cfg)
    registry.add_engine(ModelSpec(cfg.served_model_name, engine.config.model), engine, engine_thread)
    return create_registry_app(registry, cfg)


def create_registry_app(registry: ModelRegistry, cfg: ServerConfig) -> FastAPI:
    """The app over a registry holding at least one loaded model (the first is the default)."""
    default = registry.default()
    metrics = default.metrics  # errors outside any model (auth, body limits, validation): the first model's
    assert metrics is not None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        registry.start()
        yield
        registry.shutdown()

    app = FastAPI(title="pdserve", lifespan=lifespan)
    app.state.registry = registry  # per-model state: registry.get(name) / registry.default()
    app.state.client = default.client  # the first model's, for code that serves one model
    app.state.metrics = metrics
    app.state.prometheus = merged_registry(lambda: [
        *(m.metrics.registry for m in registry.loaded() if m.metrics is not None), registry.tenant_metrics.registry])
    app.state.admin_api_key = cfg.admin_api_key
    app.state.response_store = ResponseStore(cfg.responses_store_max_entries, cfg.responses_store_max_bytes,
                                             cfg.responses_store_ttl)
    keys = cfg.key_ring()
    app.add_middleware(AuthAndBodyLimitMiddleware, api_key=None, max_body_bytes=cfg.max_body_bytes,
                       metrics=metrics, body_read_timeout=cfg.body_read_timeout, admin_api_key=cfg.admin_api_key,
                       public_metrics=cfg.metrics_public, keys=keys,
                       limiter=KeyLimiter(keys.keys) if keys is not None else None,
                       on_key_refused=lambda name, status: registry.tenant_metrics.observe_refused(
                           "unknown", name if keys and keys.pins_tenant else None, status))  # before routing
    if cfg.allowed_origins:  # outside the key check: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=cfg.allowed_origins, allow_methods=cfg.allowed_methods,
                           allow_headers=cfg.allowed_headers, allow_credentials=False)
    app.add_middleware(RequestIdMiddleware)  # added last: outermost, so the guards' refusals carry the id too
    install_exception_handlers(app, metrics)
    app.include_router(router)
    app.include_router(models_router)
    app.include_router(debug_router)
    app.include_router(stats_router)
    app.include_router(page_router)
    if cfg.admin_api_key:  # off: every /admin path is a 404
        app.include_router(admin_router)
        app.include_router(lora_router)  # vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter
    return app


def configure_introspection(client: EngineClient, cfg: ServerConfig, model_name: str) -> RequestTracer | None:
    """Explanations and profiler options onto a model's EngineClient; its request tracer (OpenTelemetry), if
    --otlp-traces-endpoint is set."""
    client.configure_introspection(cfg.explain_itl_threshold, cfg.debug_requests_history, cfg.profiler_dir,
                                   cfg.profiler_limits, release_memory)  # a stopped profile's memory to the OS
    if cfg.otlp_traces_endpoint:
        return RequestTracer(cfg.otlp_traces_endpoint, model_name)
    return None


class DrainingServer(uvicorn.Server):
    """uvicorn with a draining shutdown. At SIGTERM the listener stays open: /health answers 503 "draining" (load
    balancers stop sending) while requests, open or arriving, run for up to `grace` seconds; then the streams still
    open end with an error event and [DONE] (non-streamed ones with a 503), new requests get 503, and uvicorn's own
    shutdown closes the connections."""

    FLUSH_S = 2  # after the grace: time for handlers to write their error events

    def __init__(self, config: uvicorn.Config, registry: ModelRegistry, grace: float) -> None:
        super().__init__(config)
        self.registry, self.grace = registry, grace  # every served model's requests

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.registry.set_draining()
        deadline = time.monotonic() + self.grace
        if self.registry.num_unfinished:
            logger.info("draining: %d open request(s), up to %.0f s", self.registry.num_unfinished, self.grace)
        # open HTTP requests (uvicorn's tasks), including ones received but not yet admitted to the engine
        while (self.registry.num_unfinished or self.server_state.tasks) and time.monotonic() < deadline \
                and not self.force_exit:
            await asyncio.sleep(0.1)
        if self.registry.num_unfinished:
            logger.warning("shutdown grace ran out: ending %d open request(s)", self.registry.num_unfinished)
            self.registry.fail_all("the server is shutting down (grace period ran out)")
        self.config.timeout_graceful_shutdown = self.FLUSH_S
        await super().shutdown(sockets)


def run_server(app: FastAPI, host: str, port: int, log_level: str, grace: float,
               head_limits: HeadLimits | None = None, ssl_keyfile: str | None = None,
               ssl_certfile: str | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then drain (DrainingServer). Request heads are bounded (http_protocol.py);
    HTTPS when given a key and certificate."""
    if bool(ssl_keyfile) != bool(ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile,
                            **uvicorn_options(head_limits or HeadLimits()))
    install_log_hygiene()  # after uvicorn set its loggers up: no secret, no client-made line break in a log line
    DrainingServer(config, app.state.registry, grace).run()

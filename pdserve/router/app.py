"""`pdserve router`: the PD disaggregation router's HTTP app. The routes are thin: they parse the client's request
and hand it to `RouterServing` (serving.py: the prefill -> decode hand-off, retries, streaming relay; Anthropic's
/v1/messages and count_tokens relayed to a decode instance as they are); instances,
health and the choice of instance live in pool.py (least-loaded) and prefix.py (prefix-aware). The router speaks
HTTP to its instances only: it loads neither torch nor the engine (tests/test_architecture.py checks it).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import generate_latest

from pdserve.api.auth_and_body_limit import AuthAndBodyLimitMiddleware
from pdserve.api.dashboard_page import WindowQuery, page_router
from pdserve.api.errors import install_exception_handlers
from pdserve.api.http_protocol import HeadLimits, uvicorn_options
from pdserve.api.log_hygiene import install_log_hygiene
from pdserve.api.request_id import RequestIdMiddleware
from pdserve.kv_transfer.trust import secret_from_env
from pdserve.router.serving import RoutedResponse, RouterConfig, RouterServing, parse_body
from pdserve.router.stats import router_stats


def create_router_app(cfg: RouterConfig, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The router app; `transport` replaces the network to the instances (tests pass fakes)."""
    serving = RouterServing(cfg, transport)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await serving.start()
        yield
        await serving.close()

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    app.state.serving = serving
    # the server's guards and error bodies: a body over the cap is refused before it is read (413), every error
    # leaves as an OpenAI body, counted by RouterMetrics.error
    app.add_middleware(AuthAndBodyLimitMiddleware, api_key=None, max_body_bytes=cfg.max_body_bytes,
                       metrics=serving.metrics)
    app.add_middleware(RequestIdMiddleware)  # outermost; the id is forwarded to the instances (FORWARDED_HEADERS)
    install_exception_handlers(app, serving.metrics)

    async def route(path: str, raw: Request) -> Response:
        body = parse_body(path, await raw.body())  # APIError -> 400 with an OpenAI body
        headers = dict(raw.headers.items())
        if body.get("stream"):
            events = serving.stream(path, body, headers, raw.is_disconnected)
            return StreamingResponse(events, media_type="text/event-stream")
        return as_response(await serving.complete(path, body, headers, raw.is_disconnected))

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await route("/v1/completions", raw)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await route("/v1/chat/completions", raw)

    @app.post("/v1/messages")
    async def messages(raw: Request) -> Response:
        return await relay(serving, "/v1/messages", raw)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(raw: Request) -> Response:
        return await relay(serving, "/v1/messages/count_tokens", raw)

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        return as_response(await serving.models(dict(raw.headers.items())))

    @app.get("/health")
    async def health() -> Response:
        status, body = serving.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(generate_latest(serving.metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/stats")
    async def stats(raw: Request, window: float = WindowQuery) -> dict[str, Any]:
        return await router_stats(serving, window, dict(raw.headers.items()))

    app.include_router(page_router)  # the same dashboard; it shows the instances side by side
    return app


async def relay(serving: RouterServing, path: str, raw: Request) -> Response:
    """Anthropic's Messages API: relayed to a decode instance (RouterServing.relay); a stream's status is known
    before its first byte goes out, so an instance's refusal keeps its own status."""
    body = parse_body(path, await raw.body())
    out = serving.relay(path, body, dict(raw.headers.items()), raw.is_disconnected)
    first = await anext(out, RoutedResponse(502, b""))
    if isinstance(first, RoutedResponse):
        await out.aclose()
        return as_response(first)

    async def rest() -> AsyncIterator[bytes]:
        async with aclosing(out):
            yield first
            async for chunk in out:
                assert isinstance(chunk, bytes)
                yield chunk
    return StreamingResponse(rest(), media_type="text/event-stream")


def as_response(r: RoutedResponse) -> Response:
    return Response(r.content, status_code=r.status, media_type="application/json" if r.content else None)


# ---- command line ------------------------------------------------------------------------------------------
def add_router_parser(sub: Any) -> None:
    p = sub.add_parser("router", help="PD disaggregation router: prefill on one pool, decode on another")
    p.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill instances (pdserve --role prefill)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances (--role decode)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--poll-interval", type=float, default=0.5, help="seconds between /metrics polls")
    p.add_argument("--connect-timeout", type=float, default=3.0, help="seconds to connect to an instance")
    p.add_argument("--prefill-timeout", type=float, default=30.0,
                   help="seconds one prefill request may take; then the decode instance computes the prompt")
    p.add_argument("--decode-timeout", type=float, default=60.0,
                   help="longest silence on a decode stream (whole non-streaming decode), in seconds")
    p.add_argument("--max-decode-attempts", type=int, default=2, help="decode instances tried per request")
    p.add_argument("--on-prefill-failure", choices=["recompute", "fail"], default="recompute",
                   help="when no prefill instance succeeds: the decode instance computes the prompt, or 502")
    p.add_argument("--kv-transfer-secret", default=None,
                   help="shared secret to sign kv_transfer_params with (the instances' --kv-transfer-secret; "
                   "default: env PDSERVE_KV_TRANSFER_SECRET); never logged")
    p.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="reject larger request bodies (413)")
    p.add_argument("--routing", choices=["prefix", "least-loaded"], default="prefix",
                   help="prefix: prefer the instance that holds the prompt's leading KV blocks, weighed against load "
                   "(README: prefix-aware routing); least-loaded: load only")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="the model's directory (tokenizer.json, tokenizer_config.json), to route text and chat "
                   "prompts by prefix; without it only token-id prompts are")
    p.add_argument("--prefix-load-cost", type=float, default=256.0, metavar="TOKENS",
                   help="prompt tokens one request on an instance is worth against a prefix hit (0: always follow "
                   "the prefix)")
    p.add_argument("--prefix-disk-cost", type=float, default=0.1, metavar="F",
                   help="what a prompt token an instance reads back from its disk tier costs against computing it "
                   "(0-1; the instances' --kv-offload-dir)")
    p.add_argument("--prefix-pending-ttl", type=float, default=10.0, metavar="S",
                   help="seconds a routed prompt's blocks count as on its instance before its summary shows them")
    p.add_argument("--instance-api-key", default=None, help="the instances' --api-key, sent with the router's "
                   "/metrics polls (default: env PDSERVE_INSTANCE_API_KEY); never logged")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=_cmd_router)


def _cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    cfg = RouterConfig(prefill=args.prefill, decode=args.decode, poll_interval=args.poll_interval,
                       connect_timeout=args.connect_timeout, prefill_timeout=args.prefill_timeout,
                       decode_timeout=args.decode_timeout, max_decode_attempts=args.max_decode_attempts,
                       on_prefill_failure=args.on_prefill_failure,
                       kv_transfer_secret=secret_from_env(args.kv_transfer_secret), max_body_bytes=args.max_body_bytes,
                       routing=args.routing, tokenizer=args.tokenizer, prefix_load_cost=args.prefix_load_cost,
                       prefix_pending_ttl=args.prefix_pending_ttl, prefix_disk_cost=args.prefix_disk_cost,
                       instance_api_key=args.instance_api_key or os.environ.get("PDSERVE_INSTANCE_API_KEY"))
    config = uvicorn.Config(create_router_app(cfg), host=args.host, port=args.port, log_level=args.log_level,
                            **uvicorn_options(HeadLimits()))  # request heads bounded as the server's
    install_log_hygiene()  # after uvicorn set its loggers up: no secret in the access log
    uvicorn.Server(config).run()
    return 0

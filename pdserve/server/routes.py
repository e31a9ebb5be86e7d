"""The HTTP routes: thin handlers that hand the parsed body to a serving object and wrap what it returns."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import generate_latest

from pdserve.server.async_engine import AsyncEngine
from pdserve.server.metrics import Metrics
from pdserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pdserve.server.serving import RequestContext, ServingResult
from pdserve.server.serving_chat import OpenAIServingChat
from pdserve.server.serving_completion import OpenAIServingCompletion
from pdserve.server.serving_embedding import EmbeddingRequest, OpenAIServingEmbedding
from pdserve.server.serving_tokenization import OpenAIServingTokenization
from pdserve.server.tracing import trace_headers

router = APIRouter()


def _context(raw: Request, user: str | None) -> RequestContext:
    return RequestContext(tenant=raw.headers.get("x-tenant") or user, is_disconnected=raw.is_disconnected,
                          trace_headers=trace_headers(raw.headers))


def _respond(result: ServingResult) -> Response:
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream")


@router.post("/v1/completions")
async def completions(body: CompletionRequest, raw: Request) -> Response:
    serving: OpenAIServingCompletion = raw.app.state.serving_completion
    return _respond(await serving.create_completion(body, _context(raw, body.user)))


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
    serving: OpenAIServingChat = raw.app.state.serving_chat
    return _respond(await serving.create_chat_completion(body, _context(raw, body.user)))


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
    serving: OpenAIServingEmbedding = raw.app.state.serving_embedding
    return _respond(await serving.create_embedding(body, _context(raw, body.user)))


@router.get("/v1/models")
async def models(raw: Request) -> dict[str, Any]:
    serving: OpenAIServingTokenization = raw.app.state.serving_tokenization
    return serving.models()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, raw: Request) -> dict[str, Any]:
    serving: OpenAIServingTokenization = raw.app.state.serving_tokenization
    return await serving.tokenize(body)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, raw: Request) -> dict[str, Any]:
    serving: OpenAIServingTokenization = raw.app.state.serving_tokenization
    return await serving.detokenize(body)


@router.get("/health")
async def health(raw: Request) -> Response:
    aengine: AsyncEngine = raw.app.state.engine
    if aengine.dead is not None:
        return JSONResponse({"status": "dead", "error": repr(aengine.dead)}, status_code=503)
    if aengine.draining:  # SIGTERM: load balancers stop sending, open requests finish
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def prometheus(raw: Request) -> Response:
    metrics: Metrics = raw.app.state.metrics
    return PlainTextResponse(generate_latest(metrics.registry).decode(),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/debug/kv")
async def debug_kv(raw: Request) -> dict[str, Any]:
    """The engine thread's last published KV state, plus the API requests still open."""
    aengine: AsyncEngine = raw.app.state.engine
    return {**aengine.kv_snapshot.as_dict(), "open_requests": aengine.num_unfinished}

"""The HTTP routes: thin handlers that hand the parsed body to a serving object and wrap what it returns."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from starlette.background import BackgroundTask

from pdserve.api.auth_and_body_limit import QUOTA_SCOPE_KEY
from pdserve.api.errors import APIError, from_rejected
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pdserve.api.protocol_messages import CountTokensRequest, MessagesRequest
from pdserve.api.protocol_responses import ResponsesRequest
from pdserve.api.request_id import request_id
from pdserve.errors import RequestRejected
from pdserve.prefix_hash import pack_hashes
from pdserve.server.allocator import trim_heap
from pdserve.server.model_registry import ModelRegistry, ServedModel
from pdserve.server.response_store import owner_key
from pdserve.server.serving import RequestContext, ServingResult
from pdserve.server.serving_chat import OpenAIServingChat
from pdserve.server.serving_completion import OpenAIServingCompletion
from pdserve.server.serving_embedding import EmbeddingRequest, OpenAIServingEmbedding
from pdserve.server.serving_messages import ServingMessages
from pdserve.server.serving_responses import OpenAIServingResponses, delete_response, retrieve_response
from pdserve.server.serving_tokenization import OpenAIServingTokenization
from pdserve.server.tracing import trace_headers

router = APIRouter()
VERSION_HEADER = "x-pdserve-model-version"  # NAME@VERSION of the model that served a request
TRIM_AFTER_BYTES = 2**20  # a JSON reply this large was built from many small objects: trim the heap after it


def _context(raw: Request, user: str | None) -> RequestContext:
    return RequestContext(tenant=raw.headers.get("x-tenant") or user, is_disconnected=raw.is_disconnected,
                          trace_headers=trace_headers(raw.headers), request_id=request_id(raw),
                          quota=raw.scope.get(QUOTA_SCOPE_KEY))


def _respond(result: ServingResult, served: ServedModel | None = None) -> Response:
    # served-by evidence: which model and version answered (an alias or canary may have picked it)
    headers = {VERSION_HEADER: served.version_tag} if served is not None else None
    if isinstance(result, dict):
        resp = JSONResponse(result, headers=headers)
        if len(resp.body) >= TRIM_AFTER_BYTES:  # its objects' pages back to the OS once sent (allocator.py)
            resp.background = BackgroundTask(trim_heap)
        return resp
    return StreamingResponse(result, media_type="text/event-stream", headers=headers)


@contextmanager
def _routed(raw: Request, body: Any) -> Iterator[ServedModel]:
    """The model the body's `model` routes to (registry.lease: held until the request is admitted or answered).
    A request refused with an error counts for its tenant; the error itself is answered by the app's handlers."""
    registry: ModelRegistry = raw.app.state.registry
    model = "unknown"
    try:
        with registry.lease(body.model) as served:
            model = served.name
            assert served.client is not None  # lease() routes to loaded models only
            if served.client.lora_request(body.model) is None:  # a LoRA adapter's name stays: it picks the adapter
                body.model = served.name  # routed: an alias resolved to its target
            yield served
    except (APIError, RequestRejected) as e:
        status = e.status if isinstance(e, APIError) else from_rejected(e).status
        registry.tenant_metrics.observe_refused(model, raw.headers.get("x-tenant") or getattr(body, "user", None),
                                                status)
        raise


@router.post("/v1/completions")
async def completions(body: CompletionRequest, raw: Request) -> Response:
    with _routed(raw, body) as served:
        serving: OpenAIServingCompletion = served.serving_completion
        return _respond(await serving.create_completion(body, _context(raw, body.user)), served)


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
    with _routed(raw, body) as served:
        serving: OpenAIServingChat = served.serving_chat
        return _respond(await serving.create_chat_completion(body, _context(raw, body.user)), served)


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
    with _routed(raw, body) as served:
        serving: OpenAIServingEmbedding = served.serving_embedding
        return _respond(await serving.create_embedding(body, _context(raw, body.user)), served)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, raw: Request) -> dict[str, Any]:
    with _routed(raw, body) as served:
        serving: OpenAIServingTokenization = served.serving_tokenization
        return await serving.tokenize(body)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, raw: Request) -> dict[str, Any]:
    with _routed(raw, body) as served:
        serving: OpenAIServingTokenization = served.serving_tokenization
        return await serving.detokenize(body)


@router.post("/v1/messages")  # Anthropic Messages: a view of the model's chat serving
async def messages(body: MessagesRequest, raw: Request) -> Response:
    with _routed(raw, body) as served:
        serving = ServingMessages(served.serving_chat)
        return _respond(await serving.create_message(body, _context(raw, body.user)), served)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, raw: Request) -> dict[str, Any]:
    with _routed(raw, body) as served:
        return await ServingMessages(served.serving_chat).count_tokens(body)


@router.get("/health")
async def health(raw: Request) -> Response:
    registry: ModelRegistry = raw.app.state.registry
    if (dead := registry.dead) is not None:
        return JSONResponse({"status": "dead", "error": repr(dead)}, status_code=503)
    if registry.draining:  # SIGTERM: load balancers stop sending, open requests finish
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def prometheus(raw: Request) -> Response:
    return PlainTextResponse(generate_latest(raw.app.state.prometheus).decode(),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/debug/kv")
async def debug_kv(raw: Request, model: str | None = None) -> dict[str, Any]:
    """A model's (default: the default model's) last published KV state, plus its API requests still open."""
    registry: ModelRegistry = raw.app.state.registry
    client = registry.get(model).client
    assert client is not None
    return {**client.kv_snapshot.as_dict(), "open_requests": client.num_unfinished}


@router.get("/kv/prefix_hashes")
async def prefix_hashes(raw: Request, model: str | None = None) -> Response:
    """The prefix-cache block hashes a model (default: the default model) holds, for prefix-aware routers:
    `hashes` packed 8 bytes each (prefix_hash.pack_hashes), and `disk_hashes`, the blocks its disk tier holds that
    are not in memory. The ETag is epoch-version-disk_version: a router that sends it back in If-None-Match gets a
    304 while neither set has changed."""
    served = raw.app.state.registry.get(model)
    assert served.client is not None  # get() returns loaded models only
    summary = await served.client.current_prefix_summary()
    etag = summary.etag
    if raw.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers={"etag": etag})
    isolation = served.serving_completion.options.prefix_cache_isolation
    return JSONResponse({"object": "prefix_hashes", "model": served.name, "epoch": summary.epoch,
                         "version": summary.version, "block_size": summary.block_size, "isolation": isolation,
                         "num_hashes": len(summary.hashes), "hashes": pack_hashes(summary.hashes),
                         "num_disk_hashes": len(summary.disk_hashes), "disk_hashes": pack_hashes(summary.disk_hashes)},
                        headers={"etag": etag})


# ---- the Responses API: stored responses belong to the API key and the X-Tenant header (response_store.py) -------
def _owner(raw: Request) -> str:
    key = raw.headers.get("x-api-key")  # the key, whichever header carried it (auth_and_body_limit.py)
    authorization = raw.headers.get("authorization") or (f"Bearer {key}" if key else None)
    return owner_key(authorization, raw.headers.get("x-tenant"))


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, raw: Request) -> Response:
    with _routed(raw, body) as served:
        serving = OpenAIServingResponses(served.serving_chat, raw.app.state.response_store)
        return _respond(await serving.create(body, _context(raw, body.user), _owner(raw)), served)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, raw: Request) -> dict[str, Any]:
    return retrieve_response(raw.app.state.response_store, _owner(raw), response_id)


@router.delete("/v1/responses/{response_id}")
async def remove_response(response_id: str, raw: Request) -> dict[str, Any]:
    return delete_response(raw.app.state.response_store, _owner(raw), response_id)

"""OpenAI-compatible HTTP API (FastAPI) over the AsyncEngine: completions, chat, models, tokenize, health, metrics.

One HTTP request may fan out into several engine requests (several prompts, n > 1); each is a child with its own
id `<id>-<prompt>-<sample>`, and choices are indexed prompt * n + sample. Errors use OpenAI's body:
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.engine.engine import LLMEngine, PromptType
from pdserve.engine.request import Request as EngineRequest
from pdserve.errors import ErrorCode, RequestRejected
from pdserve.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams
from pdserve.server.async_engine import AsyncEngine, EngineDead, EngineThread, QueueFull
from pdserve.server.metrics import Metrics
from pdserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

logger = logging.getLogger("pdserve.server")
request_log = logging.getLogger("pdserve.requests")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, kind: str = "bad_request") -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type_
        self.param, self.code, self.kind = param, code, kind


def error_body(status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code if code else status}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.status, e.message, e.type, e.param, e.code), status_code=e.status)


@dataclasses.dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_waiting_requests: int | None = 256
    max_body_bytes: int = 8 * 2**20


class _Guard:
    """ASGI middleware: API key on /v1 and tokenizer endpoints, and a cap on request body size (checked on the
    declared length and on the bytes actually received)."""

    def __init__(self, app: ASGIApp, cfg: ServerConfig, metrics: Metrics) -> None:
        self.app, self.cfg, self.metrics = app, cfg, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.cfg.api_key and (path.startswith("/v1") or path in ("/tokenize", "/detokenize")):
            if headers.get("authorization", "") != f"Bearer {self.cfg.api_key}":
                self.metrics.error("unauthorized")
                await error_response(APIError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                                              "authentication_error", code="invalid_api_key"))(scope, receive, send)
                return
        limit = self.cfg.max_body_bytes
        too_large = APIError(413, f"request body exceeds {limit} bytes", code="payload_too_large")
        if int(headers.get("content-length", "0") or 0) > limit:
            self.metrics.error("payload_too_large")
            await error_response(too_large)(scope, receive, send)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise APIError(413, too_large.message, code="payload_too_large", kind="payload_too_large")
            return msg

        await self.app(scope, limited_receive, send)


def create_app(engine: LLMEngine, cfg: ServerConfig, engine_thread: EngineThread | None = None) -> FastAPI:
    metrics = Metrics(cfg.served_model_name)
    if engine.roofline.device is not None:
        metrics.set_peaks(engine.roofline.peak_flops, engine.roofline.device.mem_bandwidth)
    aengine = AsyncEngine(engine, metrics, cfg.max_waiting_requests, engine_thread)
    if engine.kv_transfer is not None:  # PD disaggregation role: KV hand-off metrics
        from pdserve.disagg.metrics import KVTransferMetrics

        KVTransferMetrics(metrics.registry, cfg.served_model_name, engine.kv_transfer)
    tok = engine.tokenizer

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        aengine.start()
        yield
        aengine.shutdown()

    app = FastAPI(title="pdserve", lifespan=lifespan)
    app.state.engine = aengine
    app.state.metrics = metrics
    app.add_middleware(_Guard, cfg=cfg, metrics=metrics)

    # ---- errors --------------------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        metrics.error(e.kind)
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ()) if x != 'body') or 'body'}: {er.get('msg')}"
                        for er in errs[:5])
        metrics.error("bad_request")
        return error_response(APIError(400, msg or "invalid request", param=".".join(loc) or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if e.status_code == 404 else "bad_request"
        metrics.error(kind)
        return error_response(APIError(e.status_code, str(e.detail), kind=kind))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        metrics.error("internal")
        return error_response(APIError(500, f"internal error: {e!r}", "internal_error", kind="internal"))

    # ---- helpers -------------------------------------------------------------------------------------------
    def check_model(name: str | None) -> None:
        if name is not None and name != cfg.served_model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {cfg.served_model_name!r}",
                           param="model", code="model_not_found", kind="not_found")

    @functools.lru_cache(maxsize=65536)
    def token_text(token_id: int) -> str:
        return str(tok.decode([token_id]))

    def make_children(prompts: list[PromptType], params: SamplingParams, base_id: str,
                      kv_params: dict[str, Any] | None = None) -> list[EngineRequest]:
        if kv_params and (len(prompts) > 1 or params.n > 1):
            raise APIError(400, "kv_transfer_params needs a single prompt and n=1", param="kv_transfer_params")
        try:
            reqs = engine.make_requests(prompts, params, base_id)
        except RequestRejected as e:
            too_long = e.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED
            raise APIError(400, str(e), param=e.param, code=e.code.value,
                           kind="context_length" if too_long else "bad_request") from e
        if kv_params and engine.kv_transfer is not None:
            reqs[0].kv_transfer_params = kv_params
        return reqs

    def kv_response(reqs: list[EngineRequest]) -> dict[str, Any]:
        """A prefill instance's hand-off params for the router (vLLM's response field kv_transfer_params)."""
        r = reqs[0]
        if r.kv_transfer_params and r.kv_transfer_params.get("do_remote_decode") and r.kv_transfer_result:
            return {"kv_transfer_params": r.kv_transfer_result}
        return {}

    def to_params(body: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
        try:
            return body.to_sampling_params()
        except ValueError as e:
            raise APIError(400, str(e)) from e

    def log_finished(req: EngineRequest, tenant: str | None) -> None:
        t = req.times
        rec: dict[str, Any] = {"request_id": req.request_id, "tenant": tenant, "prompt_tokens": req.num_prompt_tokens,
               "output_tokens": req.num_output_tokens, "cached_tokens": max(req.num_cached_tokens, 0),
               "queue_s": t.queue_time, "prefill_s": t.prefill_time, "decode_s": t.decode_time, "ttft_s": t.ttft,
               "tpot_s": t.tpot, "e2e_s": t.e2e, "preemptions": len(t.preemptions),
               "finish_reason": req.status.finish_reason, "error": req.error}
        if engine.kv_transfer is not None:  # PD roles: which instances served it, and the hand-off
            rec["engine_id"] = engine.kv_transfer.engine_id
            res = req.kv_transfer_result or {}
            if res.get("do_remote_prefill"):  # prefill side: pinned for a decode instance
                rec["kv_transfer"] = {"pinned_blocks": len(res["remote_block_ids"])}
            elif res:  # decode side: the pull
                rec["kv_transfer"] = {k: res.get(k) for k in ("remote_engine_id", "ok", "bytes", "seconds",
                                                              "num_cached_tokens", "error")}
        request_log.info(json.dumps(rec, ensure_ascii=False))

    async def stream_all(reqs: list[EngineRequest], tenant: str | None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Merge the children's output streams; cancelling this generator aborts every unfinished child."""
        merged: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(idx: int, req: EngineRequest) -> None:
            try:
                async for out in aengine.generate(req):
                    await merged.put((idx, out))
                await merged.put((idx, None))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                await merged.put((idx, e))
                if isinstance(e, asyncio.CancelledError):
                    raise
            finally:
                if req.is_finished:
                    log_finished(req, tenant)

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
        try:
            remaining = len(tasks)
            while remaining:
                idx, item = await merged.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    if isinstance(item, QueueFull):
                        raise APIError(429, str(item), "rate_limit_error", code="too_many_requests",
                                       kind="rate_limited")
                    if isinstance(item, EngineDead):
                        raise APIError(500, str(item), "internal_error", kind="engine")
                    raise item
                elif item.outputs[0].finish_reason == "error":
                    raise APIError(500, item.error or "request failed", "internal_error", kind="engine")
                else:
                    yield idx, item
        finally:
            for t in tasks:
                t.cancel()

    async def collect(reqs: list[EngineRequest], tenant: str | None, raw: Request) -> list[RequestOutput]:
        """Run children to completion (non-streaming); abort them if the client goes away."""
        finals: dict[int, RequestOutput] = {}

        async def consume() -> None:
            async for idx, out in stream_all(reqs, tenant):
                if out.finished:
                    finals[idx] = out

        task = asyncio.create_task(consume())
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await raw.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected", kind="bad_request")
        task.result()
        return [finals[i] for i in range(len(reqs))]

    def usage(reqs: list[EngineRequest]) -> dict[str, Any]:
        per_prompt = [r for r in reqs if r.sample_index == 0]  # n samples share one prompt
        prompt = sum(r.num_prompt_tokens for r in per_prompt)
        completion = sum(r.num_output_tokens for r in reqs)
        cached = sum(max(r.num_cached_tokens, 0) for r in per_prompt)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def timings(reqs: list[EngineRequest]) -> list[dict[str, Any]]:
        return [{"index": i, **r.times.as_dict()} for i, r in enumerate(reqs)]

    def tenant_of(body: Any, raw: Request) -> str | None:
        return raw.headers.get("x-tenant") or body.user

    def sse(obj: dict[str, Any] | str) -> str:
        return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"

    async def sse_stream(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield sse(chunk)
        except APIError as e:
            metrics.error(e.kind)
            yield sse(error_body(e.status, e.message, e.type, e.param, e.code))
        yield sse("[DONE]")

    def completion_logprobs(out_lps: list[Any], text_offset: int) -> dict[str, Any]:
        tokens, lps, tops, offsets = [], [], [], []
        off = text_offset
        for lp in out_lps:
            t = token_text(lp.token_id)
            tokens.append(t)
            lps.append(lp.logprob)
            tops.append({token_text(i): v for i, v in lp.top})
            offsets.append(off)
            off += len(t)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(out_lps: list[Any]) -> dict[str, Any]:
        def entry(tid: int, v: float) -> dict[str, Any]:
            t = token_text(tid)
            return {"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                            for lp in out_lps]}

    # ---- endpoints -----------------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if aengine.dead is not None:
            return JSONResponse({"status": "dead", "error": repr(aengine.dead)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(generate_latest(metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/debug/kv")
    async def debug_kv() -> dict[str, Any]:
        bm = engine.block_manager
        return {"num_blocks": bm.num_blocks, "num_free_blocks": bm.num_free_blocks,
                "num_used_blocks": bm.num_used_blocks, "num_cached_blocks": len(bm.cached),
                "num_requests_holding_blocks": len(bm.req_blocks), "open_requests": aengine.num_unfinished,
                "num_pinned_blocks": engine.kv_transfer.num_pinned_blocks if engine.kv_transfer is not None else 0,
                "num_requests_loading_kv": engine.kv_transfer.num_loading if engine.kv_transfer is not None else 0}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": cfg.served_model_name, "object": "model", "created": 0,
                                            "owned_by": "pdserve", "max_model_len": engine.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        if body.messages is not None:
            ids = engine.encode_chat([{"role": m.role, "content": m.content or ""} for m in body.messages])[
                "prompt_token_ids"]
        elif body.prompt is not None:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise APIError(400, "give either prompt or messages", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        if any(t < 0 or t >= engine.arch.vocab_size for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {engine.arch.vocab_size})", param="tokens")
        return {"prompt": tok.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        params = to_params(body)
        p = body.prompt
        if isinstance(p, str):
            prompts: list[PromptType] = [p]
        elif p and isinstance(p[0], int):
            prompts = [{"prompt_token_ids": p}]
        elif p and isinstance(p[0], list):
            prompts = [{"prompt_token_ids": x} for x in p]  # type: ignore[misc]
        else:
            prompts = list(p)  # type: ignore[arg-type]
        if not prompts:
            raise APIError(400, "prompt must not be empty", param="prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        reqs = make_children(prompts, params, rid, body.kv_transfer_params)
        created, tenant = int(time.time()), tenant_of(body, raw)

        def echo_text(i: int) -> str:
            r = reqs[i]
            return (r.prompt if r.prompt is not None else tok.decode(r.prompt_token_ids)) if body.echo else ""

        if body.stream:
            async def chunks() -> AsyncIterator[dict[str, Any]]:
                started: set[int] = set()
                async for i, out in stream_all(reqs, tenant):
                    c = out.outputs[0]
                    text = c.delta_text
                    if i not in started:
                        started.add(i)
                        text = echo_text(i) + text
                    lps = None
                    if body.logprobs is not None and c.delta_logprobs:
                        lps = completion_logprobs(c.delta_logprobs, 0)
                    if not text and not c.finished and lps is None:
                        continue
                    yield {"id": rid, "object": "text_completion", "created": created, "model": cfg.served_model_name,
                           "choices": [{"index": i, "text": text, "logprobs": lps, "finish_reason": c.finish_reason,
                                        "stop_reason": c.stop_reason}]}
                if body.stream_options and body.stream_options.include_usage:
                    yield {"id": rid, "object": "text_completion", "created": created,
                           "model": cfg.served_model_name, "choices": [], "usage": usage(reqs)}

            return StreamingResponse(sse_stream(chunks()), media_type="text/event-stream")

        outs = await collect(reqs, tenant, raw)
        choices = []
        for i, out in enumerate(outs):
            c = out.outputs[0]
            prefix = echo_text(i)
            lps = completion_logprobs(c.logprobs or [], len(prefix)) if body.logprobs is not None else None
            choices.append({"index": i, "text": prefix + c.text, "logprobs": lps, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason})
        resp: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created,
                                "model": cfg.served_model_name, "choices": choices, "usage": usage(reqs),
                                **kv_response(reqs)}
        if body.return_timings:
            resp["pdserve_timings"] = timings(reqs)
        return JSONResponse(resp)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        params = to_params(body)
        try:
            prompt = engine.encode_chat(body.plain_messages(), body.add_generation_prompt)
        except Exception as e:  # a template that rejects the conversation (e.g. roles out of order)
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from e
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        reqs = make_children([prompt], params, rid, body.kv_transfer_params)
        created, tenant = int(time.time()), tenant_of(body, raw)
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": cfg.served_model_name}

        if body.stream:
            async def chunks() -> AsyncIterator[dict[str, Any]]:
                for i in range(len(reqs)):
                    yield {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]}
                async for i, out in stream_all(reqs, tenant):
                    c = out.outputs[0]
                    lps = None
                    if body.logprobs and c.delta_logprobs:
                        lps = chat_logprobs(c.delta_logprobs)
                    if not c.delta_text and not c.finished and lps is None:
                        continue
                    delta = {"content": c.delta_text} if c.delta_text or not c.finished else {}
                    yield {**base, "choices": [{"index": i, "delta": delta, "logprobs": lps,
                                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
                if body.stream_options and body.stream_options.include_usage:
                    yield {**base, "choices": [], "usage": usage(reqs)}

            return StreamingResponse(sse_stream(chunks()), media_type="text/event-stream")

        outs = await collect(reqs, tenant, raw)
        choices = []
        for i, out in enumerate(outs):
            c = out.outputs[0]
            choices.append({"index": i, "message": {"role": "assistant", "content": c.text},
                            "logprobs": chat_logprobs(c.logprobs or []) if body.logprobs else None,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        resp = {"id": rid, "object": "chat.completion", "created": created, "model": cfg.served_model_name,
                "choices": choices, "usage": usage(reqs), **kv_response(reqs)}
        if body.return_timings:
            resp["pdserve_timings"] = timings(reqs)
        return JSONResponse(resp)

    return app


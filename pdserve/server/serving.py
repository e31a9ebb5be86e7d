"""The serving layer shared by the OpenAI endpoints, usable without HTTP (tests drive it directly).

One API request fans out into child engine requests (`LLMEngine.make_requests`: several prompts, n > 1), ids
`<id>-<prompt>-<sample>`; choice index = prompt * n + sample. A serving object validates the body, makes the
children, then either collects them (a response dict) or streams them (an iterator of SSE `data:` lines). A child
that fails ends the whole API request with a 500 whose body `code` is the child's ErrorCode.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pdserve.engine.engine import LLMEngine, PromptType
from pdserve.engine.request import Request as EngineRequest
from pdserve.errors import ErrorCode, RequestRejected
from pdserve.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams
from pdserve.server.async_engine import AsyncEngine, EngineDead, QueueFull
from pdserve.server.errors import APIError
from pdserve.server.metrics import Metrics
from pdserve.server.protocol import ChatCompletionRequest, CompletionRequest

request_log = logging.getLogger("pdserve.requests")

# What a non-streaming call returns (the JSON body) or a streaming one (SSE lines, ending with `data: [DONE]`).
ServingResult = dict[str, Any] | AsyncIterator[str]


@dataclass(frozen=True)
class RequestContext:
    """What the serving layer needs from the HTTP request besides its body."""

    tenant: str | None = None  # X-Tenant header, else the body's `user`; only logged
    is_disconnected: Callable[[], Awaitable[bool]] | None = None  # polled while collecting a non-streamed reply


def sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def child_error(out: RequestOutput) -> APIError:
    """A failed child as the API error: its ErrorCode becomes the body's `code` (the PD router matches on it)."""
    code = out.error_code.value if out.error_code is not None else None
    return APIError(500, out.error or "request failed", "internal_error", code=code, kind="engine")


class OpenAIServing:
    """Fan-out, merged child streams, collection, usage, timings and the per-request log line."""

    _DISCONNECT_POLL_S = 0.25

    def __init__(self, aengine: AsyncEngine, model_name: str, metrics: Metrics | None = None) -> None:
        self.aengine = aengine
        self.model_name = model_name
        self.metrics = metrics
        tok = self.engine.tokenizer
        # token id -> its text, for logprobs (a few hot ids dominate)
        self.token_text: Callable[[int], str] = functools.lru_cache(maxsize=65536)(lambda t: str(tok.decode([t])))

    @property
    def engine(self) -> LLMEngine:
        return self.aengine.engine

    # ---- validation and fan-out ----------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found", kind="not_found")

    @staticmethod
    def to_params(body: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
        try:
            return body.to_sampling_params()
        except ValueError as e:
            raise APIError(400, str(e)) from e

    def make_children(self, prompts: list[PromptType], params: SamplingParams, base_id: str,
                      kv_params: dict[str, Any] | None = None) -> list[EngineRequest]:
        if kv_params and (len(prompts) > 1 or params.n > 1):
            raise APIError(400, "kv_transfer_params needs a single prompt and n=1", param="kv_transfer_params")
        try:
            reqs = self.engine.make_requests(prompts, params, base_id)
        except RequestRejected as e:
            too_long = e.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED
            raise APIError(400, str(e), param=e.param, code=e.code.value,
                           kind="context_length" if too_long else "bad_request") from e
        if kv_params and self.engine.kv_transfer is not None:
            reqs[0].kv_transfer_params = kv_params
        return reqs

    # ---- running the children ------------------------------------------------------------------------------
    async def stream_all(self, reqs: list[EngineRequest],
                         tenant: str | None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Merge the children's output streams as (choice index, output); raises APIError when one fails.
        Closing or cancelling this generator aborts every unfinished child."""
        merged: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(idx: int, req: EngineRequest) -> None:
            try:
                async for out in self.aengine.generate(req):
                    await merged.put((idx, out))
                await merged.put((idx, None))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                await merged.put((idx, e))
                if isinstance(e, asyncio.CancelledError):
                    raise
            finally:
                if req.is_finished:
                    self.log_finished(req, tenant)

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
        try:
            remaining = len(tasks)
            while remaining:
                idx, item = await merged.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, QueueFull):
                    raise APIError(429, str(item), "rate_limit_error", code="too_many_requests", kind="rate_limited")
                elif isinstance(item, EngineDead):
                    raise APIError(500, str(item), "internal_error", kind="engine")
                elif isinstance(item, BaseException):
                    raise item
                elif item.outputs[0].finish_reason == "error":
                    raise child_error(item)
                else:
                    yield idx, item
        finally:
            for t in tasks:
                t.cancel()

    async def collect(self, reqs: list[EngineRequest], ctx: RequestContext) -> list[RequestOutput]:
        """Run the children to completion (non-streaming); abort them if the client goes away."""
        finals: dict[int, RequestOutput] = {}

        async def consume() -> None:
            async for idx, out in self.stream_all(reqs, ctx.tenant):
                if out.finished:
                    finals[idx] = out

        task = asyncio.create_task(consume())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=self._DISCONNECT_POLL_S)
                if not task.done() and ctx.is_disconnected is not None and await ctx.is_disconnected():
                    raise APIError(499, "client disconnected", kind="bad_request")
        finally:
            if not task.done():
                task.cancel()
        task.result()
        return [finals[i] for i in range(len(reqs))]

    async def sse_stream(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        """SSE lines for the chunks; an error mid-stream becomes an error event. Always ends with [DONE]."""
        try:
            async for chunk in chunks:
                yield sse(chunk)
        except APIError as e:
            if self.metrics is not None:
                self.metrics.error(e.kind)
            yield sse(e.body())
        yield sse("[DONE]")

    # ---- response parts ------------------------------------------------------------------------------------
    @staticmethod
    def usage(reqs: list[EngineRequest]) -> dict[str, Any]:
        per_prompt = [r for r in reqs if r.sample_index == 0]  # n samples share one prompt
        prompt = sum(r.num_prompt_tokens for r in per_prompt)
        completion = sum(r.num_output_tokens for r in reqs)
        cached = sum(max(r.num_cached_tokens, 0) for r in per_prompt)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    @staticmethod
    def timings(reqs: list[EngineRequest]) -> list[dict[str, Any]]:
        """pdserve extension `pdserve_timings`: each child's phase times (seconds), by choice index."""
        return [{"index": i, **r.times.as_dict()} for i, r in enumerate(reqs)]

    @staticmethod
    def kv_response(reqs: list[EngineRequest]) -> dict[str, Any]:
        """A prefill instance's hand-off params for the router (vLLM's response field kv_transfer_params)."""
        r = reqs[0]
        if r.kv_transfer_params and r.kv_transfer_params.get("do_remote_decode") and r.kv_transfer_result:
            return {"kv_transfer_params": r.kv_transfer_result}
        return {}

    def final_chunk(self, base: dict[str, Any], reqs: list[EngineRequest],
                    body: CompletionRequest | ChatCompletionRequest) -> dict[str, Any] | None:
        """The stream's last chunk (choices empty), if asked for: usage (stream_options.include_usage) and/or
        pdserve_timings (return_timings). Sent after every choice finished."""
        extra: dict[str, Any] = {}
        if body.stream_options and body.stream_options.include_usage:
            extra["usage"] = self.usage(reqs)
        if body.return_timings:
            extra["pdserve_timings"] = self.timings(reqs)
        return {**base, "choices": [], **extra} if extra else None

    def finish_response(self, resp: dict[str, Any], reqs: list[EngineRequest],
                        body: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
        """Add what every non-streamed reply carries after its choices: usage, hand-off params, timings."""
        resp.update(usage=self.usage(reqs), **self.kv_response(reqs))
        if body.return_timings:
            resp["pdserve_timings"] = self.timings(reqs)
        return resp

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "pdserve", "max_model_len": self.engine.max_model_len}]}

    # ---- request log ---------------------------------------------------------------------------------------
    def log_finished(self, req: EngineRequest, tenant: str | None) -> None:
        """One JSON line per finished child on the `pdserve.requests` logger."""
        t = req.times
        rec: dict[str, Any] = {
            "request_id": req.request_id, "tenant": tenant, "prompt_tokens": req.num_prompt_tokens,
            "output_tokens": req.num_output_tokens, "cached_tokens": max(req.num_cached_tokens, 0),
            "queue_s": t.queue_time, "prefill_s": t.prefill_time, "decode_s": t.decode_time, "ttft_s": t.ttft,
            "tpot_s": t.tpot, "e2e_s": t.e2e, "preemptions": len(t.preemptions),
            "finish_reason": req.status.finish_reason, "error": req.error}
        kv = self.engine.kv_transfer
        if kv is not None:  # PD roles: which instances served it, and the hand-off
            rec["engine_id"] = kv.engine_id
            res = req.kv_transfer_result or {}
            if res.get("do_remote_prefill"):  # prefill side: pinned for a decode instance
                rec["kv_transfer"] = {"pinned_blocks": len(res["remote_block_ids"])}
            elif res:  # decode side: the pull
                rec["kv_transfer"] = {k: res.get(k) for k in ("remote_engine_id", "ok", "bytes", "seconds",
                                                              "num_cached_tokens", "error")}
        request_log.info(json.dumps(rec, ensure_ascii=False))

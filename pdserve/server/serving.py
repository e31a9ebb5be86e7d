"""The serving layer shared by the OpenAI endpoints, usable without HTTP (tests drive it directly).

The engine is reached only through its client (pdserve.engine.client.EngineClient): plain requests in, RequestOutputs
out. One API request fans out into child engine requests (`EngineClient.process_inputs`: several prompts, n > 1), ids
`<id>-<prompt>-<sample>`; choice index = prompt * n + sample. A serving object validates the body (bounds first,
before any work: n, sequences, prompt characters), tokenizes in a worker thread (never on the event loop), admits
the children all or none (429 before the response starts), then either collects them (a response dict) or streams
them (an iterator of SSE `data:` lines). A child that fails ends the whole API request with a 500 whose body
`code` is the child's ErrorCode. Every child writes one request-log line when it finishes, aborts included. Usage,
timings and the log line come from the children's final outputs, never from engine state.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from pdserve.api.errors import ERROR_STATUS, APIError
from pdserve.api.key_limiter import TokenQuota
from pdserve.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPartError,
    plain_messages,
)
from pdserve.api.sse import sse
from pdserve.engine.client import (
    EngineClient,
    EngineDead,
    EngineRequest,
    LoRANotLoaded,
    LoRARequest,
    PromptType,
    QueueFull,
    RequestStream,
    ShuttingDown,
)
from pdserve.errors import ErrorCode, RequestRejected
from pdserve.outputs import RequestOutput
from pdserve.prefix_hash import effective_salt
from pdserve.sampling_params import SamplingParams
from pdserve.server.chat_template import render_chat
from pdserve.server.metrics import Metrics
from pdserve.server.reasoning import get_reasoning_parser
from pdserve.server.tenants import TenantMetrics
from pdserve.server.tool_parser_registry import get_tool_parser
from pdserve.server.tools import ChatTools, ToolPlan
from pdserve.server.tracing import RequestTracer

request_log = logging.getLogger("pdserve.requests")
logger = logging.getLogger("pdserve.server")

PROMPT_CHARS_PER_TOKEN = 16  # default prompt-character bound = this x max_model_len (generous: ~4 is typical)
_MAX_LOGGED_FIELDS = 256  # unknown field names logged once each, up to this many (a client cannot flood the log)
_logged_fields: set[str] = set()

# What a non-streaming call returns (the JSON body) or a streaming one (SSE lines, ending with `data: [DONE]`).
ServingResult = dict[str, Any] | AsyncIterator[str]
# Maps a conversation (plain_messages) to the one the chat template gets, and the tools it gets (a worker thread).
PrepareChat = Callable[[list[dict[str, Any]]], tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]


@dataclass(frozen=True)
class ServingOptions:
    """Bounds checked before any work is done, and the prefix-cache policy (the `serve` options of these names)."""

    max_n: int = 128  # n and best_of
    max_sequences_per_request: int = 256  # prompts x n, the engine requests one API request becomes
    max_prompt_chars: int | None = None  # per prompt or conversation; None: PROMPT_CHARS_PER_TOKEN x max_model_len
    prefix_cache_isolation: Literal["none", "tenant"] = "none"  # tenant: no prefix-cache sharing across tenants
    tool_call_parser: str = "hermes"  # how chat output becomes tool calls (tool_parsers.py)
    reasoning_parser: str | None = None  # how chat output's <think> text becomes reasoning_content (reasoning.py)
    # prompt tokens x (prompt_logprobs + 1) over the request's sequences: each entry is ~70 bytes of JSON and ~700
    # of Python objects while the reply is built (2**17: a 6,241-token prompt at k = 20, ~10 MB of JSON)
    max_prompt_logprob_entries: int = 2**17
    default_chat_template_kwargs: dict[str, Any] | None = None  # --default-chat-template-kwargs: a request's win


@dataclass
class Children:
    """An API request's admitted engine requests, their output streams and, as they arrive, their final outputs
    (same order: choice index)."""

    reqs: list[EngineRequest]
    streams: list[RequestStream]
    finals: dict[int, RequestOutput] = field(default_factory=dict)

    def final_outputs(self) -> list[RequestOutput]:
        return [self.finals[i] for i in range(len(self.reqs))]


@dataclass(frozen=True)
class RequestContext:
    """What the serving layer needs from the HTTP request besides its body."""

    tenant: str | None = None  # X-Tenant header, else the body's `user`: logged, and the cache salt's tenant
    is_disconnected: Callable[[], Awaitable[bool]] | None = None  # polled while collecting a non-streamed reply
    trace_headers: dict[str, str] | None = None  # incoming W3C trace context (traceparent), for OpenTelemetry
    request_id: str | None = None  # the x-request-id header (the client's, sanitized, or generated): logged
    quota: TokenQuota | None = None  # the API key's tokens/min (key_limiter.py), when it has one


def shutting_down(e: Exception) -> APIError:
    return APIError(503, f"{e}; retry on another instance", "service_unavailable", code="server_shutting_down",
                    kind="shutting_down")


def child_error(out: RequestOutput) -> APIError:
    """A failed child as the API error: its ErrorCode becomes the body's `code` (the PD router matches on it)."""
    code = out.error_code
    status, type_, kind = ERROR_STATUS[code] if code is not None else (500, "internal_error", "engine")
    return APIError(status, out.error or "request failed", type_, code=code.value if code else None, kind=kind)


class OpenAIServing:
    """Fan-out, merged child streams, collection, usage, timings and the per-request log line."""

    _DISCONNECT_POLL_S = 0.25

    def __init__(self, client: EngineClient, model_name: str, metrics: Metrics | None = None,
                 options: ServingOptions | None = None) -> None:
        self.client = client
        self.model_name = model_name
        self.metrics = metrics
        self.options = options or ServingOptions()
        # set by the model registry: the version label and config hash every request log line carries, and the
        # per-tenant metrics each finished request feeds
        self.version: str | None = None
        self.config_hash: str | None = None
        self.tenant_metrics: TenantMetrics | None = None
        self.tracer: RequestTracer | None = None  # OpenTelemetry (--otlp-traces-endpoint), set by the registry
        self.model_info = client.model_info
        self.max_prompt_chars = self.options.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * self.model_info.max_model_len
        tok = client.tokenizer
        self.tools = ChatTools(tok, get_tool_parser(self.options.tool_call_parser, tok), client.check_json_schema)
        self.reasoning = get_reasoning_parser(self.options.reasoning_parser)
        # token id -> its text, for logprobs (a few hot ids dominate)
        self.token_text: Callable[[int], str] = functools.lru_cache(maxsize=65536)(lambda t: str(tok.decode([t])))

    # ---- validation and fan-out ----------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name and self.client.lora_request(name) is None:
            raise APIError(404, f"model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found", kind="not_found")

    def served_name(self, name: str | None) -> str:
        """The name a reply carries: the LoRA adapter's when the request named one, else the model's."""
        return name if name is not None and self.client.lora_request(name) is not None else self.model_name

    def check_body(self, body: CompletionRequest | ChatCompletionRequest, num_prompts: int) -> None:
        """Checks that cost nothing, before any work: the model, fields that cannot be honoured, the fan-out
        bounds (a request that can never fit is a 400, not a 429), and stop strings. Logs unknown fields."""
        self.check_model(body.model)
        self.log_unknown_fields(body.model_extra)
        if (field := body.unsupported()) is not None:
            raise APIError(400, f"{field} is not supported by this server", param=field,
                           code=ErrorCode.UNSUPPORTED_PARAMETER.value)
        o, n = self.options, body.num_samples
        for name, value in (("n", n), ("best_of", body.best_of)):
            if value is not None and value > o.max_n:
                raise APIError(400, f"{name} is {value}; this server allows at most {o.max_n} (--max-n)", param=name,
                               code=ErrorCode.INVALID_PARAMETER.value)
        if n >= 1 and num_prompts * n > o.max_sequences_per_request:
            raise APIError(400, f"{num_prompts} prompt(s) x n={n} is {num_prompts * n} sequences; this server "
                           f"allows at most {o.max_sequences_per_request} per request (--max-sequences-per-request)",
                           param="n" if n > 1 else "prompt", code=ErrorCode.INVALID_PARAMETER.value)
        if body.prompt_logprobs is not None and body.stream:  # as vLLM
            raise APIError(400, "prompt_logprobs is not available with stream=true", param="prompt_logprobs",
                           code=ErrorCode.INVALID_PARAMETER.value)
        self.check_texts(body.stop_list, "stop")
        self.check_texts([body.user or ""], "user")
        self.check_texts([body.cache_salt or ""], "cache_salt")

    def check_texts(self, texts: Iterable[str], param: str) -> None:
        """Each text at most max_prompt_chars characters and valid Unicode (JSON may carry lone surrogates)."""
        for t in texts:
            if len(t) > self.max_prompt_chars:
                raise APIError(400, f"{param} is {len(t)} characters; this server accepts at most "
                               f"{self.max_prompt_chars} (--max-prompt-chars)", param=param,
                               code=ErrorCode.CONTEXT_LENGTH_EXCEEDED.value, kind="context_length")
            try:
                t.encode("utf-8")
            except UnicodeEncodeError as e:
                raise APIError(400, f"{param} is not valid Unicode (a lone surrogate at character {e.start})",
                               param=param, code=ErrorCode.INVALID_PROMPT.value) from e

    @staticmethod
    def log_unknown_fields(extra: dict[str, Any] | None) -> None:
        """Unknown fields are accepted (clients send vendor extras) and logged once per field name."""
        for name in extra or ():
            if name not in _logged_fields and len(_logged_fields) < _MAX_LOGGED_FIELDS:
                _logged_fields.add(name)
                logger.warning("ignoring unknown request field %r (logged once per field name)", name)

    @staticmethod
    def to_params(body: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
        """The body's SamplingParams; RequestRejected names the field (the app answers it), any other ValueError
        is a 400 as well."""
        try:
            return body.to_sampling_params()
        except RequestRejected:
            raise
        except ValueError as e:
            raise APIError(400, str(e)) from e

    def cache_salt(self, body: CompletionRequest | ChatCompletionRequest, ctx: RequestContext) -> str | None:
        """The body's cache_salt; with tenant isolation, combined with the tenant (pdserve/prefix_hash.py: the
        router computes the same salt to route by prefix)."""
        return effective_salt(body.cache_salt, ctx.tenant, self.options.prefix_cache_isolation)

    async def in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run tokenizer work (encode, chat templates, large decodes) off the event loop: the HF fast tokenizer
        releases the GIL, so /health and other streams keep going meanwhile."""
        return await asyncio.to_thread(fn, *args)

    async def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                          prepare: PrepareChat | None = None,
                          template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        """Messages through `prepare` and the chat template (in a worker thread) to a token-id prompt; 400 for
        content that is not text, text over the character bound or not valid Unicode, and conversations the
        template rejects. A RequestRejected from `prepare` (bad tools or tool calls) passes through."""
        try:
            plain = plain_messages(messages)
        except ContentPartError as e:
            raise APIError(400, str(e), param=e.param, code=ErrorCode.UNSUPPORTED_PARAMETER.value) from e
        self.check_texts(["".join(m["content"] for m in plain)], "messages")
        prompt: dict[str, Any] = await self.in_thread(self._encode_chat, plain, add_generation_prompt, prepare,
                                                      template_kwargs)
        return prompt

    def _encode_chat(self, plain: list[dict[str, Any]], add_generation_prompt: bool,
                     prepare: PrepareChat | None, template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
        # without a tool plan: no tools, the history's tool calls and results mapped all the same
        plain, tools = prepare(plain) if prepare is not None else self.tools.prepare(plain, ToolPlan())
        defaults = self.options.default_chat_template_kwargs
        if defaults:
            template_kwargs = {**defaults, **(template_kwargs or {})}
        try:
            return render_chat(self.client.tokenizer, plain, add_generation_prompt, tools, template_kwargs)
        except RequestRejected:  # reserved chat_template_kwargs: render_chat's own coded refusal
            raise
        except Exception as e:  # a template that rejects the conversation (e.g. roles out of order)
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from e

    async def start(self, prompts: list[PromptType], params: SamplingParams, base_id: str,
                    body: CompletionRequest | ChatCompletionRequest, ctx: RequestContext) -> Children:
        """Tokenize and validate the children (in a worker thread), then admit them all or none."""
        reqs = await self.in_thread(self.make_children, prompts, params, base_id, body.kv_transfer_params,
                                    self.cache_salt(body, ctx), body.priority, self.client.lora_request(body.model))
        self.check_prompt_logprobs(reqs, params, "prompt_logprobs" if body.prompt_logprobs is not None else "logprobs")
        return self.admit(reqs, ctx)

    def check_prompt_logprobs(self, reqs: list[EngineRequest], params: SamplingParams, param: str) -> None:
        """Bound what scoring the prompts may allocate (RequestRejected, invalid_parameter, naming `param`)."""
        if (k := params.prompt_logprobs) is None:
            return
        tokens = sum(len(r.prompt_token_ids) for r in reqs)
        if (entries := tokens * (k + 1)) > (bound := self.options.max_prompt_logprob_entries):
            raise RequestRejected(
                f"{param}: {tokens} prompt tokens x {k + 1} logprobs each is "
                f"{entries} entries; this server returns at most {bound} (--max-prompt-logprob-entries); ask for "
                "fewer, or score a shorter prompt", param, ErrorCode.INVALID_PARAMETER)

    def admit(self, reqs: list[EngineRequest], ctx: RequestContext) -> Children:
        """Hand made children to the engine, all or none (429 when the waiting queue cannot take them, or when
        the key's tokens/min cannot cover them: each reserves prompt + max_tokens, settled when it finishes)."""
        reserved = self.reserve_tokens(reqs, ctx.quota)
        try:
            streams = self.client.add_requests(reqs, on_finished=lambda out: self.on_finished(out, ctx, reserved),
                                               tenant=ctx.tenant)
        except (QueueFull, ShuttingDown, EngineDead, LoRANotLoaded) as e:
            if ctx.quota is not None and reserved:
                ctx.quota.settle(sum(reserved.values()), 0)  # none admitted: nothing used
            raise self._refusal(e, reqs, ctx) from e
        return Children(reqs, streams)

    def _refusal(self, e: Exception, reqs: list[EngineRequest], ctx: RequestContext) -> APIError:
        if isinstance(e, LoRANotLoaded):  # unloaded between routing and admission
            return APIError(404, str(e.args[0]), param="model", code="model_not_found", kind="not_found")
        if isinstance(e, QueueFull):
            return APIError(429, str(e), "rate_limit_error", code="too_many_requests", kind="rate_limited")
        if isinstance(e, ShuttingDown):
            self.log_refused(reqs, ctx.tenant, "server_shutting_down")
            return shutting_down(e)
        return APIError(500, str(e), "internal_error", kind="engine")

    def reserve_tokens(self, reqs: list[EngineRequest], quota: TokenQuota | None) -> dict[str, int]:
        """The tokens/min each child reserves (its prompt + max_tokens, up to max_model_len), all at once or a
        429."""
        if quota is None:
            return {}
        most = {r.request_id: len(r.prompt_token_ids) + (r.sampling_params.max_tokens or
                                                          self.model_info.max_model_len - len(r.prompt_token_ids))
                for r in reqs}
        want = sum(most.values())
        total = quota.reserve(want)  # may be less: capped at the bucket's size (key_limiter.py)
        shares = {rid: n * total // max(want, 1) for rid, n in most.items()}
        shares[reqs[0].request_id] += total - sum(shares.values())  # the rounding: settled exactly
        return shares

    def make_children(self, prompts: list[PromptType], params: SamplingParams, base_id: str,
                      kv_params: dict[str, Any] | None = None, cache_salt: str | None = None,
                      priority: int = 0, lora_request: LoRARequest | None = None) -> list[EngineRequest]:
        """Tokenize and validate (no engine state touched: safe in a worker thread); RequestRejected when a child
        can never be served. `lora_request`: the adapter the request named in `model` (None: the base model)."""
        return self.client.process_inputs(prompts, params, base_id, cache_salt=cache_salt, priority=priority,
                                          kv_transfer_params=kv_params, lora_request=lora_request)

    # ---- running the children ------------------------------------------------------------------------------
    async def stream_all(self, children: Children) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Merge the children's output streams as (choice index, output); raises APIError when one fails.
        Closing or cancelling this generator aborts every unfinished child."""
        merged: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(idx: int, stream: RequestStream) -> None:
            try:
                async for out in self.client.stream(stream):
                    await merged.put((idx, out))
                await merged.put((idx, None))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                await merged.put((idx, e))
                if isinstance(e, asyncio.CancelledError):
                    raise

        tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(children.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                idx, item = await merged.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, ShuttingDown):
                    raise shutting_down(item)
                elif isinstance(item, EngineDead):
                    raise APIError(500, str(item), "internal_error", kind="engine")
                elif isinstance(item, BaseException):
                    raise item
                elif item.outputs[0].finish_reason == "error":
                    raise child_error(item)
                else:
                    if item.finished:
                        children.finals[idx] = item
                    yield idx, item
        finally:
            for t in tasks:
                t.cancel()
            self.abort_unfinished(children)  # a pump cancelled before it started never aborts its child

    def abort_unfinished(self, children: Children) -> None:
        for i, r in enumerate(children.reqs):
            if i not in children.finals:
                self.client.abort(r.request_id)

    async def collect(self, children: Children, ctx: RequestContext) -> list[RequestOutput]:
        """Run the children to completion (non-streaming); abort them if the client goes away."""

        async def consume() -> None:
            async for _ in self.stream_all(children):
                pass

        task = asyncio.create_task(consume())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=self._DISCONNECT_POLL_S)
                if not task.done() and ctx.is_disconnected is not None and await ctx.is_disconnected():
                    raise APIError(499, "client disconnected", kind="bad_request")
        finally:
            if not task.done():
                task.cancel()
                self.abort_unfinished(children)
        task.result()
        return children.final_outputs()

    def sse_stream(self, chunks: AsyncIterator[dict[str, Any]], children: Children) -> AsyncIterator[str]:
        """SSE lines for the chunks; an error mid-stream becomes an error event. Always ends with [DONE].
        If the response never starts iterating (client gone before its first byte), the children are aborted
        when the iterator is dropped."""
        return self.guarded(self._sse_lines(chunks), children)

    def guarded(self, lines: AsyncIterator[str], children: Children) -> AsyncIterator[str]:
        """`lines` (a response body), with the children aborted if it is dropped before it ends."""
        weakref.finalize(lines, self.abort_unfinished, children).atexit = False
        return lines

    async def _sse_lines(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield sse(chunk)
        except APIError as e:
            if self.metrics is not None:
                self.metrics.error(e.kind)
            yield sse(e.body())
        yield sse("[DONE]")

    # ---- response parts ------------------------------------------------------------------------------------
    def prompt_logprobs(self, out: RequestOutput) -> list[dict[str, Any] | None] | None:
        """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id (a string key): {logprob,
        rank, decoded_token}} for the prompt token and the top k at its position (the prompt token first)."""
        if out.prompt_logprobs is None:
            return None
        res: list[dict[str, Any] | None] = []
        for lp in out.prompt_logprobs:
            if lp is None:
                res.append(None)
                continue
            entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                        "decoded_token": self.token_text(lp.token_id)}}
            for rank, (tid, v) in enumerate(lp.top, 1):
                entry.setdefault(str(tid), {"logprob": v, "rank": rank, "decoded_token": self.token_text(tid)})
            res.append(entry)
        return res

    @staticmethod
    def usage(children: Children) -> dict[str, Any]:
        outs = children.final_outputs()
        per_prompt = [o for r, o in zip(children.reqs, outs) if r.sample_index == 0]  # n samples share one prompt
        prompt = sum(len(o.prompt_token_ids) for o in per_prompt)
        completion = sum(len(o.outputs[0].token_ids) for o in outs)
        cached = sum(o.num_cached_tokens for o in per_prompt)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def timings(self, children: Children) -> list[dict[str, Any]]:
        """pdserve extension `pdserve_timings`: each child's phase times (seconds), by choice index."""
        return [{"index": i, **o.metrics.as_dict(), **self.spec_counts(o)}
                for i, o in enumerate(children.final_outputs())]

    def spec_counts(self, out: RequestOutput) -> dict[str, int]:
        """Speculative decoding: the request's drafted and accepted tokens (nothing while speculation is off)."""
        if not self.model_info.speculative:
            return {}
        return {"spec_draft_tokens": out.num_draft_tokens, "spec_accepted_tokens": out.num_accepted_tokens}

    @staticmethod
    def kv_response(children: Children) -> dict[str, Any]:
        """A prefill instance's hand-off params for the router (vLLM's response field kv_transfer_params)."""
        res = children.finals[0].kv_transfer_result
        if res and res.get("do_remote_prefill"):
            return {"kv_transfer_params": res}
        return {}

    def final_chunk(self, base: dict[str, Any], children: Children,
                    body: CompletionRequest | ChatCompletionRequest) -> dict[str, Any] | None:
        """The stream's last chunk (choices empty), if asked for: usage (stream_options.include_usage) and/or
        pdserve_timings (return_timings). Sent after every choice finished."""
        extra: dict[str, Any] = {}
        if body.stream_options and body.stream_options.include_usage:
            extra["usage"] = self.usage(children)
        if body.return_timings:
            extra["pdserve_timings"] = self.timings(children)
        return {**base, "choices": [], **extra} if extra else None

    def finish_response(self, resp: dict[str, Any], children: Children,
                        body: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
        """Add what every non-streamed reply carries after its choices: usage, hand-off params, timings."""
        resp.update(usage=self.usage(children), **self.kv_response(children))
        if body.return_timings:
            resp["pdserve_timings"] = self.timings(children)
        return resp

    # ---- request log, tenant metrics and trace ------------------------------------------------------------
    def on_finished(self, out: RequestOutput, ctx: RequestContext, reserved: dict[str, int] | None = None) -> None:
        """A child finished (engine thread, its final output): its log line, its tenant's metrics, its trace
        when tracing is on, and its key's tokens/min settled with what it used (`reserved`: by child id)."""
        if ctx.quota is not None and reserved and out.request_id in reserved:
            ctx.quota.settle(reserved[out.request_id], len(out.prompt_token_ids) + len(out.outputs[0].token_ids))
        self.log_finished(out, ctx.tenant, ctx.request_id)
        if self.tenant_metrics is not None:
            self.tenant_metrics.observe_finished(self.model_name, ctx.tenant, out)
        if (tracer := self.tracer) is not None:
            tracer.record(out, ctx.trace_headers, {
                "gen_ai.request.id": out.request_id, "gen_ai.response.model": self.model_name,
                "gen_ai.usage.prompt_tokens": len(out.prompt_token_ids),
                "gen_ai.usage.completion_tokens": len(out.outputs[0].token_ids),
                "gen_ai.response.finish_reasons": [out.outputs[0].finish_reason or ""],
                **({"pdserve.tenant": ctx.tenant} if ctx.tenant else {})})

    def log_refused(self, reqs: list[EngineRequest], tenant: str | None, code: str) -> None:
        """The request-log lines of children refused at admission (cut by shutdown): as log_finished's, empty."""
        for r in reqs:
            request_log.info(json.dumps({
                "request_id": r.request_id, "model": self.model_name, "version": self.version,
                "config_hash": self.config_hash, "tenant": tenant, "prompt_tokens": len(r.prompt_token_ids),
                "output_tokens": 0, "cached_tokens": 0, "finish_reason": "abort", "error": code},
                ensure_ascii=False))

    def log_finished(self, out: RequestOutput, tenant: str | None, x_request_id: str | None = None) -> None:
        """One JSON line per finished child on the `pdserve.requests` logger (and the /v1/stats tenant view)."""
        if tenant is not None and self.metrics is not None:
            self.metrics.live.record_tenant(out, tenant)
        t = out.metrics
        rec: dict[str, Any] = {
            "request_id": out.request_id, "x_request_id": x_request_id, "model": self.model_name,
            "version": self.version, "config_hash": self.config_hash, "tenant": tenant,
            "prompt_tokens": len(out.prompt_token_ids), "output_tokens": len(out.outputs[0].token_ids),
            "cached_tokens": out.num_cached_tokens,
            "queue_s": t.queue_time, "prefill_s": t.prefill_time, "decode_s": t.decode_time, "ttft_s": t.ttft,
            "tpot_s": t.tpot, "e2e_s": t.e2e, "preemptions": len(t.preemptions),
            "finish_reason": out.outputs[0].finish_reason, "error": out.error, **self.spec_counts(out)}
        if found := self.client.explanations(out.request_id):  # timeline and stall causes (explain.py)
            rec["explain"] = {k: v for k, v in found[0].items() if k not in ("request_id", "parent_id", "tenant",
                                                                             "finish_reason")}
        if self.model_info.engine_id is not None:  # PD roles: which instances served it, and the hand-off
            rec["engine_id"] = self.model_info.engine_id
            res = out.kv_transfer_result or {}
            if res.get("do_remote_prefill"):  # prefill side: pinned for a decode instance
                rec["kv_transfer"] = {"pinned_blocks": len(res["remote_block_ids"])}
            elif res:  # decode side: the pull
                rec["kv_transfer"] = {k: res.get(k) for k in ("remote_engine_id", "ok", "bytes", "seconds",
                                                              "num_cached_tokens", "error")}
        request_log.info(json.dumps(rec, ensure_ascii=False))

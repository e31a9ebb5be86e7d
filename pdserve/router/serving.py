"""The PD router's serving object: runs each request's prompt on a prefill instance and its decode on a decode
instance, handing the KV over with vLLM's `kv_transfer_params` (so any pdserve or vLLM NixlConnector pair can sit
behind it). It speaks HTTP to the instances only; the routes in `app.py` parse the client's request and wrap
the result.

    client ──► router ──(body + max_tokens=1, stream=false, kv_transfer_params{do_remote_decode})──► prefill
                      ◄── response.kv_transfer_params {do_remote_prefill, remote_host, remote_block_ids, ...}
                      ──(original body + those kv_transfer_params)──────────────────────────────► decode
               ◄── tokens (SSE or JSON), relayed as they come

Trust: the router signs every kv_transfer_params it sends, to prefill and decode instances alike, with the shared
secret (`kv_transfer_secret`), else this user's default secret (pdserve/kv_transfer/trust.py); instances act on
hand-off params only when signed.

Failures (every wait is bounded by a timeout):
- prefill fails (connection error, 5xx, 429, timeout, its instance turns unhealthy while it runs, or it refuses the
  hand-off params) -> the next healthy prefill instance; unhealthy ones get no new work. When none is left, the
  decode instance computes the prompt itself (`on_prefill_failure=recompute`) or the client gets a 502
  (`on_prefill_failure=fail`). A 4xx from an instance (a bad request) goes back to the client as it is.
- decode fails before any token reached the client -> another decode instance, up to `max_decode_attempts`; the
  retry carries the same kv_transfer_params (the new instance pulls the pinned blocks if they are still there, else
  recomputes them per its own kv_load_failure_policy); after an error with code `kv_transfer_failed` it is retried
  without them (recompute from the prompt); after `kv_transfer_params_rejected` (the instance does not trust the
  params: a secret mismatch) the same instance is asked again without them.
- decode fails after tokens were streamed -> no retry (it would repeat tokens): the stream ends with an OpenAI
  error event and `data: [DONE]`.
- client disconnects -> the upstream HTTP requests are closed, which aborts them in pdserve (prefill or decode).
Requests the hand-off cannot express (several prompts, n > 1) go to a decode instance as they are (colocated), and
so do Anthropic's /v1/messages and /v1/messages/count_tokens (`relay`: the answer, or the SSE stream, byte for
byte; retried on another decode instance only before any byte reached the client).

Streams send nothing before the decode instance's first token: what comes earlier (the chat role chunk) waits and
goes out with it, so a client that stamps TTFT at its first SSE event sees the real time to first token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from pdserve.api.errors import APIError, validation_message
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.api.protocol_messages import CountTokensRequest, MessagesRequest
from pdserve.api.sse import sse
from pdserve.errors import ErrorCode
from pdserve.kv_transfer.trust import sign_kv_transfer_params
from pdserve.router.metrics import RouterMetrics, RouteTrace
from pdserve.router.pool import Attempt, Instance, InstanceFailed, InstanceRegistry, Tries
from pdserve.router.prompt_tokens import PrefixRouting

logger = logging.getLogger("pdserve.router")

T = TypeVar("T")
Disconnected = Callable[[], Awaitable[bool]]  # asks whether the client went away
# passed on to the instances; the W3C trace context too, so both instances' spans join the client's trace
FORWARDED_HEADERS = ("authorization", "x-api-key", "anthropic-version", "anthropic-beta", "x-tenant", "traceparent",
                     "tracestate", "x-request-id")
# the instance cannot use the hand-off params: the next try computes the prompt instead
KV_CODES = (ErrorCode.KV_TRANSFER_FAILED, ErrorCode.KV_TRANSFER_PARAMS_REJECTED)


@dataclass
class RouterConfig:
    prefill: list[str]
    decode: list[str]
    poll_interval: float = 0.5
    connect_timeout: float = 3.0
    prefill_timeout: float = 30.0  # one prefill request, end to end; then the decode instance computes the prompt
    decode_timeout: float = 60.0  # longest silence on a decode stream (or a whole non-streaming decode)
    max_decode_attempts: int = 2
    on_prefill_failure: str = "recompute"  # recompute | fail
    kv_transfer_secret: str | None = field(default=None, repr=False)  # signs kv_transfer_params; never logged
    max_body_bytes: int = 8 * 2**20  # larger request bodies get a 413 before they are read
    routing: str = "prefix"  # prefix | least-loaded (router/prefix.py)
    tokenizer: str | None = None  # the model's tokenizer directory, to route text and chat prompts by prefix
    prefix_load_cost: float = 256.0  # prompt tokens one request on an instance is worth (router/prefix.py)
    prefix_pending_ttl: float = 10.0  # seconds routed blocks count as on their instance before it publishes them
    prefix_disk_cost: float = 0.1  # a prompt token read from an instance's disk tier, in tokens computed
    instance_api_key: str | None = field(default=None, repr=False)  # the instances' --api-key, for /metrics polls

    def __post_init__(self) -> None:
        if self.routing not in ("prefix", "least-loaded"):
            raise ValueError("routing must be prefix or least-loaded")
        if min(self.prefix_load_cost, self.prefix_pending_ttl, self.prefix_disk_cost) < 0:
            raise ValueError("prefix_load_cost, prefix_pending_ttl and prefix_disk_cost must be >= 0")
        if not self.decode:
            raise ValueError("the router needs at least one decode instance (--decode URL)")
        if self.on_prefill_failure not in ("recompute", "fail"):
            raise ValueError("on_prefill_failure must be recompute or fail")
        if min(self.poll_interval, self.connect_timeout, self.prefill_timeout, self.decode_timeout) <= 0:
            raise ValueError("poll_interval and the timeouts must be > 0")
        if self.max_decode_attempts < 1 or self.max_body_bytes < 1:
            raise ValueError("max_decode_attempts and max_body_bytes must be >= 1")
        self.prefill = [u.rstrip("/") for u in self.prefill]
        self.decode = [u.rstrip("/") for u in self.decode]


def upstream_error(message: str) -> APIError:
    """A failure the router reports itself: no instance could serve the request (502)."""
    return APIError(502, message, "server_error", kind="upstream")


class UpstreamRejected(Exception):
    """An instance refused the request itself (4xx other than 429): no other instance would take it either."""

    def __init__(self, status: int, content: bytes) -> None:
        super().__init__(f"upstream answered {status}")
        self.status, self.content = status, content

    def as_api_error(self) -> APIError:
        """The instance's error as it answered it (its OpenAI body when it sent one)."""
        try:
            err = json.loads(self.content)["error"]
            return APIError(self.status, str(err.get("message")), str(err.get("type", "invalid_request_error")),
                            code=error_code(err), kind="upstream")
        except (ValueError, KeyError, TypeError, AttributeError):
            return APIError(self.status, self.content.decode(errors="replace")[:500], kind="upstream")


class ClientDisconnected(Exception):
    pass


@dataclass
class RoutedResponse:
    """A non-streaming answer: the bytes go to the client as they are (JSON unless empty)."""

    status: int
    content: bytes


def parse_body(path: str, raw: bytes) -> dict[str, Any]:
    """The client's JSON body, checked against the server's request schema so that a bad body gets the server's
    400 here (never a 500, never an upstream call). The body is forwarded as sent (fields the schema does not know
    included), but with `n` and `stream` in the types the router acts on."""
    try:
        body = json.loads(raw)
    except ValueError as exc:  # also bad UTF-8
        raise APIError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    try:
        req = REQUEST_SCHEMAS[path].model_validate(body)
    except ValidationError as exc:
        raise validation_message(RequestValidationError(exc.errors())) from None
    for key in ("n", "stream"):
        if key in body:
            body[key] = getattr(req, key)
    return body


REQUEST_SCHEMAS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
    "/v1/messages": MessagesRequest, "/v1/messages/count_tokens": CountTokensRequest}


def error_code(error: Any) -> str | None:
    """The `code` of an OpenAI error object (`{"message", "type", "code"}`), when it is a string."""
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def check_upstream(status: int, content: bytes) -> None:
    """Raise unless `status` is 200: UpstreamRejected for a bad request, InstanceFailed for what another instance
    may serve (5xx, 429), with the error body's code."""
    if status == 200:
        return
    try:
        code = error_code(json.loads(content).get("error"))
    except (ValueError, AttributeError):
        code = None
    if 400 <= status < 500 and status != 429 and code != ErrorCode.KV_TRANSFER_PARAMS_REJECTED:
        raise UpstreamRejected(status, content)
    raise InstanceFailed(f"answered {status}: {content[:300].decode(errors='replace')}", code)


def is_disaggregatable(path: str, body: dict[str, Any]) -> bool:
    """One prompt, one sample: what the prefill -> decode hand-off can express (the body was validated)."""
    if body.get("n") not in (None, 1):
        return False
    if path.endswith("/completions") and "chat" not in path:
        p = body.get("prompt")
        return isinstance(p, str) or (isinstance(p, list) and bool(p) and all(isinstance(x, int) for x in p))
    return True


def prefill_body(body: dict[str, Any], secret: str | None = None) -> dict[str, Any]:
    b = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "logprobs", "top_logprobs",
                                                     "echo", "kv_transfer_params", "max_completion_tokens")}
    params = sign_kv_transfer_params({"do_remote_decode": True, "do_remote_prefill": False}, secret)
    b.update(stream=False, max_tokens=1, kv_transfer_params=params)
    return b


def decode_body(body: dict[str, Any], params: dict[str, Any] | None, secret: str | None = None) -> dict[str, Any]:
    """The client's body for a decode instance: a client's own kv_transfer_params never pass, the router's
    (from the prefill instance) go signed."""
    b = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if params:
        b["kv_transfer_params"] = sign_kv_transfer_params(params, secret)
    return b


def refusal(tr: RouteTrace, exc: UpstreamRejected | APIError | ClientDisconnected,
            anthropic: bool = False) -> RoutedResponse:
    """A request that ended without an answer, as the client's response (noted on its trace): an instance's 4xx
    as it sent it, the router's own error in OpenAI's body (Anthropic's on its routes), 499 for a client gone."""
    if isinstance(exc, UpstreamRejected):
        tr.outcome, tr.error = "error", f"upstream {exc.status}"
        return RoutedResponse(exc.status, exc.content)
    if isinstance(exc, APIError):
        tr.outcome, tr.error = "error", exc.message
        return RoutedResponse(exc.status, json.dumps(exc.anthropic_body() if anthropic else exc.body()).encode())
    tr.outcome = "client_disconnect"
    return RoutedResponse(499, b"")


def has_token(chunk: dict[str, Any]) -> bool:
    for c in chunk.get("choices") or []:
        if c.get("text") or (c.get("delta") or {}).get("content") or c.get("finish_reason"):
            return True
    return False


async def watch_disconnect(coro: Awaitable[T], disconnected: Disconnected | None, every: float = 0.25,
                           inst: Instance | None = None) -> T:
    """Await `coro`, cancelling it (which closes its upstream connections) if the client goes away, or if `inst`
    (the instance it waits on) is found unhealthy meanwhile (InstanceFailed: e.g. a frozen process)."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every)
            if done:
                return task.result()
            if disconnected is not None and await disconnected():
                task.cancel()
                raise ClientDisconnected()
            if inst is not None and not inst.healthy:
                raise InstanceFailed("turned unhealthy while serving the request; abandoned")
    finally:
        if not task.done():
            task.cancel()


class RouterServing:
    """Everything the router does for a request, without HTTP routing: testable against fake instances by passing
    an httpx `transport` (e.g. httpx.MockTransport). `start()` before use, `close()` after."""

    def __init__(self, cfg: RouterConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.cfg = cfg
        self.metrics = RouterMetrics()
        self.prefix = PrefixRouting.from_config(cfg)
        self.registry = InstanceRegistry(cfg.prefill, cfg.decode, self.metrics, cfg.poll_interval,
                                         cfg.instance_api_key, self.prefix.config if self.prefix is not None else None)
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._poller: asyncio.Task[None] | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        assert self._client is not None, "RouterServing.start() was not called"
        return self._client

    async def start(self, poll: bool = True) -> None:
        """Open the HTTP client, poll the instances once and (with `poll`) keep polling in the background."""
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.cfg.decode_timeout,
                                                               connect=self.cfg.connect_timeout),
                                         limits=limits, transport=self._transport)
        if self.cfg.kv_transfer_secret:
            logger.info("signing kv_transfer_params (kv_transfer_secret, else this user's default secret)")
        else:
            logger.warning("no kv_transfer_secret: instances refuse the hand-offs, the decode instances compute "
                           "every prompt")
        await self.registry.poll_once(self._client)
        if poll:
            self._poller = asyncio.create_task(self.registry.poll_forever(self._client))

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self._client is not None:
            await self._client.aclose()

    # ---- entry points --------------------------------------------------------------------------------------
    def new_trace(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> RouteTrace:
        fwd = {k.lower(): v for k, v in headers.items() if k.lower() in FORWARDED_HEADERS}
        trace_id = uuid.uuid4().hex
        if "traceparent" not in fwd:  # one trace per routed request: prefill and decode instance spans join it
            fwd["traceparent"] = f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"
        return RouteTrace(f"router-{trace_id}", path, bool(body.get("stream")), headers=fwd)

    async def complete(self, path: str, body: dict[str, Any], headers: dict[str, str],
                       disconnected: Disconnected | None = None) -> RoutedResponse:
        """A non-streaming request, end to end; errors come back as responses."""
        tr = self.new_trace(path, body, headers)

        async def run() -> RoutedResponse:
            params = await self._handoff(path, body, tr)
            return await self._decode_json(path, body, params, tr)

        try:
            return await watch_disconnect(run(), disconnected)
        except (UpstreamRejected, APIError, ClientDisconnected) as exc:
            return refusal(tr, exc)
        finally:
            tr.finish(self.metrics)

    def stream(self, path: str, body: dict[str, Any], headers: dict[str, str],
               disconnected: Disconnected | None = None) -> AsyncIterator[str]:
        """A streaming request: its SSE events, errors included, ending with `data: [DONE]` (the clock starts now)."""
        return self._stream(path, body, self.new_trace(path, body, headers), disconnected)

    async def _stream(self, path: str, body: dict[str, Any], tr: RouteTrace,
                      disconnected: Disconnected | None) -> AsyncIterator[str]:
        try:
            params = await watch_disconnect(self._handoff(path, body, tr), disconnected)
            # aclosing: a client that goes away closes the upstream stream now (which aborts it there)
            async with aclosing(self._decode_stream(path, body, params, tr)) as events:
                async for event in events:
                    yield event
        except (APIError, UpstreamRejected) as exc:
            err = exc if isinstance(exc, APIError) else exc.as_api_error()
            tr.outcome, tr.error = "error", err.message
            yield sse(err.body())
            yield sse("[DONE]")
        except ClientDisconnected:
            tr.outcome = "client_disconnect"
        except (asyncio.CancelledError, GeneratorExit):
            tr.outcome = "client_disconnect"
            raise
        finally:
            tr.finish(self.metrics)

    async def models(self, headers: dict[str, str] | None = None) -> RoutedResponse:
        """/v1/models of the first decode instance that answers (with the client's API key, as requests)."""
        fwd = {k: v for k, v in (headers or {}).items() if k.lower() in FORWARDED_HEADERS}
        for attempt in Tries(self.registry.decode, log_prefix="/v1/models: "):
            with attempt as inst:
                r = await self.client.get(inst.url + "/v1/models", headers=fwd, timeout=self.cfg.connect_timeout + 2)
                if r.status_code == 401:  # the client's key, not the instance: say so
                    return RoutedResponse(401, r.content)
                if r.status_code != 200:
                    raise InstanceFailed(f"answered {r.status_code}")
                return RoutedResponse(200, r.content)
        err = upstream_error("no decode instance answered")
        return RoutedResponse(502, json.dumps(err.body()).encode())

    def health(self) -> tuple[int, dict[str, Any]]:
        ok, pools = self.registry.health()
        return (200 if ok else 503), {"status": "ok" if ok else "unavailable", **pools}

    # ---- stages --------------------------------------------------------------------------------------------
    async def _handoff(self, path: str, body: dict[str, Any], tr: RouteTrace) -> dict[str, Any] | None:
        """The kv_transfer_params for the decode instance, or None: it computes the prompt itself."""
        if self.prefix is not None:  # the prompt's block hashes: both pools choose by them
            tr.prefix = await self.prefix.query(path, body, tr.headers)
        # the pool, not the config: discovered instances (registry.discover) may join after start
        if not (self.registry.prefill.instances and is_disaggregatable(path, body)):
            return None  # sent to a decode instance as it is (colocated)
        params = await self._prefill(path, body, tr)
        if params is None:
            self.metrics.recomputes.inc()
        return params

    async def _prefill(self, path: str, body: dict[str, Any], tr: RouteTrace) -> dict[str, Any] | None:
        """Run the prompt on a prefill instance; None when none could (recompute). Raises APIError or
        UpstreamRejected."""
        pbody = prefill_body(body, self.cfg.kv_transfer_secret)
        timeout = httpx.Timeout(self.cfg.prefill_timeout, connect=self.cfg.connect_timeout)
        tries = Tries(self.registry.prefill, on_retry=self.metrics.retries.labels("prefill").inc,
                      log_prefix=f"request {tr.request_id}: ", query=tr.prefix)
        t0 = time.perf_counter()
        for attempt in tries:
            tr.routed(attempt.inst.role, attempt.reason, attempt.hit_tokens, self.metrics)
            with attempt as inst:
                r = await watch_disconnect(self.client.post(inst.url + path, json=pbody, headers=tr.headers,
                                                            timeout=timeout), None, inst=inst)
                check_upstream(r.status_code, r.content)
                tr.prefill_url, tr.prefill_s = inst.url, time.perf_counter() - t0
                self.metrics.prefill.observe(tr.prefill_s)
                params = r.json().get("kv_transfer_params")
                if params:
                    tr.prefill_engine_id = params.get("remote_engine_id")
                return params or None
        if self.cfg.on_prefill_failure == "fail":
            raise upstream_error(f"no prefill instance could serve the request: {tries.last}")
        logger.warning("request %s: no prefill succeeded (%s); the decode instance computes the prompt",
                       tr.request_id, tries.last)
        return None

    def _decode_tries(self, tr: RouteTrace,
                      params: dict[str, Any] | None) -> Iterator[tuple[Attempt, dict[str, Any] | None]]:
        """Decode attempts with the kv_transfer_params each should carry; raises APIError when none is left."""
        tries = Tries(self.registry.decode, self.cfg.max_decode_attempts,
                      on_retry=self.metrics.retries.labels("decode").inc, log_prefix=f"request {tr.request_id}: ",
                      query=tr.prefix)
        for attempt in tries:
            tr.routed(attempt.inst.role, attempt.reason, attempt.hit_tokens, self.metrics)
            if tries.last_code in KV_CODES:
                params = None  # the prefilled KV cannot be pulled: the next instance computes the prompt
            tr.decode_url, tr.decode_attempts = attempt.inst.url, tr.decode_attempts + 1
            tr.recomputed = tr.recomputed or not params
            yield attempt, params
            if params and tries.last_code == ErrorCode.KV_TRANSFER_PARAMS_REJECTED and attempt.failure:
                logger.error("request %s: %s refused the router's kv_transfer_params; is kv_transfer_secret the "
                             "same on the router and the instances? Asking it again without them", tr.request_id,
                             attempt.inst.url)
                params, tr.recomputed, tr.decode_attempts = None, True, tr.decode_attempts + 1
                yield Attempt(attempt.inst, tries), None  # the same instance computes the prompt
        raise upstream_error(f"no decode instance could serve the request: {tries.last}")

    async def _decode_json(self, path: str, body: dict[str, Any], params: dict[str, Any] | None,
                           tr: RouteTrace) -> RoutedResponse:
        for attempt, attempt_params in self._decode_tries(tr, params):
            with attempt as inst:
                dbody = decode_body(body, attempt_params, self.cfg.kv_transfer_secret)
                r = await self.client.post(inst.url + path, json=dbody, headers=tr.headers)
                check_upstream(r.status_code, r.content)
                tr.ttft_s = time.perf_counter() - tr.t0  # non-streaming: the whole answer is the first token
                return RoutedResponse(200, r.content)
        raise AssertionError("unreachable: _decode_tries raises when no instance is left")

    async def _decode_stream(self, path: str, body: dict[str, Any], params: dict[str, Any] | None,
                             tr: RouteTrace) -> AsyncGenerator[str, None]:
        emitted = False  # a token reached the client: from here on a failure cannot be retried
        for attempt, attempt_params in self._decode_tries(tr, params):
            with attempt as inst:
                dbody = decode_body(body, attempt_params, self.cfg.kv_transfer_secret)
                async with self.client.stream("POST", inst.url + path, json=dbody, headers=tr.headers) as resp:
                    if resp.status_code != 200:
                        check_upstream(resp.status_code, await resp.aread())
                    held: list[str] = []  # events before the first token (the chat role chunk) wait for it
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[6:]
                        if data == "[DONE]":
                            for event in held:
                                yield event
                            yield sse("[DONE]")
                            return
                        try:
                            chunk = json.loads(data)
                        except ValueError:
                            raise InstanceFailed(f"sent a malformed event: {data[:200]!r}") from None
                        if "error" in chunk and not emitted:  # failed before any token: try elsewhere
                            err = chunk["error"]
                            raise InstanceFailed(str(err.get("message") if isinstance(err, dict) else err),
                                                 error_code(err))
                        if not emitted and not has_token(chunk):
                            held.append(sse(data))
                            continue
                        if not emitted:
                            emitted = True
                            tr.ttft_s = time.perf_counter() - tr.t0
                            self.metrics.ttft.observe(tr.ttft_s)
                            for event in held:
                                yield event
                            held.clear()
                        yield sse(data)
                    raise InstanceFailed("the stream ended without [DONE]")
            if emitted:
                raise upstream_error(f"the decode instance failed after tokens were streamed ({attempt.failure}); "
                                     "not retried so that no token is repeated")

    # ---- relayed APIs --------------------------------------------------------------------------------------
    async def relay(self, path: str, body: dict[str, Any], headers: dict[str, str],
                    disconnected: Disconnected | None = None) -> AsyncGenerator[RoutedResponse | bytes, None]:
        """An API the hand-off does not carry (Anthropic's /v1/messages and count_tokens): to a decode instance
        as it is (colocated), its answer back byte for byte. Yields one RoutedResponse (a whole answer, or an
        error before any byte of a stream), else the stream's bytes as they come. Another decode instance is
        tried when one fails (connection, 5xx, 429) before a byte reached the client; a 4xx goes back as it is;
        a failure mid-stream ends the stream with an Anthropic `error` event. Router errors in Anthropic's body."""
        tr = self.new_trace(path, body, headers)
        try:
            async with aclosing(self._relay_tries(path, body, tr, disconnected)) as out:
                async for item in out:
                    yield item
        except (UpstreamRejected, APIError, ClientDisconnected) as exc:
            yield refusal(tr, exc, anthropic=True)
        except (asyncio.CancelledError, GeneratorExit):
            tr.outcome = "client_disconnect"
            raise
        finally:
            tr.finish(self.metrics)

    async def _relay_tries(self, path: str, body: dict[str, Any], tr: RouteTrace,
                           disconnected: Disconnected | None) -> AsyncGenerator[RoutedResponse | bytes, None]:
        sent = False  # a byte of the stream reached the client: from here on a failure cannot be retried
        for attempt, _ in self._decode_tries(tr, None):
            with attempt as inst:
                req = self.client.build_request("POST", inst.url + path, json=body, headers=tr.headers)
                resp = await watch_disconnect(self.client.send(req, stream=True), disconnected, inst=inst)
                try:
                    if resp.status_code != 200:
                        check_upstream(resp.status_code, await resp.aread())
                    if not tr.stream:
                        content = await resp.aread()
                        tr.ttft_s = time.perf_counter() - tr.t0
                        yield RoutedResponse(200, content)
                        return
                    async for chunk in resp.aiter_bytes():
                        if not sent:
                            sent, tr.ttft_s = True, time.perf_counter() - tr.t0
                            self.metrics.ttft.observe(tr.ttft_s)
                        yield chunk
                    return
                except httpx.HTTPError as exc:
                    if not sent:
                        raise
                    tr.outcome, tr.error = "error", f"{type(exc).__name__} mid-stream"
                    err = upstream_error(f"the decode instance failed mid-stream ({type(exc).__name__}); not retried")
                    yield sse(err.anthropic_body(), "error").encode()
                    return
                finally:
                    await resp.aclose()

"""PD router: an OpenAI-compatible front that runs each request's prompt on a prefill instance and its decode on a
decode instance, handing the KV over with vLLM's `kv_transfer_params` (so any pdserve or vLLM NixlConnector pair
can sit behind it).

    client ──► router ──(body + max_tokens=1, stream=false, kv_transfer_params{do_remote_decode})──► prefill
                      ◄── response.kv_transfer_params {do_remote_prefill, remote_host, remote_block_ids, ...}
                      ──(original body + those kv_transfer_params)──────────────────────────────► decode
               ◄── tokens (SSE or JSON), relayed as they come

Choice of instance: least loaded by `pdserve:num_requests_running + num_requests_waiting` (each instance's
/metrics, polled every `poll_interval`) plus the router's own requests in flight; ties go round-robin. An instance
that fails a poll or a request is skipped until a poll finds it healthy again.

Failures (every wait is bounded by a timeout):
- prefill fails (connection error, 5xx, 429, timeout) -> the next prefill instance; when none is left, the decode
  instance computes the prompt itself (`on_prefill_failure=recompute`) or the client gets a 502
  (`on_prefill_failure=fail`). A 4xx from a prefill instance (a bad request) goes back to the client as it is.
- decode fails before any token reached the client -> another decode instance, up to `max_decode_attempts`; the
  retry carries the same kv_transfer_params (the new instance pulls the pinned blocks if they are still there, else
  recomputes them per its own kv_load_failure_policy); after an error that names the KV transfer it is retried
  without them (recompute from the prompt).
- decode fails after tokens were streamed -> no retry (it would repeat tokens): the stream ends with an OpenAI
  error event and `data: [DONE]`.
- client disconnects -> the upstream HTTP requests are closed, which aborts them in pdserve (prefill or decode).
Requests the hand-off cannot express (several prompts, n > 1) go to a decode instance as they are (colocated).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger("pdserve.router")
request_log = logging.getLogger("pdserve.requests")

_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
            40.0, 80.0)


@dataclass
class RouterConfig:
    prefill: list[str]
    decode: list[str]
    poll_interval: float = 0.5
    connect_timeout: float = 3.0
    prefill_timeout: float = 300.0  # one prefill request, end to end
    decode_timeout: float = 120.0  # longest silence on a decode stream (or a whole non-streaming decode)
    max_decode_attempts: int = 2
    on_prefill_failure: str = "recompute"  # recompute | fail

    def __post_init__(self) -> None:
        if not self.decode:
            raise ValueError("the router needs at least one decode instance (--decode URL)")
        if self.on_prefill_failure not in ("recompute", "fail"):
            raise ValueError("on_prefill_failure must be recompute or fail")
        self.prefill = [u.rstrip("/") for u in self.prefill]
        self.decode = [u.rstrip("/") for u in self.decode]


@dataclass(eq=False)
class Instance:
    url: str
    role: str
    healthy: bool = True
    load: float = 0.0  # running + waiting, from its /metrics
    inflight: int = 0  # this router's requests on it now


@dataclass
class Pool:
    role: str
    instances: list[Instance]
    _rr: itertools.count = field(default_factory=itertools.count)

    def pick(self, exclude: set[Instance] | None = None) -> Instance | None:
        """Least loaded healthy instance not in `exclude` (unhealthy ones only when no healthy one is left)."""
        exclude = exclude or set()
        cands = [i for i in self.instances if i not in exclude]
        healthy = [i for i in cands if i.healthy]
        cands = healthy or cands
        if not cands:
            return None
        best = min(i.load + i.inflight for i in cands)
        ties = [i for i in cands if i.load + i.inflight == best]
        return ties[next(self._rr) % len(ties)]


class RouterError(Exception):
    def __init__(self, status: int, message: str, type_: str = "server_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": None, "code": self.code or self.status}}


class _Upstream4xx(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"upstream answered {status}")
        self.status, self.content = status, body


@dataclass
class _Trace:
    """What one routed request did, for the log line and metrics."""

    request_id: str
    path: str
    stream: bool
    t0: float = field(default_factory=time.perf_counter)
    prefill_url: str | None = None
    prefill_engine_id: str | None = None
    prefill_s: float | None = None
    decode_url: str | None = None
    decode_attempts: int = 0
    recomputed: bool = False
    ttft_s: float | None = None
    outcome: str = "ok"
    error: str | None = None
    headers: dict[str, str] = field(default_factory=dict)  # forwarded upstream (API key, tenant)

    def log(self) -> None:
        rec = {"request_id": self.request_id, "router": True, "path": self.path, "stream": self.stream,
               "prefill_url": self.prefill_url, "prefill_engine_id": self.prefill_engine_id,
               "prefill_s": self.prefill_s, "decode_url": self.decode_url, "decode_attempts": self.decode_attempts,
               "recomputed": self.recomputed, "ttft_s": self.ttft_s, "e2e_s": time.perf_counter() - self.t0,
               "outcome": self.outcome, "error": self.error}
        request_log.info(json.dumps(rec, ensure_ascii=False))


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pdserve:router_requests", "Routed requests by outcome.", ["outcome"], registry=r)
        self.ttft = Histogram("pdserve:router_time_to_first_token_seconds",
                              "Client-seen TTFT: arrival at the router -> first token relayed (prefill + KV "
                              "hand-off + first decode step).", buckets=_LATENCY, registry=r)
        self.prefill = Histogram("pdserve:router_prefill_seconds", "Prefill request time (incl. queueing there).",
                                 buckets=_LATENCY, registry=r)
        self.e2e = Histogram("pdserve:router_e2e_request_latency_seconds", "Arrival -> last byte relayed.",
                             buckets=_LATENCY, registry=r)
        self.retries = Counter("pdserve:router_retries", "Requests sent again to another instance.", ["stage"],
                               registry=r)
        self.recomputes = Counter("pdserve:router_recomputes", "Requests a decode instance computed from the prompt "
                                  "(no usable prefill hand-off).", registry=r)
        self.up = Gauge("pdserve:router_instance_up", "Instance health as seen by the router's polls.",
                        ["role", "url"], registry=r)
        self.load = Gauge("pdserve:router_instance_load", "Instance load: running + waiting requests.",
                          ["role", "url"], registry=r)
        for o in ("ok", "error", "client_disconnect"):
            self.requests.labels(o)
        for s in ("prefill", "decode"):
            self.retries.labels(s)


def _is_disaggregatable(path: str, body: dict[str, Any]) -> bool:
    if int(body.get("n") or 1) != 1:
        return False
    if path.endswith("/completions") and "chat" not in path:
        p = body.get("prompt")
        return isinstance(p, str) or (isinstance(p, list) and bool(p) and all(isinstance(x, int) for x in p))
    return True


def _prefill_body(path: str, body: dict[str, Any]) -> dict[str, Any]:
    b = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "logprobs", "top_logprobs",
                                                     "echo", "kv_transfer_params", "max_completion_tokens")}
    b.update(stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    return b


def create_router_app(cfg: RouterConfig) -> FastAPI:
    metrics = RouterMetrics()
    prefill_pool = Pool("prefill", [Instance(u, "prefill") for u in cfg.prefill])
    decode_pool = Pool("decode", [Instance(u, "decode") for u in cfg.decode])
    state: dict[str, Any] = {}

    async def poll_once(client: httpx.AsyncClient) -> None:
        async def one(inst: Instance) -> None:
            try:
                r = await client.get(inst.url + "/metrics", timeout=max(cfg.poll_interval, 1.0))
                r.raise_for_status()
                load = 0.0
                for fam in text_string_to_metric_families(r.text):
                    if fam.name in ("pdserve:num_requests_running", "pdserve:num_requests_waiting",
                                    "vllm:num_requests_running", "vllm:num_requests_waiting"):
                        load += sum(s.value for s in fam.samples)
                inst.load, inst.healthy = load, True
            except (httpx.HTTPError, ValueError):
                inst.healthy = False
            metrics.up.labels(inst.role, inst.url).set(1 if inst.healthy else 0)
            metrics.load.labels(inst.role, inst.url).set(inst.load)

        await asyncio.gather(*(one(i) for i in prefill_pool.instances + decode_pool.instances))

    async def poller(client: httpx.AsyncClient) -> None:
        while True:
            try:
                await poll_once(client)
            except Exception:  # noqa: BLE001 - keep polling
                logger.exception("instance poll failed")
            await asyncio.sleep(cfg.poll_interval)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        client = httpx.AsyncClient(timeout=httpx.Timeout(cfg.decode_timeout, connect=cfg.connect_timeout),
                                   limits=limits)
        state["client"] = client
        await poll_once(client)
        task = asyncio.create_task(poller(client))
        yield
        task.cancel()
        await client.aclose()

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    app.state.pools = (prefill_pool, decode_pool)
    app.state.metrics = metrics

    # ---- stages --------------------------------------------------------------------------------------------
    async def run_prefill(path: str, body: dict[str, Any], tr: _Trace) -> dict[str, Any] | None:
        """The decode instance's kv_transfer_params, or None (recompute there). Raises RouterError/_Upstream4xx."""
        client: httpx.AsyncClient = state["client"]
        pbody = _prefill_body(path, body)
        tried: set[Instance] = set()
        last = "no prefill instance configured"
        t0 = time.perf_counter()
        while (inst := prefill_pool.pick(tried)) is not None:
            if tried:
                metrics.retries.labels("prefill").inc()
            tried.add(inst)
            inst.inflight += 1
            try:
                r = await client.post(inst.url + path, json=pbody, headers=tr.headers, timeout=httpx.Timeout(
                    cfg.prefill_timeout, connect=cfg.connect_timeout))
            except httpx.HTTPError as exc:
                inst.healthy = False
                last = f"prefill {inst.url}: {type(exc).__name__}: {exc}"
                logger.warning("request %s: %s", tr.request_id, last)
                continue
            finally:
                inst.inflight -= 1
            if 400 <= r.status_code < 500 and r.status_code != 429:
                raise _Upstream4xx(r.status_code, r.content)
            if r.status_code != 200:
                last = f"prefill {inst.url} answered {r.status_code}: {r.text[:300]}"
                logger.warning("request %s: %s", tr.request_id, last)
                continue
            tr.prefill_url, tr.prefill_s = inst.url, time.perf_counter() - t0
            metrics.prefill.observe(tr.prefill_s)
            params = r.json().get("kv_transfer_params")
            if params:
                tr.prefill_engine_id = params.get("remote_engine_id")
            return params or None
        if cfg.on_prefill_failure == "fail":
            raise RouterError(502, f"no prefill instance could serve the request: {last}")
        logger.warning("request %s: no prefill succeeded (%s); the decode instance computes the prompt",
                       tr.request_id, last)
        return None

    def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
        b = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        if params:
            b["kv_transfer_params"] = params
        return b

    def next_decode(tried: set[Instance], tr: _Trace, params: dict[str, Any] | None) -> Instance | None:
        """The next decode instance to try (least loaded, not tried yet), with the attempt recorded on `tr`."""
        inst = decode_pool.pick(tried)
        if inst is None:
            return None
        if tried:
            metrics.retries.labels("decode").inc()
        tried.add(inst)
        tr.decode_url, tr.decode_attempts = inst.url, tr.decode_attempts + 1
        tr.recomputed = tr.recomputed or not params
        return inst

    async def run_decode_json(path: str, body: dict[str, Any], params: dict[str, Any] | None,
                              tr: _Trace) -> Response:
        client: httpx.AsyncClient = state["client"]
        tried: set[Instance] = set()
        last = "no decode instance"
        for _ in range(cfg.max_decode_attempts):
            inst = next_decode(tried, tr, params)
            if inst is None:
                break
            inst.inflight += 1
            try:
                r = await client.post(inst.url + path, json=decode_body(body, params), headers=tr.headers)
            except httpx.HTTPError as exc:
                inst.healthy = False
                last = f"decode {inst.url}: {type(exc).__name__}: {exc}"
                logger.warning("request %s: %s", tr.request_id, last)
                continue
            finally:
                inst.inflight -= 1
            if r.status_code == 200:
                tr.ttft_s = time.perf_counter() - tr.t0  # non-streaming: the whole answer is the first token
                return Response(r.content, status_code=200, media_type="application/json")
            if 400 <= r.status_code < 500 and r.status_code != 429:
                raise _Upstream4xx(r.status_code, r.content)
            last = f"decode {inst.url} answered {r.status_code}: {r.text[:300]}"
            logger.warning("request %s: %s", tr.request_id, last)
            if "KV transfer" in r.text:
                params = None
        raise RouterError(502, f"no decode instance could serve the request: {last}")

    async def run_decode_stream(path: str, body: dict[str, Any], params: dict[str, Any] | None,
                                tr: _Trace) -> AsyncGenerator[str, None]:
        client: httpx.AsyncClient = state["client"]
        tried: set[Instance] = set()
        last = "no decode instance"
        emitted = False  # a token (not just the chat role chunk) reached the client
        sent_role = False
        for _ in range(cfg.max_decode_attempts):
            inst = next_decode(tried, tr, params)
            if inst is None:
                break
            inst.inflight += 1
            done = False
            last = f"decode {inst.url}: the stream ended without [DONE]"
            try:
                async with client.stream("POST", inst.url + path, json=decode_body(body, params),
                                         headers=tr.headers) as resp:
                    if resp.status_code != 200:
                        content = await resp.aread()
                        if 400 <= resp.status_code < 500 and resp.status_code != 429:
                            raise _Upstream4xx(resp.status_code, content)
                        last = f"decode {inst.url} answered {resp.status_code}: {content[:300]!r}"
                        if b"KV transfer" in content:
                            params = None
                        continue
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[6:]
                        if data == "[DONE]":
                            done = True
                            break
                        chunk = json.loads(data)
                        if "error" in chunk and not emitted:  # failed before any token: try elsewhere
                            last = f"decode {inst.url}: {chunk['error'].get('message')}"
                            if "KV transfer" in last:
                                params = None
                            break
                        has_token = _has_token(chunk)
                        if not has_token and _is_role_chunk(chunk):
                            if sent_role:
                                continue
                            sent_role = True
                        if has_token and tr.ttft_s is None:
                            tr.ttft_s = time.perf_counter() - tr.t0
                            metrics.ttft.observe(tr.ttft_s)
                        emitted = emitted or has_token
                        yield f"data: {data}\n\n"
            except httpx.HTTPError as exc:
                inst.healthy = False
                last = f"decode {inst.url}: {type(exc).__name__}: {exc}"
            finally:
                inst.inflight -= 1
            if done:
                yield "data: [DONE]\n\n"
                return
            logger.warning("request %s: %s", tr.request_id, last)
            if emitted:
                raise RouterError(502, f"the decode instance failed after tokens were streamed ({last}); not retried "
                                  "so that no token is repeated")
        raise RouterError(502, f"no decode instance could serve the request: {last}")

    # ---- endpoints -----------------------------------------------------------------------------------------
    async def route(path: str, raw: Request) -> Response:
        try:
            body = json.loads(await raw.body())
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as exc:
            return JSONResponse(RouterError(400, f"malformed JSON body: {exc}", "invalid_request_error").body(),
                                status_code=400)
        tr = _Trace(f"router-{uuid.uuid4().hex}", path, bool(body.get("stream")),
                    headers={k: v for k, v in raw.headers.items() if k.lower() in ("authorization", "x-tenant")})
        disagg = bool(cfg.prefill) and _is_disaggregatable(path, body)

        async def get_params() -> dict[str, Any] | None:
            if not disagg:
                tr.recomputed = False
                return None
            return await run_prefill(path, body, tr)

        if tr.stream:
            async def sse() -> AsyncIterator[str]:
                try:
                    params = await watch_disconnect(get_params(), raw)
                    if params is None and disagg:
                        metrics.recomputes.inc()
                    # aclosing: a client that goes away closes the upstream stream now (which aborts it there)
                    async with aclosing(run_decode_stream(path, body, params, tr)) as events:
                        async for event in events:
                            yield event
                except (RouterError, _Upstream4xx) as exc:
                    err = exc if isinstance(exc, RouterError) else _as_router_error(exc)
                    tr.outcome, tr.error = "error", err.message
                    yield f"data: {json.dumps(err.body())}\n\n"
                    yield "data: [DONE]\n\n"
                except _Disconnected:
                    tr.outcome = "client_disconnect"
                except (asyncio.CancelledError, GeneratorExit):
                    tr.outcome = "client_disconnect"
                    raise
                finally:
                    finish(tr)

            return StreamingResponse(sse(), media_type="text/event-stream")

        async def whole() -> Response:
            params = await get_params()
            if params is None and disagg:
                metrics.recomputes.inc()
            return await run_decode_json(path, body, params, tr)

        try:
            return await watch_disconnect(whole(), raw)
        except _Upstream4xx as exc:
            tr.outcome, tr.error = "error", f"upstream {exc.status}"
            return Response(exc.content, status_code=exc.status, media_type="application/json")
        except RouterError as exc:
            tr.outcome, tr.error = "error", exc.message
            return JSONResponse(exc.body(), status_code=exc.status)
        except _Disconnected:
            tr.outcome = "client_disconnect"
            return Response(status_code=499)
        finally:
            finish(tr)

    def finish(tr: _Trace) -> None:
        metrics.requests.labels(tr.outcome).inc()
        metrics.e2e.observe(time.perf_counter() - tr.t0)
        if tr.ttft_s is not None and not tr.stream:
            metrics.ttft.observe(tr.ttft_s)
        tr.log()

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await route("/v1/completions", raw)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await route("/v1/chat/completions", raw)

    @app.get("/v1/models")
    async def models() -> Response:
        client: httpx.AsyncClient = state["client"]
        tried: set[Instance] = set()
        while (inst := decode_pool.pick(tried)) is not None:
            tried.add(inst)
            try:
                r = await client.get(inst.url + "/v1/models", timeout=cfg.connect_timeout + 2)
                if r.status_code == 200:
                    return Response(r.content, media_type="application/json")
            except httpx.HTTPError:
                inst.healthy = False
        return JSONResponse(RouterError(502, "no decode instance answered").body(), status_code=502)

    @app.get("/health")
    async def health() -> Response:
        pools = {p.role: [{"url": i.url, "healthy": i.healthy, "load": i.load, "inflight": i.inflight}
                          for i in p.instances] for p in (prefill_pool, decode_pool)}
        ok = any(i.healthy for i in decode_pool.instances)
        return JSONResponse({"status": "ok" if ok else "unavailable", **pools}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(generate_latest(metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


class _Disconnected(Exception):
    pass


async def watch_disconnect(coro: Any, raw: Request, every: float = 0.25) -> Any:
    """Await `coro`, cancelling it (which closes its upstream connections) if the client goes away."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every)
            if done:
                return task.result()
            if await raw.is_disconnected():
                task.cancel()
                raise _Disconnected()
    finally:
        if not task.done():
            task.cancel()


def _as_router_error(exc: _Upstream4xx) -> RouterError:
    try:
        err = json.loads(exc.content)["error"]
        return RouterError(exc.status, str(err.get("message")), str(err.get("type", "invalid_request_error")),
                           err.get("code"))
    except (ValueError, KeyError, TypeError):
        return RouterError(exc.status, exc.content.decode(errors="replace")[:500], "invalid_request_error")


def _has_token(chunk: dict[str, Any]) -> bool:
    for c in chunk.get("choices") or []:
        if c.get("text") or (c.get("delta") or {}).get("content") or c.get("finish_reason"):
            return True
    return False


def _is_role_chunk(chunk: dict[str, Any]) -> bool:
    choices = chunk.get("choices") or []
    return bool(choices) and all("role" in (c.get("delta") or {}) for c in choices)


# ---- command line ------------------------------------------------------------------------------------------
def add_router_parser(sub: Any) -> None:
    p = sub.add_parser("router", help="PD disaggregation router: prefill on one pool, decode on another")
    p.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill instances (pdserve --role prefill)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances (--role decode)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--poll-interval", type=float, default=0.5, help="seconds between /metrics polls")
    p.add_argument("--connect-timeout", type=float, default=3.0)
    p.add_argument("--prefill-timeout", type=float, default=300.0, help="seconds one prefill request may take")
    p.add_argument("--decode-timeout", type=float, default=120.0,
                   help="longest silence on a decode stream (whole non-streaming decode)")
    p.add_argument("--max-decode-attempts", type=int, default=2, help="decode instances tried per request")
    p.add_argument("--on-prefill-failure", choices=["recompute", "fail"], default="recompute",
                   help="when no prefill instance succeeds: the decode instance computes the prompt, or 502")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=_cmd_router)


def _cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    cfg = RouterConfig(prefill=args.prefill, decode=args.decode, poll_interval=args.poll_interval,
                       connect_timeout=args.connect_timeout, prefill_timeout=args.prefill_timeout,
                       decode_timeout=args.decode_timeout, max_decode_attempts=args.max_decode_attempts,
                       on_prefill_failure=args.on_prefill_failure)
    uvicorn.run(create_router_app(cfg), host=args.host, port=args.port, log_level=args.log_level)
    return 0

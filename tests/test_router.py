"""The router's serving object and routes against fake instances (httpx.MockTransport): no pdserve process starts.

Each fake instance answers /metrics (its load) and the OpenAI endpoints with what the test scripts: a prefill
answer with kv_transfer_params, a decode stream, an error body, a broken connection.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from pdserve.errors import ErrorCode
from pdserve.router.app import create_router_app
from pdserve.router.serving import RouterConfig, RouterServing

PARAMS = {"do_remote_prefill": True, "remote_engine_id": "prefill-x", "remote_block_ids": [1, 2],
          "remote_request_id": "r1", "remote_host": "10.0.0.1", "remote_port": 5600}
Handler = Callable[[dict[str, Any]], Awaitable[httpx.Response]]


def sse(*chunks: dict[str, Any] | str) -> bytes:
    return b"".join(f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n".encode() for c in chunks)


def role() -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}


def token(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def error(code: str, message: str = "failed") -> dict[str, Any]:
    return {"error": {"message": message, "type": "internal_error", "param": None, "code": code}}


@dataclass
class Fake:
    """One fake instance: `down` refuses connections; `answer` serves POSTs (default: a short token stream)."""

    url: str
    answer: Handler | None = None
    down: bool = False
    bodies: list[dict[str, Any]] = field(default_factory=list)  # the JSON bodies it received, in order
    request_ids: list[str | None] = field(default_factory=list)  # each POST's x-request-id header


async def tokens_stream(_: dict[str, Any]) -> httpx.Response:
    return httpx.Response(200, content=sse(token("Hello"), token(" world", "length"), "[DONE]"))


def transport(*fakes: Fake) -> httpx.MockTransport:
    by_url = {f.url: f for f in fakes}

    async def handle(request: httpx.Request) -> httpx.Response:
        fake = by_url[f"{request.url.scheme}://{request.url.host}:{request.url.port}"]
        if fake.down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/metrics":
            return httpx.Response(200, text="pdserve:num_requests_running 0\npdserve:num_requests_waiting 0\n")
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        body = json.loads(request.content)
        fake.bodies.append(body)
        fake.request_ids.append(request.headers.get("x-request-id"))
        return await (fake.answer or tokens_stream)(body)

    return httpx.MockTransport(handle)


def serving(prefill: list[Fake], decode: list[Fake], **kw: Any) -> RouterServing:
    cfg = RouterConfig([f.url for f in prefill], [f.url for f in decode], **kw)
    return RouterServing(cfg, transport(*prefill, *decode))


async def prefill_ok(body: dict[str, Any]) -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": PARAMS})


def events_of(raw: list[str]) -> list[Any]:
    out: list[Any] = []
    for ev in raw:
        assert ev.startswith("data: ") and ev.endswith("\n\n"), ev
        data = ev[6:-2]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def run_stream(srv: RouterServing, body: dict[str, Any], path: str = "/v1/completions") -> list[Any]:
    async def go() -> list[str]:
        await srv.start(poll=False)
        try:
            return [ev async for ev in srv.stream(path, body, {})]
        finally:
            await srv.close()

    return events_of(asyncio.run(go()))


def text_of(events: list[Any]) -> str:
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                   for e in events if isinstance(e, dict) for c in e.get("choices", []))


def metrics_text(srv: RouterServing) -> str:
    from prometheus_client import generate_latest

    return generate_latest(srv.metrics.registry).decode()


BODY = {"prompt": "Hi there", "max_tokens": 2, "stream": True}


def test_stream_hands_the_prefill_kv_to_the_decode_instance() -> None:
    pre, dec = Fake("http://p:1", prefill_ok), Fake("http://d:1")
    events = run_stream(serving([pre], [dec]), BODY)
    assert text_of(events) == "Hello world" and events[-1] == "[DONE]"
    assert pre.bodies[0]["max_tokens"] == 1 and pre.bodies[0]["stream"] is False
    assert pre.bodies[0]["kv_transfer_params"]["do_remote_decode"] is True
    assert dec.bodies[0]["kv_transfer_params"] == PARAMS and dec.bodies[0]["max_tokens"] == 2


@pytest.mark.parametrize("incoming", [None, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"])
def test_trace_context_reaches_both_instances(incoming: str | None) -> None:
    """Both instances get one W3C traceparent: the client's, else one the router makes per routed request."""
    seen: list[str | None] = []

    def recorder(fake: Fake) -> Fake:
        answer = fake.answer or tokens_stream

        async def record(body: dict[str, Any]) -> httpx.Response:
            seen.append(body.pop("_traceparent"))
            return await answer(body)

        return Fake(fake.url, record)

    pre, dec = recorder(Fake("http://p:1", prefill_ok)), recorder(Fake("http://d:1"))
    inner = transport(pre, dec)

    async def handle(request: httpx.Request) -> httpx.Response:  # hand the header to the fake with the body
        if request.method == "POST":
            body = {**json.loads(request.content), "_traceparent": request.headers.get("traceparent")}
            request = httpx.Request("POST", request.url, json=body, headers=request.headers)
        return await inner.handle_async_request(request)

    srv = RouterServing(RouterConfig([pre.url], [dec.url]), httpx.MockTransport(handle))

    async def go() -> list[str]:
        await srv.start(poll=False)
        try:
            return [ev async for ev in srv.stream("/v1/completions", BODY,
                                                  {"traceparent": incoming} if incoming else {})]
        finally:
            await srv.close()

    assert text_of(events_of(asyncio.run(go()))) == "Hello world"
    assert len(seen) == 2 and seen[0] == seen[1] and seen[0] is not None
    assert seen[0] == incoming if incoming else len(seen[0].split("-")[1]) == 32


@pytest.mark.parametrize("code", [ErrorCode.KV_TRANSFER_FAILED.value, ErrorCode.MODEL_STEP_FAILED.value])
@pytest.mark.parametrize("how", ["status", "event"])
def test_decode_failure_before_the_first_token_is_retried_elsewhere(code: str, how: str) -> None:
    async def fails(_: dict[str, Any]) -> httpx.Response:
        if how == "status":
            return httpx.Response(500, json=error(code))
        return httpx.Response(200, content=sse(role(), error(code)))  # the role chunk, then the error event

    async def chat_tokens(_: dict[str, Any]) -> httpx.Response:
        delta = {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": "length"}]}
        return httpx.Response(200, content=sse(role(), delta, "[DONE]"))

    pre, bad, good = Fake("http://p:1", prefill_ok), Fake("http://d:1", fails), Fake("http://d:2", chat_tokens)
    srv = serving([pre], [bad, good])
    srv.registry.decode.instances[1].load = 1  # the failing instance is picked first
    events = run_stream(srv, {"messages": [{"role": "user", "content": "Hi"}], "stream": True},
                        "/v1/chat/completions")
    assert [e for e in events if isinstance(e, dict) and "error" in e] == []
    assert events[0] == role() and sum(e == role() for e in events) == 1  # one role chunk: the retry's
    assert text_of(events) == "Hi" and events[-1] == "[DONE]"
    assert len(bad.bodies) == 1 and len(good.bodies) == 1
    # only a failed KV transfer makes the retry compute the prompt itself (matched on the code, not the text)
    assert ("kv_transfer_params" in good.bodies[0]) == (code != ErrorCode.KV_TRANSFER_FAILED)
    assert 'pdserve:router_retries_total{stage="decode"} 1.0' in metrics_text(srv)


def test_decode_failure_after_tokens_ends_with_a_clear_error() -> None:
    async def breaks(_: dict[str, Any]) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            yield sse(token("Hello"), token(" there"))
            raise httpx.ReadError("connection reset")

        return httpx.Response(200, content=body())

    pre, bad, spare = Fake("http://p:1", prefill_ok), Fake("http://d:1", breaks), Fake("http://d:2")
    srv = serving([pre], [bad, spare])
    srv.registry.decode.instances[1].load = 1
    events = run_stream(srv, BODY)
    assert text_of(events) == "Hello there"
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert "after tokens were streamed" in err["message"] and "ReadError" in err["message"]
    assert spare.bodies == []  # not retried: the client already has tokens
    assert 'pdserve:router_requests_total{outcome="error"} 1.0' in metrics_text(srv)


def test_no_healthy_instance() -> None:
    pre, dec = Fake("http://p:1", down=True), Fake("http://d:1", down=True)
    srv = serving([pre], [dec])

    async def go() -> tuple[list[str], Any, tuple[int, dict[str, Any]], Any]:
        await srv.start(poll=False)
        try:
            stream = [ev async for ev in srv.stream("/v1/completions", BODY, {})]
            whole = await srv.complete("/v1/completions", {**BODY, "stream": False}, {})
            return stream, whole, srv.health(), await srv.models()
        finally:
            await srv.close()

    stream, whole, (status, health), models = asyncio.run(go())
    events = events_of(stream)
    assert events[-1] == "[DONE]" and "no decode instance could serve" in events[0]["error"]["message"]
    assert events[0]["error"]["code"] == "upstream_error"
    assert whole.status == 502 and "ConnectError" in json.loads(whole.content)["error"]["message"]
    assert status == 503 and health["status"] == "unavailable" and not health["decode"][0]["healthy"]
    assert models.status == 502
    assert "pdserve:router_recomputes_total 2.0" in metrics_text(srv)  # the prefill pool was down too


def test_nothing_is_sent_before_the_first_token() -> None:
    first_token_sent = asyncio.Event()

    async def slow_first_token(_: dict[str, Any]) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            yield sse(role())  # sent at once by the decode instance
            await asyncio.sleep(0.05)  # the first decode step (and the KV pull)
            first_token_sent.set()
            delta = {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": "length"}]}
            yield sse(delta, "[DONE]")

        return httpx.Response(200, content=body())

    srv = serving([Fake("http://p:1", prefill_ok)], [Fake("http://d:1", slow_first_token)])

    async def go() -> list[tuple[str, bool]]:
        await srv.start(poll=False)
        try:
            body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
            return [(ev, first_token_sent.is_set()) async for ev in srv.stream("/v1/chat/completions", body, {})]
        finally:
            await srv.close()

    got = asyncio.run(go())
    assert all(after_token for _, after_token in got)  # the role chunk waited for the first token
    assert events_of([ev for ev, _ in got])[0] == role()


def test_non_streaming_retry_and_upstream_4xx() -> None:
    async def kv_fails(_: dict[str, Any]) -> httpx.Response:
        return httpx.Response(500, json=error(ErrorCode.KV_TRANSFER_FAILED))

    async def answer(_: dict[str, Any]) -> httpx.Response:
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    async def rejects(_: dict[str, Any]) -> httpx.Response:
        return httpx.Response(400, json=error("invalid_prompt", "prompt too long"))

    pre, bad, good = Fake("http://p:1", prefill_ok), Fake("http://d:1", kv_fails), Fake("http://d:2", answer)
    srv = serving([pre], [bad, good])
    srv.registry.decode.instances[1].load = 1
    body = {"prompt": "Hi", "max_tokens": 2}

    async def go() -> list[Any]:
        await srv.start(poll=False)
        try:
            ok = await srv.complete("/v1/completions", body, {"Authorization": "Bearer k", "Cookie": "c"})
            pre.answer = rejects
            rejected = await srv.complete("/v1/completions", body, {})
            streamed = [ev async for ev in srv.stream("/v1/completions", {**body, "stream": True}, {})]
            return [ok, rejected, streamed]
        finally:
            await srv.close()

    ok, rejected, streamed = asyncio.run(go())
    assert ok.status == 200 and json.loads(ok.content)["choices"][0]["text"] == "ok"
    assert "kv_transfer_params" in bad.bodies[0] and "kv_transfer_params" not in good.bodies[0]
    assert rejected.status == 400 and json.loads(rejected.content)["error"]["code"] == "invalid_prompt"
    events = events_of(streamed)
    assert events[0]["error"]["code"] == "invalid_prompt" and events[1] == "[DONE]"
    assert len(good.bodies) == 1  # the rejected requests never reached a decode instance


@pytest.mark.parametrize("message", ["提示太长了", "bad \ud800 text"])
def test_error_events_are_utf8_as_the_servers(message: str) -> None:
    """The router's SSE events are written by the server's helper (pdserve.api.sse): Chinese goes out as UTF-8
    characters, not \\u escapes; a lone surrogate in an instance's message is escaped so the event still encodes."""
    async def rejects(_: dict[str, Any]) -> httpx.Response:
        content = json.dumps(error("invalid_prompt", message)).encode()  # ASCII JSON carries the surrogate
        return httpx.Response(400, content=content, headers={"content-type": "application/json"})

    srv = serving([Fake("http://p:1", rejects)], [Fake("http://d:1")])

    async def go() -> list[str]:
        await srv.start(poll=False)
        try:
            return [ev async for ev in srv.stream("/v1/completions", BODY, {})]
        finally:
            await srv.close()

    raw = asyncio.run(go())
    raw[0].encode("utf-8")  # what StreamingResponse does with each event
    assert events_of(raw)[0]["error"]["message"] == message
    assert (message in raw[0]) == message.isprintable()  # readable text as it is, the surrogate escaped


def test_router_app_routes() -> None:
    pre, dec = Fake("http://p:1", prefill_ok), Fake("http://d:1")
    cfg = RouterConfig([pre.url], [dec.url], poll_interval=0.05)
    with TestClient(create_router_app(cfg, transport(pre, dec))) as client:
        assert client.get("/health").json()["status"] == "ok"
        assert client.get("/v1/models").json()["data"][0]["id"] == "m"
        r = client.post("/v1/completions", content=b"{not json")
        assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
        with client.stream("POST", "/v1/completions", json=BODY, headers={"x-tenant": "t"}) as resp:
            lines = [ln for ln in resp.iter_lines() if ln]
        assert lines[-1] == "data: [DONE]" and text_of(events_of([ln + "\n\n" for ln in lines])) == "Hello world"
        assert "pdserve:router_time_to_first_token_seconds_count 1.0" in client.get("/metrics").text
        dec.down = True
        r = client.post("/v1/completions", json={**BODY, "stream": False})
        assert r.status_code == 502


def test_router_request_id_is_echoed_forwarded_and_errors_carry_string_codes() -> None:
    pre, dec = Fake("http://p:1", prefill_ok), Fake("http://d:1")
    cfg = RouterConfig([pre.url], [dec.url], poll_interval=0.05)
    with TestClient(create_router_app(cfg, transport(pre, dec))) as client:
        r = client.post("/v1/completions", json={**BODY, "stream": False}, headers={"X-Request-Id": "abc 12<3>"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "abc123"
        assert pre.request_ids == dec.request_ids == ["abc123"]  # one id across the hops
        r = client.post("/v1/completions", json={**BODY, "stream": False})  # none sent: one is made, forwarded
        made = r.headers["x-request-id"]
        assert made.startswith("req_") and pre.request_ids[-1] == dec.request_ids[-1] == made
        dec.down = True
        r = client.post("/v1/completions", json={**BODY, "stream": False}, headers={"X-Request-Id": "x" * 500})
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
        assert r.headers["x-request-id"] == "x" * 128
        r = client.post("/v1/completions", content=b"{not json")
        assert r.json()["error"]["code"] is None and r.headers["x-request-id"].startswith("req_")


# ---- hardening: signed hand-offs, frozen prefill instances, bad bodies ---------------------------------------
def test_router_signs_handoff_params_and_drops_the_clients() -> None:
    from pdserve.kv_transfer.trust import KVTransferTrust

    pre, dec = Fake("http://p:1", prefill_ok), Fake("http://d:1")
    forged = {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 80}
    events = run_stream(serving([pre], [dec], kv_transfer_secret="s3cret"), {**BODY, "kv_transfer_params": forged})
    assert text_of(events) == "Hello world"
    trust = KVTransferTrust.create("s3cret", None)
    assert trust.verify(pre.bodies[0]["kv_transfer_params"])["do_remote_decode"] is True
    sent = trust.verify(dec.bodies[0]["kv_transfer_params"])
    assert {k: v for k, v in sent.items() if k != "signature"} == PARAMS  # the prefill's params, not the client's
    # colocated requests (n > 1) never carry a client's kv_transfer_params either
    run_stream(serving([pre], [dec], kv_transfer_secret="s3cret"), {**BODY, "n": 2, "kv_transfer_params": forged})
    assert "kv_transfer_params" not in dec.bodies[1]


@pytest.mark.parametrize("stream", [False, True])
def test_decode_refusing_the_params_is_asked_again_without_them(stream: bool) -> None:
    async def refuses_signed(body: dict[str, Any]) -> httpx.Response:
        if "kv_transfer_params" in body:  # e.g. a secret mismatch between the router and the instance
            return httpx.Response(400, json=error(ErrorCode.KV_TRANSFER_PARAMS_REJECTED.value))
        return await tokens_stream(body)

    pre, dec = Fake("http://p:1", prefill_ok), Fake("http://d:1", refuses_signed)
    srv = serving([pre], [dec], kv_transfer_secret="s3cret")
    if stream:
        events = run_stream(srv, BODY)
    else:
        async def go() -> Any:
            await srv.start(poll=False)
            try:
                return await srv.complete("/v1/completions", {**BODY, "stream": False}, {})
            finally:
                await srv.close()

        r = asyncio.run(go())
        events = events_of([ev + "\n\n" for ev in r.content.decode().split("\n\n") if ev])
    assert text_of(events) == "Hello world"
    assert len(dec.bodies) == 2 and "kv_transfer_params" not in dec.bodies[1]


def test_frozen_prefill_instance_gets_no_work_and_its_request_is_recomputed() -> None:
    async def frozen(_: dict[str, Any]) -> httpx.Response:  # a SIGSTOPped process: accepts, never answers
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    pre, dec = Fake("http://p:1", frozen), Fake("http://d:1")
    srv = serving([pre], [dec])

    async def go() -> tuple[list[str], list[str], float]:
        await srv.start(poll=False)
        try:
            async def poll_finds_it_frozen() -> None:
                await asyncio.sleep(0.3)
                srv.registry.prefill.instances[0].healthy = False

            t0 = time.perf_counter()
            marker = asyncio.create_task(poll_finds_it_frozen())
            first = [ev async for ev in srv.stream("/v1/completions", BODY, {})]  # waiting on it: abandoned
            await marker
            second = [ev async for ev in srv.stream("/v1/completions", BODY, {})]  # never sent to it
            return first, second, time.perf_counter() - t0
        finally:
            await srv.close()

    first, second, took = asyncio.run(go())
    assert text_of(events_of(first)) == text_of(events_of(second)) == "Hello world"
    assert took < 3 and len(pre.bodies) == 1 and len(dec.bodies) == 2
    assert all("kv_transfer_params" not in b for b in dec.bodies)  # the decode instance computed the prompts
    assert "pdserve:router_recomputes_total 2.0" in metrics_text(srv)


def test_router_app_refuses_bad_bodies_with_openai_errors() -> None:
    pre, dec = Fake("http://p:1", prefill_ok), Fake("http://d:1")
    cfg = RouterConfig([pre.url], [dec.url], poll_interval=0.05, max_body_bytes=4096)
    with TestClient(create_router_app(cfg, transport(pre, dec))) as client:
        cases = [({"prompt": "Hi", "n": "abc"}, "n"), ({"prompt": {"x": 1}}, "prompt"),
                 ({"prompt": "Hi", "max_tokens": "many"}, "max_tokens"), ([1, 2], None), ("text", None)]
        for body, param in cases:
            r = client.post("/v1/completions", json=body)
            err = r.json()["error"]
            assert r.status_code == 400 and err["type"] == "invalid_request_error", (body, r.text)
            assert set(err) == {"message", "type", "param", "code"}
            assert param is None or err["param"].startswith(param)
        r = client.post("/v1/chat/completions", json={"messages": "hi"})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
        r = client.post("/v1/completions", content="{\"prompt\": \"\xff".encode("latin-1"))  # bad UTF-8
        assert r.status_code == 400
        big = json.dumps({"prompt": "你好" * 4096}).encode()
        r = client.post("/v1/completions", content=big)  # declared Content-Length
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
        r = client.post("/v1/completions", content=iter([big[:3000], big[3000:]]))  # chunked, no length
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
        assert r.headers["content-type"] == "application/json"
        assert pre.bodies == [] and dec.bodies == []  # nothing reached an instance
        r = client.post("/v1/completions", json={"prompt": "你好", "n": "1", "stream": "false", "max_tokens": 2})
        assert r.status_code == 200 and pre.bodies[0]["kv_transfer_params"]["do_remote_decode"] is True
        assert client.post("/v1/nothing", json={}).json()["error"]["code"] == "not_found"
        assert 'pdserve:router_request_errors_total{kind="payload_too_large"} 2.0' in client.get("/metrics").text


def test_discovered_instances_join_and_leave_the_pools() -> None:
    """With `registry.discover` (Ray Serve replicas come and go), each poll makes the pools the discovered URLs:
    a kept instance keeps its state, a gone one leaves the pool and its gauges, a new one gets work."""
    a, b, c = Fake("http://a:1"), Fake("http://b:1"), Fake("http://c:1")
    srv = RouterServing(RouterConfig([], [a.url, b.url]), transport(a, b, c))  # c: not configured, discovered
    found = {"prefill": [], "decode": ["http://a:1", "http://b:1"]}

    async def discover() -> dict[str, list[str]]:
        return found

    srv.registry.discover = discover

    async def go() -> list[Any]:
        await srv.start(poll=False)
        try:
            kept = srv.registry.decode.instances[0]
            kept.inflight = 3  # busy: the new instance is the least loaded
            found["decode"] = ["http://a:1", "http://c:1"]
            await srv.registry.poll_once(srv.client)
            assert [i.url for i in srv.registry.decode.instances] == ["http://a:1", "http://c:1"]
            assert srv.registry.decode.instances[0] is kept and kept.inflight == 3
            return [ev async for ev in srv.stream("/v1/completions", BODY, {})]
        finally:
            await srv.close()

    assert text_of(events_of(asyncio.run(go()))) == "Hello world"
    assert len(c.bodies) == 1 and not a.bodies and not b.bodies
    text = metrics_text(srv)
    assert 'url="http://c:1"' in text and 'url="http://b:1"' not in text


def test_a_prefill_instance_discovered_after_start_gets_the_prompts() -> None:
    pre, dec = Fake("http://p:1", answer=prefill_ok), Fake("http://d:1")
    srv = RouterServing(RouterConfig([], [dec.url]), transport(pre, dec))  # no prefill instance at start

    async def discover() -> dict[str, list[str]]:
        return {"prefill": [pre.url], "decode": [dec.url]}

    async def go() -> list[Any]:
        await srv.start(poll=False)
        try:
            srv.registry.discover = discover
            await srv.registry.poll_once(srv.client)
            return [ev async for ev in srv.stream("/v1/completions", BODY, {})]
        finally:
            await srv.close()

    assert text_of(events_of(asyncio.run(go()))) == "Hello world"
    assert pre.bodies[0]["max_tokens"] == 1 and dec.bodies[0]["kv_transfer_params"]["remote_block_ids"]

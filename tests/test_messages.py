"""POST /v1/messages (Anthropic Messages) against a real server on the tiny random model, with the official
`anthropic` client: text, system, streaming events, stop sequences, a forced tool round trip, count_tokens,
refused fields. The same server (it has an API key) also covers the API-wide pieces of issue 30: `x-api-key`,
string error codes and `x-request-id`."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from test_tool_calling import ADD, SCHEMAS, WEATHER  # the chat tool tests' schemas, as Anthropic tools here

from pdserve.launch import ServerProc, free_port, start_pdserve, start_server
from pdserve.server.tools import MAX_PARALLEL_TOOL_CALLS

KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TOOLS: Any = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER},
              {"name": "add", "description": "Add two numbers", "input_schema": ADD}]
ASK: Any = [{"role": "user", "content": "What is the weather in Paris? 用摄氏度"}]
# anthropic 2.x's create() no longer declares temperature / top_p / top_k; the API (and pdserve) still takes them
GREEDY: Any = {"temperature": 0}
SYSTEM, QUESTION = "你是一个乐于助人的助手。", "你好，请介绍一下巴黎。"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[ServerProc]:
    srv = start_server(tmp_path_factory.mktemp("messages"), "--model", str(tiny_dir), "--dtype", "float32",
                       "--num-kv-blocks", "256", "--max-model-len", "2048", "--num-threads", "1", "--api-key", KEY,
                       "--device-peaks", "off")  # no MFU checked here; a busy start would measure the machine
    yield srv
    assert srv.stop() in (0, -15)


@pytest.fixture(scope="module")
def client(server: ServerProc) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(server: ServerProc) -> str:
    return str(httpx.get(server.base_url + "/v1/models", headers=AUTH).json()["data"][0]["id"])


def wait_idle(srv: ServerProc, timeout: float = 10.0) -> None:
    """Every KV block back in the pool, no request open."""
    deadline = time.monotonic() + timeout
    while True:
        kv = httpx.get(srv.base_url + "/debug/kv", headers=AUTH).json()
        if kv["num_used_blocks"] == 0 and kv["open_requests"] == 0:
            return
        assert time.monotonic() < deadline, kv
        time.sleep(0.05)


def text_of(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_text_system_and_the_same_prompt_as_chat(server: ServerProc, client: anthropic.Anthropic,
                                                 model: str) -> None:
    msg = client.messages.create(model=model, max_tokens=12, extra_body=GREEDY, system=SYSTEM,
                                 messages=[{"role": "user", "content": QUESTION}])
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_") and msg.model == model
    assert msg._request_id and msg._request_id.startswith("req_")  # the `request-id` header
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.stop_sequence is None
    assert 0 < msg.usage.output_tokens <= 12 and (msg.usage.output_tokens == 12) == (msg.stop_reason == "max_tokens")
    # rendered and generated exactly as chat: same prompt tokens, same greedy text
    chat = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model=model, max_tokens=12, extra_body=GREEDY, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    assert msg.usage.input_tokens == chat.usage.prompt_tokens
    assert text_of(msg) == chat.choices[0].message.content
    # system as text blocks, content as text blocks: the same prompt
    blocks = client.messages.create(model=model, max_tokens=12, extra_body=GREEDY,
                                    system=[{"type": "text", "text": SYSTEM}],
                                    messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION[:3]},
                                                                           {"type": "text", "text": QUESTION[3:]}]}])
    assert blocks.usage.input_tokens == msg.usage.input_tokens and text_of(blocks) == text_of(msg)
    # top_k reaches the sampler: top_k 1 at temperature 1 is greedy
    top1 = client.messages.create(model=model, max_tokens=12, system=SYSTEM, extra_body={"top_k": 1, "top_p": 0.9},
                                  messages=[{"role": "user", "content": QUESTION}])
    assert text_of(top1) == text_of(msg)
    wait_idle(server)


def test_streaming_events_in_order(server: ServerProc, client: anthropic.Anthropic, model: str) -> None:
    kw: Any = dict(model=model, max_tokens=10, extra_body=GREEDY, messages=ASK)
    whole = client.messages.create(**kw)
    events = list(client.messages.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    body = kinds[1:-2]
    assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
    assert set(body[1:-1]) == {"content_block_delta"}
    start = events[0].message
    assert start.id.startswith("msg_") and start.content == [] and start.stop_reason is None
    assert start.usage.input_tokens == whole.usage.input_tokens
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == text_of(whole)
    delta = events[-2]
    assert delta.delta.stop_reason == whole.stop_reason and delta.usage.output_tokens == whole.usage.output_tokens
    # the SDK's stream helper assembles the same message; the raw stream has `ping` and named events
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert text_of(final) == text_of(whole) and final.stop_reason == whole.stop_reason
    raw = {"model": model, "max_tokens": 10, "temperature": 0, "messages": ASK, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/messages", json=raw, headers={"x-api-key": KEY},
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        names = [ln.removeprefix("event: ") for ln in r.iter_lines() if ln.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    wait_idle(server)


def stop_both_ways(client: anthropic.Anthropic, kw: dict[str, Any], stops: list[str]) -> list[tuple[Any, ...]]:
    """(text, stop_reason, stop_sequence) of the request non-streamed, then streamed."""
    msg = client.messages.create(**kw, stop_sequences=stops)
    events = list(client.messages.create(**kw, stop_sequences=stops, stream=True))
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    return [(text_of(msg), msg.stop_reason, msg.stop_sequence),
            (text, events[-2].delta.stop_reason, events[-2].delta.stop_sequence)]


def test_stop_sequences_ascii_and_chinese(server: ServerProc, client: anthropic.Anthropic, model: str) -> None:
    # ASCII: a piece of the greedy reply ends it right before its first occurrence
    kw: Any = dict(model=model, max_tokens=24, extra_body=GREEDY, messages=[{"role": "user", "content": "Hello"}])
    free = text_of(client.messages.create(**kw))
    stop = free[len(free) // 2:len(free) // 2 + 3]
    assert stop.strip(), free
    for got in stop_both_ways(client, kw, ["never-there", stop]):
        assert got == (free[:free.find(stop)], "stop_sequence", stop), (free, stop)
    # Chinese (the random model writes none of its own): a tool whose schema forces "北京市" into the output, and a
    # stop on its middle character, which is inside a multi-byte token run
    city = {"type": "object", "properties": {"city": {"const": "北京市"}}, "required": ["city"]}
    kw = dict(model=model, max_tokens=60, extra_body=GREEDY, messages=ASK, tools=[
        {"name": "get_weather", "input_schema": city}], tool_choice={"type": "tool", "name": "get_weather"})
    whole = client.messages.create(**kw)
    assert whole.stop_reason == "tool_use" and tool_uses(whole, {"get_weather": city})[0].input == {"city": "北京市"}
    cut = client.messages.create(**kw, stop_sequences=["停", "京"])
    assert cut.usage.output_tokens < whole.usage.output_tokens and cut.content == []  # a cut call is not content
    for text, reason, seq in stop_both_ways(client, kw, ["停", "京"]):
        assert (reason, seq, text) == ("stop_sequence", "京", "")
    wait_idle(server)


def tool_uses(message: Any, schemas: dict[str, Any] = SCHEMAS) -> list[Any]:
    calls = [b for b in message.content if b.type == "tool_use"]
    for c in calls:
        assert c.id.startswith("toolu_") and c.name in schemas
        jsonschema.validate(c.input, schemas[c.name])
    return calls


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"},
                                    {"type": "any", "disable_parallel_tool_use": True}], ids=["tool", "any"])
def test_tool_round_trip(server: ServerProc, client: anthropic.Anthropic, model: str, choice: Any) -> None:
    kw: Any = dict(model=model, max_tokens=120, extra_body=GREEDY, tools=TOOLS, tool_choice=choice)
    first = client.messages.create(**kw, messages=ASK)
    calls = tool_uses(first)
    assert first.stop_reason == "tool_use" and len(calls) == 1 and text_of(first) == ""
    if choice["type"] == "tool":
        assert calls[0].name == "get_weather"
    # streamed: one tool_use block whose input_json_delta is the same input
    events = list(client.messages.create(**kw, messages=ASK, stream=True))
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"] and starts[0].content_block.name == calls[0].name
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(partial) == calls[0].input and events[-2].delta.stop_reason == "tool_use"
    # the result goes back; the model answers (auto: it may call again, never required to)
    history: Any = [*ASK, {"role": "assistant", "content": [c.model_dump() for c in first.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                                  "content": "晴, 21 °C"}]}]
    second = client.messages.create(model=model, max_tokens=8, extra_body=GREEDY, tools=TOOLS, messages=history)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use") and second.content
    counted = client.messages.count_tokens(model=model, tools=TOOLS, messages=history)
    assert counted.input_tokens == second.usage.input_tokens > first.usage.input_tokens + 10
    # the history reached the prompt as chat renders it: the call, then the result as a tool message
    chat_history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": calls[0].id, "type": "function", "function": {"name": calls[0].name,
                                                             "arguments": json.dumps(calls[0].input)}}]},
                    {"role": "tool", "tool_call_id": calls[0].id, "content": "晴, 21 °C"}]
    ids = httpx.post(server.base_url + "/tokenize", json={"messages": chat_history}, headers=AUTH).json()["tokens"]
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": ids}, headers=AUTH).json()["prompt"]
    assert f'<tool_call>\n{{"name": "{calls[0].name}", "arguments": ' in text and "晴, 21 °C" in text
    wait_idle(server)


def test_any_with_parallel_calls_ends(server: ServerProc, client: anthropic.Anthropic, model: str) -> None:
    """tool_choice any, parallel calls allowed (Anthropic's default): the grammar ends the turn after at most
    MAX_PARALLEL_TOOL_CALLS calls, each a tool_use block; no text."""
    msg = client.messages.create(model=model, max_tokens=1500, extra_body=GREEDY, tools=TOOLS, messages=ASK,
                                 tool_choice={"type": "any"})
    assert msg.stop_reason == "tool_use" and text_of(msg) == ""
    assert 1 <= len(tool_uses(msg)) == len(msg.content) <= MAX_PARALLEL_TOOL_CALLS
    wait_idle(server)


def test_count_tokens(server: ServerProc, client: anthropic.Anthropic, model: str) -> None:
    plain = client.messages.count_tokens(model=model, messages=ASK)
    msg = client.messages.create(model=model, max_tokens=1, messages=ASK)
    assert plain.input_tokens == msg.usage.input_tokens > 5
    with_tools = client.messages.count_tokens(model=model, messages=ASK, tools=TOOLS)
    assert with_tools.input_tokens > plain.input_tokens + 50  # the tools prompt
    none = client.messages.count_tokens(model=model, messages=ASK, tools=TOOLS, tool_choice={"type": "none"})
    assert none.input_tokens == plain.input_tokens  # tool_choice none: no tools in the prompt
    system = client.messages.count_tokens(model=model, messages=ASK, system="简短回答。")
    chat = [{"role": "system", "content": "简短回答。"}, *ASK]  # SmolLM2's template has a longer default system
    assert system.input_tokens == len(httpx.post(server.base_url + "/tokenize", json={"messages": chat},
                                                 headers=AUTH).json()["tokens"]) != plain.input_tokens


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"service_tier": "auto"}, "service_tier"),
    ({"container": "c1"}, "container"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    ({"metadata": {"user_id": "u", "team": "t"}}, "metadata.team"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "citations": []}]}]},
     "messages[0].content[0].citations"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{**TOOLS[0], "input_schema": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}]},
     "tools[0].input_schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 0}, "max_tokens"),
]


@pytest.mark.parametrize("extra, name", REFUSED, ids=[r[1] for r in REFUSED])
def test_refused_fields_name_the_field(server: ServerProc, client: anthropic.Anthropic, model: str,
                                       extra: dict[str, Any], name: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:  # sent as they are (the SDK declares only some of them)
        client.messages.create(model=model, max_tokens=4, messages=ASK, extra_body=extra)
    err = e.value.body
    assert isinstance(err, dict) and err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert name in err["error"]["message"], err
    assert e.value.response.headers["x-request-id"]
    wait_idle(server)


def test_missing_max_tokens_auth_and_anthropic_error_bodies(server: ServerProc, model: str) -> None:
    url = server.base_url + "/v1/messages"
    r = httpx.post(url, json={"model": model, "messages": ASK}, headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": model, "max_tokens": 2, "messages": ASK}, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bad = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=model, max_tokens=2, messages=ASK)
    r = httpx.post(url, json={"model": "nope", "max_tokens": 2, "messages": ASK}, headers={"x-api-key": KEY})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    # the OpenAI routes take x-api-key too, and keep OpenAI's body
    r = httpx.post(server.base_url + "/v1/chat/completions", headers={"x-api-key": KEY},
                   json={"model": model, "max_tokens": 2, "messages": ASK})
    assert r.status_code == 200 and r.json()["choices"]


def test_error_codes_are_strings_or_null(server: ServerProc, model: str) -> None:
    """Every error path's body: `code` a string or null, never a number."""
    base = server.base_url
    cases = [  # (method, path, body, headers, status, code)
        ("POST", "/v1/nothing", {}, AUTH, 404, "not_found"),
        ("GET", "/v1/chat/completions", None, AUTH, 405, "method_not_allowed"),
        ("POST", "/v1/chat/completions", {"messages": ASK}, {}, 401, "invalid_api_key"),
        ("POST", "/v1/chat/completions", {"model": "nope", "messages": ASK}, AUTH, 404, "model_not_found"),
        ("POST", "/v1/chat/completions", {"messages": "hi"}, AUTH, 400, None),
        ("POST", "/v1/completions", {"prompt": "x", "tools": [{}]}, AUTH, 400, "unsupported_parameter"),
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 5000}, AUTH, 400, "context_length_exceeded"),
        ("POST", "/v1/completions", {"prompt": "x" * 9_000_000}, AUTH, 413, "payload_too_large"),
        ("GET", "/debug/requests/nope", None, AUTH, 404, "request_not_found"),
    ]
    for method, path, body, headers, status, code in cases:
        r = httpx.request(method, base + path, json=body, headers=headers, timeout=60)
        err = r.json()["error"]
        assert (r.status_code, err["code"]) == (status, code), (path, r.text)
        assert set(err) == {"message", "type", "param", "code"} and r.headers["x-request-id"].startswith("req_")
    wait_idle(server)


def test_request_id_echoed_sanitized_and_logged(server: ServerProc, model: str) -> None:
    oa = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
    r = oa.chat.completions.create(model=model, max_tokens=2, messages=ASK)
    assert r._request_id and r._request_id.startswith("req_")  # type: ignore[attr-defined]
    mine = oa.chat.completions.with_raw_response.create(model=model, max_tokens=2, messages=ASK,
                                                        extra_headers={"X-Request-Id": "trace-42/a b;<c>"})
    assert mine.headers["x-request-id"] == "trace-42/abc"
    long = httpx.post(server.base_url + "/v1/messages", headers={"x-api-key": KEY, "X-Request-Id": "7" * 1000},
                      json={"model": model, "max_tokens": 2, "messages": ASK, "metadata": {"user_id": "团队-7"}})
    assert long.status_code == 200 and long.headers["x-request-id"] == "7" * 128
    empty = httpx.get(server.base_url + "/health", headers={"X-Request-Id": "<<>>"})
    assert re.fullmatch(r"req_[0-9a-f]{32}", empty.headers["x-request-id"])
    wait_idle(server)
    lines = [json.loads(ln[ln.index("{"):]) for ln in server.log().splitlines() if '"x_request_id"' in ln]
    assert {"trace-42/abc", "7" * 128, r._request_id} <= {ln["x_request_id"] for ln in lines}  # type: ignore
    assert [ln["tenant"] for ln in lines if ln["x_request_id"] == "7" * 128] == ["团队-7"]  # metadata.user_id


# ---- through `pdserve router` --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, server: ServerProc) -> Iterator[ServerProc]:
    """A router with this server as its decode instance and a dead one beside it (no prefill pool)."""
    port = free_port()
    dead = f"http://127.0.0.1:{free_port()}"
    srv = start_pdserve(tmp_path_factory.mktemp("messages-router"), "router",
                        ["router", "--port", str(port), "--decode", server.base_url, dead, "--poll-interval", "0.2"],
                        f"http://127.0.0.1:{port}", 60, env={"PDSERVE_INSTANCE_API_KEY": KEY})
    yield srv
    srv.stop()


def test_messages_through_the_router(server: ServerProc, router: ServerProc, client: anthropic.Anthropic,
                                     model: str) -> None:
    """/v1/messages and count_tokens relayed by the router: the same answers, the same named SSE events byte for
    byte, a tool round trip, and the instance's Anthropic errors with their status."""
    via = anthropic.Anthropic(base_url=router.base_url, api_key=KEY, max_retries=0, timeout=120)
    kw: Any = dict(model=model, max_tokens=12, extra_body=GREEDY, system=SYSTEM,
                   messages=[{"role": "user", "content": QUESTION}])
    direct, routed = client.messages.create(**kw), via.messages.create(**kw)
    assert text_of(routed) == text_of(direct) and routed.usage == direct.usage
    assert routed.stop_reason == direct.stop_reason
    events = list(via.messages.create(**kw, stream=True))
    assert [e.type for e in events][:1] == ["message_start"] and events[-1].type == "message_stop"
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text_of(direct)
    raw = {"model": model, "max_tokens": 6, "temperature": 0, "messages": ASK, "stream": True}

    def sse_lines(base: str) -> list[str]:
        with httpx.stream("POST", base + "/v1/messages", json=raw, headers={"x-api-key": KEY}, timeout=60) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            return [re.sub(r'"(msg|toolu)_[0-9a-zA-Z]+"', "ID", ln) for ln in r.iter_lines()]
    assert sse_lines(router.base_url) == sse_lines(server.base_url)  # relayed as the instance wrote it
    # a forced tool call and its result, through the router
    tool_kw: Any = dict(model=model, max_tokens=120, extra_body=GREEDY, tools=TOOLS,
                        tool_choice={"type": "tool", "name": "get_weather"})
    first = via.messages.create(**tool_kw, messages=ASK)
    calls = tool_uses(first)
    assert first.stop_reason == "tool_use" and [c.name for c in calls] == ["get_weather"]
    history: Any = [*ASK, {"role": "assistant", "content": [c.model_dump() for c in first.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                                  "content": "晴, 21 °C"}]}]
    second = via.messages.create(model=model, max_tokens=4, extra_body=GREEDY, tools=TOOLS, messages=history)
    counted = via.messages.count_tokens(model=model, tools=TOOLS, messages=history)
    assert counted.input_tokens == second.usage.input_tokens == \
        client.messages.count_tokens(model=model, tools=TOOLS, messages=history).input_tokens
    # errors: the router's own check (400) and the instance's (401, 404) in Anthropic's body, with their status
    url = router.base_url + "/v1/messages"
    r = httpx.post(url, json={"model": model, "messages": ASK}, headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=router.base_url, api_key="wrong", max_retries=0).messages.create(
            model=model, max_tokens=2, messages=ASK, stream=True)
    r = httpx.post(url, json={"model": "nope", "max_tokens": 2, "messages": ASK, "stream": True},
                   headers={"x-api-key": KEY})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    wait_idle(server)

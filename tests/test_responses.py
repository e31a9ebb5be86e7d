"""POST /v1/responses (OpenAI's Responses API) and GET /v1/models/{id}: the response store and the output builder
without a server, the reasoning item through the serving object on a real engine, and one real server (the tiny
random model) driven by the official openai client and by openai-agents' default (Responses) model.

The tiny model never chooses a tool or stops on its own: tool calls are forced by tool_choice (the grammar), and a
reply completes when a text.format schema ends it. Prompts are checked by comparing greedy replies with the chat
endpoint's for the same conversation (the same template, the same tokens)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel
from test_serving import MODEL, aengine, wait_kv_baseline  # noqa: F401  (aengine: a fixture)

from pdserve.api.protocol_responses import ResponsesRequest, items_to_messages, responses_param
from pdserve.engine.client import EngineClient
from pdserve.errors import ErrorCode, RequestRejected
from pdserve.launch import ServerProc, start_server
from pdserve.server.response_store import ResponseStore, owner_key
from pdserve.server.responses_output import OutputBuilder
from pdserve.server.serving import RequestContext, ServingOptions
from pdserve.server.serving_chat import OpenAIServingChat
from pdserve.server.serving_responses import OpenAIServingResponses

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "摄氏"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS: Any = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
               "parameters": WEATHER, "strict": True}]
CHAT_TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a "
                                                     "city", "parameters": WEATHER}}]
ANSWER = {"type": "object", "properties": {"ok": {"enum": ["是", "no"]}}, "required": ["ok"],
          "additionalProperties": False}
ASK = "巴黎的天气怎么样？"


# ---- no server ----------------------------------------------------------------------------------------------------
def test_store_bounds_expiry_and_owners() -> None:
    now = [0.0]
    store = ResponseStore(max_entries=3, max_bytes=2000, ttl=10.0, clock=lambda: now[0])
    a, b = owner_key("Bearer key-a", None), owner_key("Bearer key-b", None)
    assert a != owner_key("Bearer key-a", "t2") and "key-a" not in a  # the key is kept hashed only
    for i in range(4):  # the fourth pushes the oldest out (count bound)
        assert store.put(a, {"id": f"r{i}"}, [{"text": "x" * 100}])
    assert store.num_entries == 3 and store.get(a, "r0") is None and store.get(a, "r1") is not None
    assert store.get(b, "r1") is None and not store.delete(b, "r1")  # another owner sees nothing
    assert store.put(b, {"id": "big"}, [{"text": "y" * 1500}])  # the byte bound drops the oldest until it fits
    assert store.num_bytes <= 2000 and store.get(a, "r1") is None and store.get(b, "big") is not None
    assert not store.put(a, {"id": "huge"}, [{"text": "z" * 3000}])  # larger than the whole store: not kept
    now[0] = 9.9
    assert store.get(b, "big") is not None
    now[0] = 10.0
    assert store.get(b, "big") is None and store.num_entries == 0 and store.num_bytes == 0  # expired
    assert store.put(a, {"id": "r9"}, []) and store.delete(a, "r9") and store.get(a, "r9") is None
    assert not ResponseStore(max_entries=0).put(a, {"id": "off"}, [])


def test_input_items_map_to_chat_messages() -> None:
    items: Any = [{"role": "developer", "content": "规则"},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                                  {"type": "input_text", "text": "b"}]},
                  {"type": "reasoning", "id": "rs_1", "summary": []},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "t"}]},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                  {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
                  {"type": "function_call_output", "call_id": "c1", "output": "晴"}]
    msgs = items_to_messages(items, "input")
    assert [m["role"] for m in msgs] == ["developer", "user", "assistant", "tool"]
    assert msgs[1]["content"] == "ab" and msgs[2]["content"] == "t" and msgs[3] == {
        "role": "tool", "tool_call_id": "c1", "content": "晴"}
    assert [c["id"] for c in msgs[2]["tool_calls"]] == ["c1", "c2"]
    for bad, param, code in [
            ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input[0].content[0]",
             ErrorCode.UNSUPPORTED_PARAMETER),
            ([{"type": "item_reference", "id": "x"}], "input[0].type", ErrorCode.UNSUPPORTED_PARAMETER),
            ([{"role": "robot", "content": "x"}], "input[0].role", ErrorCode.INVALID_PARAMETER),
            ([{"type": "function_call", "call_id": 3, "name": "f", "arguments": "{}"}], "input[0].call_id",
             ErrorCode.INVALID_PARAMETER)]:
        with pytest.raises(RequestRejected) as e:
            items_to_messages(bad, "input")
        assert (e.value.param, e.value.code) == (param, code)
    assert responses_param("tools[2].function.parameters") == "tools[2].parameters"
    assert responses_param("response_format.json_schema.schema") == "text.format.schema"
    assert responses_param("messages[3].tool_calls") == "input" and responses_param("temperature") == "temperature"
    body = ResponsesRequest(input="hi", instructions="sys", tools=TOOLS, tool_choice="required",
                            text={"format": {"type": "json_schema", "name": "a", "schema": ANSWER}})
    chat = body.chat_request([{"role": "assistant", "content": "before"}])
    assert [m.role for m in chat.messages] == ["system", "assistant", "user"]
    assert chat.tools == CHAT_TOOLS and chat.response_format is None  # forced calls: the tool grammar alone


def test_builder_events_and_items() -> None:
    b = OutputBuilder()
    events = b.feed({"role": "assistant", "content": ""}) + b.feed({"reasoning_content": "想"})
    events += b.feed({"content": "答"}) + b.feed({"content": "案"})
    events += b.feed({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                      "function": {"name": "f", "arguments": ""}}]})
    events += b.feed({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}) + b.close()
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    reasoning, message, call = b.output
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "想"}] and reasoning["id"].startswith("rs_")
    assert message["content"][0]["text"] == "答案" and message["status"] == "completed"
    assert call == {"id": call["id"], "type": "function_call", "status": "completed", "call_id": "call_1",
                    "name": "f", "arguments": '{"a": 1}'}
    whole = OutputBuilder()
    whole.add_message({"reasoning_content": "想", "content": "答案", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]})
    whole.close()
    strip = [{k: v for k, v in it.items() if k != "id"} for it in whole.output]
    assert strip == [{k: v for k, v in it.items() if k != "id"} for it in b.output]  # streamed == whole


def test_reasoning_item_from_the_reasoning_parser(aengine: EngineClient) -> None:  # noqa: F811
    """deepseek_r1 (the reply never closes <think>): the reply is one reasoning item, streamed and not."""
    chat = OpenAIServingChat(aengine, MODEL, options=ServingOptions(reasoning_parser="deepseek_r1"))
    serving = OpenAIServingResponses(chat, ResponseStore())
    plain = OpenAIServingResponses(OpenAIServingChat(aengine, MODEL), ResponseStore())

    async def run(s: OpenAIServingResponses, stream: bool) -> Any:
        body = ResponsesRequest(input="你好，请介绍一下杭州。", max_output_tokens=10, temperature=0, stream=stream)
        out = await s.create(body, RequestContext(), "o")
        if isinstance(out, dict):
            return out
        return [json.loads(line.split("data: ", 1)[1]) async for line in out]

    text = asyncio.run(run(plain, False))["output"][0]["content"][0]["text"]
    resp = asyncio.run(run(serving, False))
    assert [it["type"] for it in resp["output"]] == ["reasoning"] and resp["status"] == "incomplete"
    assert resp["output"][0]["content"][0]["text"] == text and resp["usage"]["output_tokens_details"][
        "reasoning_tokens"] > 0
    events = asyncio.run(run(serving, True))
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == text and events[-1]["type"] == "response.incomplete"
    assert wait_kv_baseline(aengine).num_used_blocks == 0


# ---- one real server, the official client ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[ServerProc]:
    srv = start_server(tmp_path_factory.mktemp("responses"), "--model", str(tiny_dir), "--dtype", "float32",
                       "--num-kv-blocks", "256", "--max-model-len", "2048", "--num-threads", "1",
                       "--admin-api-key", "adm", "--device-peaks", "off")  # no MFU checked here
    yield srv
    assert srv.stop() in (0, -15)


def _client(srv: ServerProc, key: str = "key-a", tenant: str | None = None) -> openai.OpenAI:
    headers = {"X-Tenant": tenant} if tenant else None
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=key, max_retries=0, timeout=120,
                         default_headers=headers)


@pytest.fixture(scope="module")
def client(server: ServerProc) -> openai.OpenAI:
    return _client(server)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(autouse=True)
def kv_back_at_baseline(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each server test: no KV block used and no request open."""
    yield
    if "server" not in request.fixturenames:
        return
    base = request.getfixturevalue("server").base_url
    deadline = time.monotonic() + 10
    while (kv := httpx.get(base + "/debug/kv").json())["num_used_blocks"] or kv["open_requests"]:
        assert time.monotonic() < deadline, kv
        time.sleep(0.05)


def _chat_text(client: openai.OpenAI, model: str, messages: Any, max_tokens: int, **kw: Any) -> Any:
    r = client.chat.completions.create(model=model, messages=messages, temperature=0, max_completion_tokens=max_tokens,
                                       **kw)
    return r.choices[0].message.content, r.usage.prompt_tokens


def test_text_input_and_message_list_match_chat(server: ServerProc, client: openai.OpenAI, model: str) -> None:
    r = client.responses.create(model=model, input=ASK, max_output_tokens=8, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model
    assert (r.output_text, r.usage.input_tokens) == _chat_text(client, model, [{"role": "user", "content": ASK}], 8)
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    if r.status == "incomplete":  # the random model rarely ends on its own
        assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 8
        assert r.output[0].status == "incomplete"
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    items: Any = [{"role": "user", "content": [{"type": "input_text", "text": "你好"}]},
                  {"role": "assistant", "content": "您好！"}, {"role": "user", "content": ASK}]
    r2 = client.responses.create(model=model, input=items, instructions="简短回答。", max_output_tokens=6,
                                 temperature=0, metadata={"k": "v"}, user="u1", include=[], background=False,
                                 truncation="disabled", store=False)
    msgs = [{"role": "system", "content": "简短回答。"}, {"role": "user", "content": "你好"},
            {"role": "assistant", "content": "您好！"}, {"role": "user", "content": ASK}]
    assert (r2.output_text, r2.usage.input_tokens) == _chat_text(client, model, msgs, 6)
    assert r2.instructions == "简短回答。" and r2.metadata == {"k": "v"} and r2.user == "u1" and r2.store is False
    with pytest.raises(openai.NotFoundError):  # store: false keeps nothing
        client.responses.retrieve(r2.id)


def test_streaming_event_order(server: ServerProc, client: openai.OpenAI, model: str) -> None:
    kw: Any = dict(model=model, input=ASK, max_output_tokens=8, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    end = f"response.{whole.status}"
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * (len(types) - 8),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done", end]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == whole.status
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens,
                                                                     whole.usage.output_tokens)
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    assert client.responses.retrieve(final.id).output_text == whole.output_text  # streamed ones are stored too
    # the SDK's own accumulator (it wants response.completed: a schema ends the reply)
    fmt: Any = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}
    with client.responses.stream(**{**kw, "max_output_tokens": 40}, text=fmt) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        got = stream.get_final_response()
    assert got.status == "completed" and "".join(texts) == got.output_text
    jsonschema.validate(json.loads(got.output_text), ANSWER)

    class Answer(BaseModel):
        ok: Literal["是", "no"]

    parsed = client.responses.parse(model=model, input=ASK, text_format=Answer, max_output_tokens=40, temperature=0)
    assert isinstance(parsed.output_parsed, Answer) and parsed.output_parsed.ok in ("是", "no")


def test_function_tool_round_trip(server: ServerProc, client: openai.OpenAI, model: str) -> None:
    kw: Any = dict(model=model, input=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                   temperature=0, max_output_tokens=120)
    first = client.responses.create(**kw)
    assert first.status == "completed" and [o.type for o in first.output] == ["function_call"]
    call = first.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    events = list(client.responses.create(**kw, stream=True))
    args = [e for e in events if e.type.startswith("response.function_call_arguments")]
    assert [e.type for e in args] == ["response.function_call_arguments.delta", "response.function_call_arguments.done"]
    assert args[1].arguments == call.arguments and events[-1].response.output[0].arguments == call.arguments
    # the tool's result goes back as a function_call_output item; the answer is ended by a text.format schema
    history: Any = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
                    {"type": "function_call_output", "call_id": call.call_id, "output": "晴, 21 °C"}]
    fmt: Any = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}
    second = client.responses.create(model=model, input=history, tools=TOOLS, text=fmt, temperature=0,
                                     max_output_tokens=40)
    assert second.status == "completed" and second.output[-1].type == "message"
    jsonschema.validate(json.loads(second.output_text), ANSWER)
    chat_history = [{"role": "user", "content": ASK}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": "晴, 21 °C"}]
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    assert (second.output_text, second.usage.input_tokens) == _chat_text(client, model, chat_history, 40,
                                                                          tools=CHAT_TOOLS, response_format=rf)


def test_previous_response_id_chain_retrieve_delete(server: ServerProc, client: openai.OpenAI, model: str) -> None:
    r1 = client.responses.create(model=model, input="第一句。", instructions="只在第一轮。", max_output_tokens=5,
                                 temperature=0)
    r2 = client.responses.create(model=model, input="第二句。", previous_response_id=r1.id, max_output_tokens=5,
                                 temperature=0)
    r3 = client.responses.create(model=model, input="第三句。", previous_response_id=r2.id, max_output_tokens=5,
                                 temperature=0)
    assert r3.previous_response_id == r2.id
    msgs = [{"role": "user", "content": "第一句。"}, {"role": "assistant", "content": r1.output_text},
            {"role": "user", "content": "第二句。"}, {"role": "assistant", "content": r2.output_text},
            {"role": "user", "content": "第三句。"}]  # the instructions are not carried over
    assert (r3.output_text, r3.usage.input_tokens) == _chat_text(client, model, msgs, 5)
    got = client.responses.retrieve(r1.id)
    assert got.model_dump() == r1.model_dump()
    assert client.responses.delete(r1.id) is None
    for call in (lambda: client.responses.retrieve(r1.id), lambda: client.responses.delete(r1.id),
                 lambda: client.responses.create(model=model, input="x", previous_response_id=r1.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.code == "response_not_found"
    assert client.responses.retrieve(r2.id).id == r2.id  # the rest of the chain stays


def test_store_is_per_key_and_tenant(server: ServerProc, client: openai.OpenAI, model: str) -> None:
    r = client.responses.create(model=model, input="秘密", max_output_tokens=3, temperature=0)
    for other in (_client(server, "key-b"), _client(server, "key-a", tenant="t2")):
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(r.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.create(model=model, input="x", previous_response_id=r.id)
    same = _client(server, "key-a", tenant="t2")
    mine = same.responses.create(model=model, input="t2", max_output_tokens=2, temperature=0)
    assert same.responses.retrieve(mine.id).id == mine.id and client.responses.retrieve(r.id).id == r.id


REFUSED: Any = [
    ({"background": True}, "background", "unsupported_parameter"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "unsupported_parameter"),
    ({"truncation": "auto"}, "truncation", "unsupported_parameter"),
    ({"conversation": "conv_1"}, "conversation", "unsupported_parameter"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "unsupported_parameter"),
    ({"top_logprobs": 3}, "top_logprobs", "unsupported_parameter"),
    ({"service_tier": "flex"}, "service_tier", "unsupported_parameter"),
    ({"max_tool_calls": 2}, "max_tool_calls", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "x"}]}, "messages", "unsupported_parameter"),
    ({"stop": ["x"]}, "stop", "unsupported_parameter"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort", "unsupported_parameter"),
    ({"text": {"verbosity": "high"}}, "text.verbosity", "unsupported_parameter"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "invalid_tool"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name", "invalid_tool"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name",
     "invalid_tool_choice"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice", "invalid_tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "invalid_structured_output"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type", "invalid_structured_output"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0]", "unsupported_parameter"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "unsupported_parameter"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "invalid_parameter"),
    ({"input": None}, "input", "invalid_parameter"),
    ({"max_output_tokens": 5000}, "max_output_tokens", "context_length_exceeded"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id", "response_not_found"),
]


@pytest.mark.parametrize("extra, param, code", REFUSED, ids=[r[1] + "-" + r[2] for r in REFUSED])
def test_refused_fields_name_their_param(server: ServerProc, extra: dict[str, Any], param: str, code: str) -> None:
    body = {"input": "hi", "max_output_tokens": 4, **extra}
    r = httpx.post(server.base_url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == (404 if code == "response_not_found" else 400), r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err


def test_max_output_tokens_must_be_positive(server: ServerProc) -> None:
    r = httpx.post(server.base_url + "/v1/responses", json={"input": "hi", "max_output_tokens": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"


def test_models_retrieve(server: ServerProc, client: openai.OpenAI, model: str) -> None:
    m = client.models.retrieve(model)
    assert m.id == model and m.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.code == "model_not_found"
    r = httpx.put(server.base_url + "/admin/aliases/prod", json={"model": model},
                  headers={"Authorization": "Bearer adm"})
    assert r.status_code == 200, r.text
    alias = client.models.retrieve("prod")
    assert alias.id == "prod" and alias.model_extra["alias_of"] == model
    assert client.responses.create(model="prod", input="hi", max_output_tokens=2).model == model


# ---- openai-agents, its default model type (the Responses API) -------------------------------------------------
@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_openai_agents_runs_an_agent_with_a_function_tool(server: ServerProc, model: str, streamed: bool) -> None:
    import agents

    agents.set_tracing_disabled(True)
    calls: list[dict[str, Any]] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "巴黎"]) -> str:
        """Current weather in a city."""
        calls.append({"city": city})
        return "晴, 21 °C"

    class Answer(BaseModel):
        ok: bool

    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="agent-key", max_retries=0, timeout=120)
    # the random model never calls a tool by itself: `required` makes the grammar call one; after the call the
    # agent resets tool_choice (its default) and the Answer schema ends the reply
    agent = agents.Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather], model=model,
                         output_type=Answer, model_settings=agents.ModelSettings(
                             tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=120))
    config = agents.RunConfig(model_provider=agents.OpenAIProvider(openai_client=client))

    async def run() -> Any:
        if not streamed:
            return await agents.Runner.run(agent, ASK, run_config=config, max_turns=4)
        result = agents.Runner.run_streamed(agent, ASK, run_config=config, max_turns=4)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    assert len(calls) == 1 and isinstance(result.final_output, Answer)
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == "MessageOutputItem"
    assert len(result.raw_responses) == 2


def _aborted(base: str) -> float:
    """Engine requests that finished as aborted, from /metrics."""
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith("pdserve:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_client_gone_mid_stream_aborts_the_request(server: ServerProc, model: str) -> None:
    """A stream dropped after its first delta: its request is aborted, not run to its 1000 tokens (the autouse
    check then waits for the pool to be back at its baseline)."""
    before = _aborted(server.base_url)
    body = {"model": model, "input": ASK, "max_output_tokens": 1000, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/responses", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("event: response.output_text.delta"):
                break
    deadline = time.monotonic() + 30
    while _aborted(server.base_url) < before + 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)

"""Tool calling on /v1/chat/completions: the parsers (no server), the request checks and prompt preparation (the
real tokenizer), and real servers with the official openai client (the tiny random model: `required` and named
tool_choice must still produce calls whose arguments validate; the real SmolLM2 model in the slow tests)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from pdserve.errors import ErrorCode, RequestRejected
from pdserve.launch import ServerProc, start_server
from pdserve.server.tool_parsers import HermesToolParser, JsonToolParser, ToolCall, ToolParser
from pdserve.server.tools import DEFAULT_TOOLS_PROMPT, MAX_PARALLEL_TOOL_CALLS, ChatTools, tool_plan

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit", "摄氏"]}}, "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MSGS: Any = [{"role": "user", "content": "What is the weather in Paris? 用摄氏度"}]


def args(call: ToolCall) -> Any:
    return json.loads(call.arguments)


# ---- parsers ---------------------------------------------------------------------------------------------------
def test_hermes_several_calls_with_text_around() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
            '\n</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\nDone.')
    p = HermesToolParser().parse(text)
    assert [c.name for c in p.tool_calls] == ["get_weather", "add"]
    assert args(p.tool_calls[0]) == {"city": "Paris", "unit": "celsius"} and args(p.tool_calls[1]) == {"a": 1, "b": 2}
    assert p.content == "Let me check.Done."  # whitespace next to calls dropped
    assert all(c.id.startswith("call_") for c in p.tool_calls) and p.tool_calls[0].id != p.tool_calls[1].id
    assert p.tool_calls[0].as_openai()["type"] == "function"


def test_hermes_only_calls_has_no_content_and_chinese_arguments_survive() -> None:
    p = HermesToolParser().parse('<tool_call>{"name": "get_weather", "arguments": {"city": "北京", "unit": "摄氏"}}'
                                 "</tool_call>\n")
    assert p.content is None and len(p.tool_calls) == 1
    assert p.tool_calls[0].arguments == '{"city": "北京", "unit": "摄氏"}'  # non-ASCII kept, not \\u-escaped


@pytest.mark.parametrize("text", [
    'before <tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call> after',  # malformed JSON
    '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
    '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',  # arguments not an object
    'text <tool_call>{"name": "add", "arguments": {"a": 1}}',  # never closed (e.g. max_tokens)
    "plain text with a < sign and <tool_ partial\n",
    "",
])
def test_hermes_not_a_call_stays_content_as_written(text: str) -> None:
    p = HermesToolParser().parse(text)
    assert p.tool_calls == [] and p.content == text


def test_hermes_malformed_block_next_to_a_good_one() -> None:
    bad = '<tool_call>{"name": "add", "arguments": {"a": </tool_call>'
    p = HermesToolParser().parse(f'{bad}\n<tool_call>{{"name": "add", "parameters": "{{\\"a\\": 5}}"}}</tool_call>')
    assert p.content == bad and [(c.name, args(c)) for c in p.tool_calls] == [("add", {"a": 5})]


def test_json_parser() -> None:
    jp = JsonToolParser()
    one = jp.parse(' {"name": "add", "arguments": {"a": 1, "b": 2}} ')
    assert one.content is None and [(c.name, args(c)) for c in one.tool_calls] == [("add", {"a": 1, "b": 2})]
    many = jp.parse('[{"name": "add", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "东京"}}]')
    assert [c.name for c in many.tool_calls] == ["add", "get_weather"] and args(many.tool_calls[1])["city"] == "东京"
    for text in ['{"a": 1}', "[]", "Sure: " + '{"name": "add", "arguments": {}}', '{"name": "add"', "hello"]:
        p = jp.parse(text)
        assert p.tool_calls == [] and p.content == text


@pytest.mark.parametrize("parser", [HermesToolParser(), JsonToolParser()], ids=["hermes", "json"])
@pytest.mark.parametrize("text", [
    'Hi <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>  <tool_call>{"name": "get_weather", '
    '"arguments": {"city": "上海"}}</tool_call> ok <tool_call>bad</tool_call> <tool_c',
    '[{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"b": 2}}]',
    "  just text\n\n", "<tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n</tool_call>",
])
def test_streamed_events_reassemble_to_the_whole_parse(parser: ToolParser, text: str) -> None:
    whole = parser.parse(text)
    for step in (1, 2, 3, 7):
        s = parser.stream()
        events = [e for k in range(0, len(text), step) for e in s.feed(text[k:k + step])] + s.finish()
        calls = [e for e in events if isinstance(e, ToolCall)]
        content = "".join(e for e in events if isinstance(e, str))
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.tool_calls]
        assert (content or None if calls else content) == whole.content


# ---- request checks and the prompt -----------------------------------------------------------------------------
@pytest.mark.parametrize("tools, choice, param, code", [
    ([{"type": "retrieval"}], None, "tools[0].type", ErrorCode.INVALID_TOOL),
    (["x"], None, "tools[0]", ErrorCode.INVALID_TOOL),
    ([{"type": "function", "function": {"name": "has space"}}], None, "tools[0].function.name",
     ErrorCode.INVALID_TOOL),
    (TOOLS + [TOOLS[0]], None, "tools[2].function.name", ErrorCode.INVALID_TOOL),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None,
     "tools[0].function.parameters", ErrorCode.INVALID_TOOL),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name",
     ErrorCode.INVALID_TOOL_CHOICE),
    (TOOLS, "sometimes", "tool_choice", ErrorCode.INVALID_TOOL_CHOICE),
    (TOOLS, {"type": "function"}, "tool_choice", ErrorCode.INVALID_TOOL_CHOICE),
    (None, "required", "tool_choice", ErrorCode.INVALID_TOOL_CHOICE),
])
def test_tool_plan_rejects(tools: Any, choice: Any, param: str, code: ErrorCode) -> None:
    with pytest.raises(RequestRejected) as e:
        tool_plan(tools, choice)
    assert e.value.param == param and e.value.code == code


def test_tool_plan_defaults() -> None:
    assert tool_plan(None, None).choice == "none" and not tool_plan(None, "auto").active
    assert tool_plan(TOOLS, None).choice == "auto" and tool_plan(TOOLS, None).active
    assert not tool_plan(TOOLS, "none").active
    named = tool_plan(TOOLS, {"type": "function", "function": {"name": "add"}}, parallel=False)
    assert named.choice == "named" and named.named == "add" and not named.parallel


@pytest.mark.parametrize("parser", [HermesToolParser(), JsonToolParser()], ids=["hermes", "json"])
def test_the_tool_grammar_ends_after_the_calls_allowed(tokenizer: Any, parser: ToolParser) -> None:
    """1 to max_calls calls; after the last one allowed only the stop token (the grammar is complete), so a model
    that would go on calling ends its turn."""
    from pdserve.engine.structured import StructuredOutputManager

    mgr = StructuredOutputManager(tokenizer, 49152, [tokenizer.eos_token_id])
    call = ("add", {"a": 1, "b": 2})
    for max_calls in (1, 3):
        m = mgr.new_matcher(mgr.compile(parser.constraint([("add", ADD), ("get_weather", WEATHER)], max_calls)))
        if isinstance(parser, HermesToolParser):
            pieces = [parser.format_calls([call])] + ["\n" + parser.format_calls([call])] * (max_calls - 1)
        else:  # no free whitespace, keys in the schema's (sorted) order, as the grammar writes it
            one = {"arguments": call[1], "name": "add"}
            pieces = [json.dumps(one if max_calls == 1 else [one] * max_calls)]
        for piece in pieces:
            assert m.accept_string(piece) and not m.is_terminated()
        more = "\n<tool_call>" if isinstance(parser, HermesToolParser) else ","
        assert not m.accept_string(more)  # no further call
        assert m.accept_token(tokenizer.eos_token_id) and m.is_terminated()


@pytest.mark.parametrize("choice, parallel, n_calls", [("auto", True, 2), ("auto", False, 1), ("required", True, 2),
                                                      ("required", False, 1)])
def test_calls_past_the_request_limit_and_text_under_a_constraint_are_dropped(
        tokenizer: Any, choice: str, parallel: bool, n_calls: int) -> None:
    """Without parallel calls only the first call counts; under a constraint (required) the output is calls only,
    so neither text nor a cut-off call is content. auto keeps the parser's content (an unclosed block as written)."""
    from pdserve.engine.structured import StructuredOutputManager

    ct = ChatTools(tokenizer, HermesToolParser(), StructuredOutputManager.json_schema_error)
    plan = tool_plan(TOOLS, choice, parallel)
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    text = f'Sure. {call}\n{call.replace("1", "3")} And done. <tool_call>{{"name": "add"'  # the last one cut off
    plain = HermesToolParser().parse(text)
    assert len(plain.tool_calls) == 2 and plain.content and plain.content.endswith('<tool_call>{"name": "add"')
    whole = ct.parse(text, plan)
    assert whole.tool_calls == plain.tool_calls[:n_calls]
    assert whole.content == (plain.content if choice == "auto" else None)
    s = ct.stream(plan)
    events = [e for i in range(0, len(text), 7) for e in s.feed(text[i:i + 7])] + s.finish()
    assert [e for e in events if isinstance(e, ToolCall)] == whole.tool_calls
    assert ("".join(e for e in events if isinstance(e, str)) or None) == whole.content


def test_default_template_gets_the_tools_prompt_and_mapped_history(tokenizer: Any) -> None:
    from pdserve.engine.structured import StructuredOutputManager

    ct = ChatTools(tokenizer, HermesToolParser(), StructuredOutputManager.json_schema_error)
    # SmolLM2's template renders neither tools nor assistant tool_calls; it renders role "tool" as it is
    assert ct.capabilities() == {"tools": False, "tool_calls": False, "tool_role": True}
    history = [{"role": "system", "content": "Be brief."}, MSGS[0],
               {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris", "unit": "摄氏"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 度"}]
    msgs, tools = ct.prepare(history, tool_plan(TOOLS, "auto"))
    assert tools is None and msgs[0]["content"].startswith("Be brief.\n\n# Tools") and len(msgs) == 4
    assert json.dumps(TOOLS[1], ensure_ascii=False) in msgs[0]["content"] and "<tool_call>" in msgs[0]["content"]
    assert msgs[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "摄氏"}}'
                                  "\n</tool_call>") and "tool_calls" not in msgs[2]
    assert msgs[3] == history[3]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>tool\n21 度<|im_end|>" in text and '"name": "add"' in text
    # tool_choice none: no tools prompt (history still mapped); no system message: a new one first
    assert ct.prepare(history[1:], tool_plan(TOOLS, "none"))[0][0] == history[1]
    first = ct.prepare(history[1:2], tool_plan(TOOLS, "required"))[0][0]
    assert first["role"] == "system" and first["content"].startswith(DEFAULT_TOOLS_PROMPT.split("{")[0])
    with pytest.raises(RequestRejected) as e:
        ct.prepare(MSGS, tool_plan([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "nonsense"}}}}}], "auto"))
    assert e.value.param == "tools[0].function.parameters" and e.value.code == ErrorCode.INVALID_TOOL


def test_a_template_that_knows_tools_gets_them(tokenizer: Any) -> None:
    tpl = ("{% for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}{% for m in messages %}"
           "{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %} CALL {{ c.function.name }} "
           "{{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}")
    saved, tokenizer.chat_template = tokenizer.chat_template, tpl
    try:
        ct = ChatTools(tokenizer, HermesToolParser(), lambda s: None)
        assert ct.capabilities() == {"tools": True, "tool_calls": True, "tool_role": True}
        call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
        history = [MSGS[0], {"role": "assistant", "content": "", "tool_calls": [call]}]
        msgs, tools = ct.prepare(history, tool_plan(TOOLS, "auto"))
        assert tools == TOOLS and msgs[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}  # decoded, as vLLM
        text = tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False)
        assert "TOOL get_weather" in text and 'CALL add {"a": 1}' in text
    finally:
        tokenizer.chat_template = saved


# ---- against a real server, with the official openai client -----------------------------------------------------
def _server(tmp: Path, tiny_dir: Path, *extra: str) -> ServerProc:
    return start_server(tmp, "--model", str(tiny_dir), "--dtype", "float32", "--num-kv-blocks", "256",
                        "--max-model-len", "2048", "--num-threads", "1", "--device-peaks", "off", *extra)


@pytest.fixture(scope="module")
def server(tiny_server: ServerProc) -> ServerProc:
    """The session's tiny server (conftest; `_server`'s options): this module only sends requests and checks its own
    answers and the pool back at baseline. A server with other options (--tool-call-parser) starts its own."""
    return tiny_server


@pytest.fixture(scope="module")
def client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


def wait_idle(srv: ServerProc, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        kv = httpx.get(srv.base_url + "/debug/kv").json()
        if kv["num_used_blocks"] == 0 and kv["open_requests"] == 0:
            return
        assert time.monotonic() < deadline, kv
        time.sleep(0.05)


def validate_calls(calls: Any, names: set[str]) -> list[tuple[str, Any]]:
    out = []
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names
        a = json.loads(c.function.arguments)
        jsonschema.validate(a, SCHEMAS[c.function.name])
        out.append((c.function.name, a))
    return out


def reassemble(chunks: list[Any]) -> tuple[str, dict[int, dict[str, str]], str | None]:
    """A stream's content, its tool calls by index {id, name, arguments}, and the finish reason."""
    content, calls, finish = "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.index not in calls:  # the first chunk of a call: index, id, type, name and empty arguments
                assert tc.id and tc.type == "function" and tc.function.name and tc.function.arguments == ""
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and not tc.function.name
                calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_enforced_tool_choice_streamed_and_not(server: ServerProc, client: openai.OpenAI, choice: Any) -> None:
    names = {"add"} if isinstance(choice, dict) else set(SCHEMAS)
    kw: Any = dict(model=client.models.list().data[0].id, messages=MSGS, tools=TOOLS, tool_choice=choice,
                   parallel_tool_calls=False, temperature=0, max_completion_tokens=120)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    calls = validate_calls(c.message.tool_calls, names)
    assert len(calls) == 1
    chunks = list(client.chat.completions.create(**kw, stream=True))
    content, streamed, finish = reassemble(chunks)
    assert content == "" and finish == "tool_calls" and len(streamed) == 1
    assert [(s["name"], json.loads(s["arguments"])) for s in streamed.values()] == calls  # same as non-streamed
    assert streamed[0]["arguments"] == c.message.tool_calls[0].function.arguments
    # sampled too: every sample's arguments validate
    r = client.chat.completions.create(**{**kw, "temperature": 1.0, "seed": 3, "n": 3})
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls" and len(validate_calls(ch.message.tool_calls, names)) == 1
    wait_idle(server)


def test_round_trip_with_a_tool_result(server: ServerProc, client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    first = client.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_completion_tokens=120)
    msg = first.choices[0].message
    assert msg.tool_calls
    history: Any = [*MSGS, msg.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "晴, 21 °C"}]
    second = client.chat.completions.create(model=model, messages=history, tools=TOOLS, temperature=0,
                                            max_completion_tokens=8, extra_body={"ignore_eos": True})
    c = second.choices[0]
    assert c.finish_reason in ("length", "tool_calls") and (c.message.content or c.message.tool_calls)
    # the history reached the prompt: the call as hermes text, the result as a tool message
    ids = httpx.post(server.base_url + "/tokenize", json={"messages": history}).json()["tokens"]
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert f'<tool_call>\n{{"name": "{msg.tool_calls[0].function.name}", "arguments": ' in text
    assert "<|im_start|>tool\n晴, 21 °C<|im_end|>" in text
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20
    wait_idle(server)


def test_auto_is_unconstrained_and_none_is_plain(server: ServerProc, client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    plain = client.chat.completions.create(model=model, messages=MSGS, temperature=0, max_completion_tokens=10)
    none = client.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_completion_tokens=10)
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # no tools in the prompt
    auto = client.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, temperature=0,
                                          max_completion_tokens=10)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the default tools prompt
    assert auto.choices[0].finish_reason in ("length", "stop") and not auto.choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, temperature=0,
                                                 max_completion_tokens=10, stream=True))
    assert reassemble(chunks)[0] == auto.choices[0].message.content
    wait_idle(server)


BAD_SCHEMA: Any = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "nonsense"}}}}}]


@pytest.mark.parametrize("body, param, code", [
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "invalid_tool"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "invalid_tool_choice"),
    ({"tools": BAD_SCHEMA}, "tools[0].function.parameters", "invalid_tool"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "invalid_structured_output"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"id": "c"}]}]},
     "messages[1].tool_calls[0]", "invalid_parameter"),
])
def test_errors_are_400_with_param(server: ServerProc, body: dict[str, Any], param: str, code: str) -> None:
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": MSGS, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code and err["type"] == "invalid_request_error"
    wait_idle(server)


def test_completions_still_refuse_tools(server: ServerProc) -> None:
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x", "tools": TOOLS}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert r.json()["error"]["code"] == "unsupported_parameter"


def test_json_parser_server(tmp_path: Path, tiny_dir: Path) -> None:
    srv = _server(tmp_path, tiny_dir, "--tool-call-parser", "json")
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        for parallel in (False, True):  # true: a list of calls, which a random model may run on to the length cap
            kw: Any = dict(model=model, messages=MSGS, tools=TOOLS, tool_choice="required",
                           parallel_tool_calls=parallel, temperature=0, max_completion_tokens=200)
            c = client.chat.completions.create(**kw).choices[0]
            if not parallel or c.finish_reason == "tool_calls":
                assert c.finish_reason == "tool_calls" and c.message.content is None
                assert len(validate_calls(c.message.tool_calls, set(SCHEMAS))) >= 1
            content, streamed, finish = reassemble(list(client.chat.completions.create(**kw, stream=True)))
            assert finish == c.finish_reason and content == (c.message.content or "")
            assert [(s["name"], s["arguments"]) for s in streamed.values()] == \
                [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
    finally:
        assert srv.stop() in (0, -15)


# ---- the real model ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_server(real_server_bf16: ServerProc) -> ServerProc:
    """The session's bf16 default-model server (conftest), shared with tests/test_server.py."""
    return real_server_bf16


@pytest.mark.slow
def test_real_model_parallel_calls_and_round_trip(real_server: ServerProc) -> None:
    client = openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    msgs: Any = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
    kw: Any = dict(model=model, messages=msgs, tools=TOOLS, tool_choice="required", temperature=0,
                   max_completion_tokens=200)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    calls = validate_calls(c.message.tool_calls, set(SCHEMAS))
    assert c.finish_reason == "tool_calls" and len(calls) >= 1
    content, streamed, finish = reassemble(list(client.chat.completions.create(**kw, stream=True)))
    assert finish == "tool_calls" and content == ""
    assert [(s["name"], s["arguments"]) for s in streamed.values()] == \
        [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
    history: Any = [*msgs, c.message.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": t.id, "content": "sunny, 21 °C" if t.function.name ==
                 "get_weather" else "5"} for t in c.message.tool_calls]
    second = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_completion_tokens=40)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls


def test_required_with_parallel_calls_ends_and_cut_calls_are_not_content(server: ServerProc,
                                                                         client: openai.OpenAI) -> None:
    """required, parallel calls allowed (the default): the random model would call until max_tokens; the grammar
    ends the turn after MAX_PARALLEL_TOOL_CALLS. A call cut off by max_tokens is dropped, never content."""
    kw: Any = dict(model=client.models.list().data[0].id, messages=MSGS, tools=TOOLS, tool_choice="required",
                   temperature=0)
    r = client.chat.completions.create(**kw, max_completion_tokens=1500)
    c = r.choices[0]
    calls = validate_calls(c.message.tool_calls, set(SCHEMAS))
    assert c.finish_reason == "tool_calls" and c.message.content is None and 1 <= len(calls) <= MAX_PARALLEL_TOOL_CALLS
    content, streamed, finish = reassemble(list(client.chat.completions.create(**kw, max_completion_tokens=1500,
                                                                               stream=True)))
    assert (content, finish) == ("", "tool_calls") and [(s["name"], json.loads(s["arguments"]))
                                                        for s in streamed.values()] == calls
    cut = r.usage.completion_tokens - 3  # the last call cannot close
    short = client.chat.completions.create(**kw, max_completion_tokens=cut).choices[0]
    assert short.finish_reason == "length" and short.message.content is None
    assert validate_calls(short.message.tool_calls or [], set(SCHEMAS)) == calls[:-1]
    content, streamed, finish = reassemble(list(client.chat.completions.create(**kw, max_completion_tokens=cut,
                                                                               stream=True)))
    assert (content, finish, len(streamed)) == ("", "length", len(calls) - 1)
    wait_idle(server)


def test_parallel_tool_calls_null_and_tools_without_parameters(server: ServerProc) -> None:
    """parallel_tool_calls: null is the default (true); a tool without parameters takes an empty object."""
    tools = [{"type": "function", "function": {"name": "now"}}]
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "messages": MSGS, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "now"}},
        "parallel_tool_calls": None, "temperature": 0, "max_tokens": 40})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in c["message"]["tool_calls"]] == [("now", "{}")]
    wait_idle(server)

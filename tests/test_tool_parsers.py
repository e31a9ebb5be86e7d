"""The tool-call parsers beyond hermes / json (llama3_json, mistral, pythonic, qwen3_coder), each on its own format:
exact extraction (Chinese arguments, several calls, text before a call), every split of the stream, malformed
output left as content, each parser's grammar accepting its own format and ending after the calls allowed, the
registry (`auto` from the chat template, unknown names), and a real server per parser driven by the grammar."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from test_tool_calling import ADD, WEATHER  # the chat tool tests' schemas

from pdserve.cli import TOOL_CALL_PARSERS, build_parser
from pdserve.launch import ServerProc, start_server
from pdserve.server.tool_parser_registry import TOOL_PARSERS, get_tool_parser, parser_for_template
from pdserve.server.tool_parsers import ToolCall, ToolParser
from pdserve.server.tool_parsers_xml import convert_value

# properties in sorted order: the JSON grammars take them in that order (the structural tag is cached by its JSON
# text, written with sorted keys), the pythonic grammar in the declared order
OPTS = {"type": "object", "properties": {"deep": {"type": "boolean"}, "n": {"type": "integer"},
                                         "q": {"type": "string", "maxLength": 8}}, "required": ["n"]}
SCHEMAS: dict[str, Any] = {"get_weather": WEATHER, "add": ADD, "search": OPTS}
NEW = ["llama3_json", "mistral", "pythonic", "qwen3_coder"]

PARIS = ("get_weather", {"city": "北京 \"Paris\"", "unit": "摄氏"})
ADD12 = ("add", {"a": 1, "b": 2})

# (parser, output, [(name, arguments)], content)
CASES: list[tuple[str, str, list[tuple[str, Any]], str | None]] = [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "北京 \\"Paris\\"", "unit": "摄氏"}}',
     [PARIS], None),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "北京 \\"Paris\\"", '
     '"unit": "摄氏"}}; {"name": "add", "arguments": {"a": 1, "b": 2}}', [PARIS, ADD12], None),
    ("llama3_json", 'Let me look. 我来查。 <|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}',
     [ADD12], "Let me look. 我来查。"),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "北京 \\"Paris\\"", "unit": "摄氏"}}, '
     '{"name": "add", "arguments": {"a": 1, "b": 2}}]', [PARIS, ADD12], None),
    ("mistral", '好的 [TOOL_CALLS]get_weather[ARGS]{"city": "北京 \\"Paris\\"", "unit": "摄氏"}[TOOL_CALLS]add[ARGS]'
     '{"a": 1, "b": 2}', [PARIS, ADD12], "好的"),
    ("mistral", '[TOOL_CALLS]add[CALL_ID]a1B2c3D4e[ARGS]{"a": 1, "b": 2}', [ADD12], None),
    ("pythonic", '[get_weather(city="北京 \\"Paris\\"", unit="摄氏"), add(a=1, b=+2)]', [PARIS, ADD12], None),
    ("pythonic", "Sure, [1] says so. <|python_start|>[add(a=1, b=2)]<|python_end|>", [ADD12], "Sure, [1] says so."),
    ("pythonic", "[search(q='a]b', n=-3, deep=true, extra={'k': [1, 2.5, None], 'z': (1,)})]",
     [("search", {"q": "a]b", "n": -3, "deep": True, "extra": {"k": [1, 2.5, None], "z": [1]}})], None),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n北京 \"Paris\"\n</parameter>\n"
     "<parameter=unit>\n摄氏\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n1\n"
     "</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>", [PARIS, ADD12], None),
    ("qwen3_coder", "我看看。\n<tool_call>\n<function=search>\n<parameter=n>\n7\n</parameter>\n"
     "<parameter=deep>\nFalse\n</parameter>\n<parameter=q>\n42\n</parameter>\n</function>\n</tool_call>",
     [("search", {"n": 7, "deep": False, "q": "42"})], "我看看。"),
]

# outputs that are not calls in the parser's format: all content, as written
MALFORMED: list[tuple[str, str]] = [
    ("llama3_json", '{"name": "add", "parameters": {"a": 1,'),  # cut off
    ("llama3_json", '<|python_tag|>brave_search.call(query="x")'),
    ("llama3_json", '{"name": 3, "parameters": {}} and {"a": 1}'),
    ("mistral", "[TOOL_CALLS] is how I call tools"),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": [1]}]'),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": '),
    ("pythonic", "[add(1, 2)]"),  # positional arguments
    ("pythonic", "[add(a=open('/etc/passwd').read())]"),  # never evaluated
    ("pythonic", "[add(a=1)"),
    ("pythonic", "see [citation needed] and [1]"),
    ("pythonic", "[f(a=" + "[" * 300 + "]" * 300 + ")]"),  # nested too deep for Python's parser: no crash
    ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\n1\n"),  # never closed
    ("qwen3_coder", "<tool_call>{\"name\": \"add\"}</tool_call>"),  # no <function=...>
    ("qwen3_coder", "a < b and <tool_ partial"),
]


def calls_of(p: Any) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in p.tool_calls]


def streamed(parser: ToolParser, chunks: list[str]) -> tuple[list[ToolCall], str]:
    s = parser.stream(SCHEMAS)
    events = [e for ch in chunks for e in s.feed(ch)] + s.finish()
    return [e for e in events if isinstance(e, ToolCall)], "".join(e for e in events if isinstance(e, str))


@pytest.mark.parametrize("name, text, calls, content", CASES)
def test_extraction_and_every_stream_split(name: str, text: str, calls: list[tuple[str, Any]],
                                           content: str | None) -> None:
    parser = get_tool_parser(name)
    whole = parser.parse(text, SCHEMAS)
    assert calls_of(whole) == calls and whole.content == content
    assert all(c.arguments == json.dumps(json.loads(c.arguments), ensure_ascii=False) for c in whole.tool_calls)
    splits = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]
    for chunks in splits:  # every two-chunk split, and one character at a time
        got, text_out = streamed(parser, chunks)
        assert [(c.name, c.arguments) for c in got] == [(c.name, c.arguments) for c in whole.tool_calls], chunks
        assert (text_out or None) == whole.content, chunks


@pytest.mark.parametrize("name, text", MALFORMED)
def test_malformed_output_is_content_as_written(name: str, text: str) -> None:
    parser = get_tool_parser(name)
    p = parser.parse(text, SCHEMAS)
    assert p.tool_calls == [] and p.content == text
    for k in range(0, len(text) + 1, 1 if len(text) < 100 else 37):
        got, text_out = streamed(parser, [text[:k], text[k:]])
        assert got == [] and text_out == text


@pytest.mark.parametrize("name", NEW)
def test_every_prefix_of_a_call_parses_without_error(name: str) -> None:
    """An output cut anywhere (max_tokens) is calls that closed plus content; nothing raises."""
    text = next(t for n, t, _, _ in CASES if n == name and "\n" not in t[:3])
    for k in range(len(text) + 1):
        p = get_tool_parser(name).parse(text[:k], SCHEMAS)
        assert "".join(p.content or "") in text[:k] or p.tool_calls


def test_mistral_ids_are_nine_letters_or_digits() -> None:
    p = get_tool_parser("mistral").parse(CASES[3][1] + " " + CASES[5][1])
    ids = [c.id for c in p.tool_calls]
    assert len(ids) == 3 and all(len(i) == 9 and i.isalnum() for i in ids) and ids[2] == "a1B2c3D4e"


@pytest.mark.parametrize("value, schema, want", [
    ("42", {"type": "string"}, "42"), ("42", {"type": "integer"}, 42), ("-4.5", {"type": "number"}, -4.5),
    ("3", {"type": "number"}, 3), ("TRUE", {"type": "boolean"}, True), ("null", {"type": ["integer", "null"]}, None),
    ("null", {"type": "string"}, "null"), ('{"k": [1, "二"]}', {"type": "object"}, {"k": [1, "二"]}),
    ("{'k': (1, 2)}", {"type": "object"}, {"k": [1, 2]}), ("[1, 2", {"type": "array"}, "[1, 2"),
    ("celsius", {"enum": ["celsius", "kelvin"]}, "celsius"), (" celsius", {"enum": ["celsius"]}, "celsius"),
    (" 3\t", {"type": "integer"}, 3), ("7", {"anyOf": [{"type": "integer"}]}, 7),
    ("x y", {"type": "integer"}, "x y"), ("5", {}, 5),
])
def test_qwen3_coder_values_follow_the_schema_types(value: str, schema: Any, want: Any) -> None:
    assert convert_value(value, schema, True) == want
    assert convert_value(value, schema, False) == value  # not declared: text


@pytest.mark.parametrize("name", NEW)
def test_grammar_accepts_the_format_and_ends_after_the_calls_allowed(tokenizer: Any, name: str) -> None:
    """Each parser's grammar accepts what format_calls writes (which the parser reads back), from 1 to max_calls
    calls, and after the last one allowed only the stop token."""
    from pdserve.engine.structured import StructuredOutputManager

    parser = get_tool_parser(name)
    mgr = StructuredOutputManager(tokenizer, 49152, [tokenizer.eos_token_id])
    tools = [("add", ADD), ("get_weather", WEATHER), ("search", OPTS)]
    # (xgrammar's strings under maxLength take no escapes, so no quote in the city here)
    want = [ADD12, ("get_weather", {"city": "北京", "unit": "摄氏"}), ("search", {"n": 3}),
            ("search", {"deep": True, "n": 1, "q": "中文"})]
    for max_calls in (1, 2, 4):
        calls = want[:max_calls]
        text = parser.format_calls(calls)
        assert calls_of(parser.parse(text, SCHEMAS)) == calls
        m = mgr.new_matcher(mgr.compile(parser.constraint(tools, max_calls)))
        assert m.accept_string(text), (name, text)
        assert not m.is_terminated() and m.accept_token(tokenizer.eos_token_id) and m.is_terminated()
        # a call beyond the limit, or an argument the schema forbids, is refused
        m = mgr.new_matcher(mgr.compile(parser.constraint(tools, max_calls)))
        more = parser.format_calls([*calls, ADD12])
        common = len(next(p for p in (text[:i] for i in range(len(text), -1, -1)) if more.startswith(p)))
        assert m.accept_string(more[:common]) and not m.accept_string(more[common:])
    bad = parser.format_calls([("add", {"a": 100, "b": 2})])
    m = mgr.new_matcher(mgr.compile(parser.constraint(tools, 1)))
    assert not m.accept_string(bad)


def test_registry_names_auto_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert sorted(TOOL_CALL_PARSERS) == sorted([*TOOL_PARSERS, "auto"])
    assert parser_for_template("{% for t in tools %}<function={{ t.name }}><parameter=x>") == "qwen3_coder"
    assert parser_for_template("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]") == "mistral"
    assert parser_for_template("<|header_start|>... <|python_start|>") == "pythonic"
    assert parser_for_template('Respond in the format [func_name1(params_name1=params_value1)]') == "pythonic"
    assert parser_for_template('<|start_header_id|>ipython ... {"name": function name, "parameters": ...}') \
        == "llama3_json"
    assert parser_for_template("<tool_call>\n{{ tool_call | tojson }}\n</tool_call>") == "hermes"
    assert parser_for_template("") == "hermes"

    class Tok:
        chat_template = "...[TOOL_CALLS]..."
    assert get_tool_parser("auto", Tok()).name == "mistral"
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        get_tool_parser("nope")
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--tool-call-parser", "nope"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--tool-call-parser: invalid choice: 'nope'" in err and "qwen3_coder" in err


# ---- a real server per parser, the tiny random model driven by the grammar ---------------------------------------
TOOLS: Any = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]


@pytest.fixture(scope="module", params=NEW)
def parser_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                  tiny_dir: Path) -> Iterator[tuple[str, ServerProc]]:
    srv = start_server(tmp_path_factory.mktemp("parsers"), "--model", str(tiny_dir), "--dtype", "float32",
                       "--num-kv-blocks", "256", "--max-model-len", "2048", "--num-threads", "1",
                       "--tool-call-parser", request.param)
    yield request.param, srv
    assert srv.stop() in (0, -15)


def test_server_required_and_named_calls_streamed_and_not(parser_server: tuple[str, ServerProc]) -> None:
    name, srv = parser_server
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    msgs: Any = [{"role": "user", "content": "北京天气怎么样？"}]
    for choice, names in (("required", set(SCHEMAS)), ({"type": "function", "function": {"name": "add"}}, {"add"})):
        kw: Any = dict(model=model, messages=msgs, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                       temperature=0, max_completion_tokens=150)
        c = client.chat.completions.create(**kw).choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, (name, c)
        (call,) = c.message.tool_calls or []
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert len(call.id) == 9 if name == "mistral" else call.id.startswith("call_")
        content, deltas, finish = "", {}, None
        for ch in client.chat.completions.create(**kw, stream=True):
            if ch.choices:
                d = ch.choices[0].delta
                content += d.content or ""
                for tc in d.tool_calls or []:
                    entry = deltas.setdefault(tc.index, {"name": tc.function.name, "arguments": ""})
                    entry["arguments"] += tc.function.arguments or ""
                finish = ch.choices[0].finish_reason or finish
        assert finish == "tool_calls" and content == ""
        assert list(deltas.values()) == [{"name": call.function.name, "arguments": call.function.arguments}]
    # the history goes back to the model in the parser's format (the tiny template renders no tool calls)
    history: Any = [*msgs, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "晴, 25°C"}]
    r = client.chat.completions.create(model=model, messages=history, tools=TOOLS, temperature=0,
                                       max_completion_tokens=5)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("name", ["hermes", *NEW])
def test_grammar_writes_arguments_in_the_declared_order(tokenizer: Any, name: str) -> None:
    """A tool's properties keep the order its schema declares (models are trained to write them so), not sorted:
    `zone` before `area` is accepted, and the sorted order is not."""
    from pdserve.engine.structured import StructuredOutputManager

    params = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8},
                                               "area": {"type": "integer"}}, "required": ["zone", "area"]}
    parser = get_tool_parser(name)
    mgr = StructuredOutputManager(tokenizer, 49152, [tokenizer.eos_token_id])
    declared = parser.format_calls([("locate", {"zone": "东区", "area": 3})])
    sorted_ = parser.format_calls([("locate", {"area": 3, "zone": "东区"})])
    assert mgr.new_matcher(mgr.compile(parser.constraint([("locate", params)], 1))).accept_string(declared)
    assert not mgr.new_matcher(mgr.compile(parser.constraint([("locate", params)], 1))).accept_string(sorted_)

"""The `qwen3_coder` tool-call format (Qwen3-Coder, Qwen3.5): XML blocks

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

any number, text around them content (tool_parsers.py explains the stream). A parameter's value is its text less
one whitespace character at each end (the newlines above), converted by the type its tool's schema gives the
parameter (as vLLM's qwen3coder parser does): strings stay text (a string enum's member with whitespace around
it: the member); integer / number / boolean are read as such; objects, arrays and untyped parameters as JSON
(else a Python literal, else text); "null" is null unless the parameter is a string.
A parameter the schema does not declare stays text. A block without a `<function=...>` stays content as written;
a `</parameter>` left out ends at the next parameter or at `</function>`.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from pdserve.sampling_params import StructuredOutputs
from pdserve.server.tool_parsers import BlockStream, ToolCall, ToolParser, Tools, ToolStream, structural_calls
from pdserve.server.tool_parsers_pythonic import python_literal

_FUNCTION = re.compile(r"\s*<function=([^>\n]{1,64})>(.*?)(?:</function>\s*)?", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]{1,128})>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


def _types(schema: Any) -> list[str]:
    """The JSON types a parameter schema allows (from `type`, else its enum values, else anyOf / oneOf)."""
    if not isinstance(schema, dict):
        return []
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    if isinstance(schema.get("enum"), list):
        names = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}
        return sorted({names.get(type(v), "object") for v in schema["enum"]})
    subs = schema.get("anyOf") or schema.get("oneOf") or []
    return [x for sub in subs for x in _types(sub)] if isinstance(subs, list) else []


def _as_type(value: str, t: str) -> tuple[bool, Any]:
    v = value.strip()
    if t == "integer" and re.fullmatch(r"[-+]?\d+", v):
        return True, int(v)
    if t == "number" and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", v):
        f = float(v)
        return True, int(v) if re.fullmatch(r"[-+]?\d+", v) else f
    if t == "boolean" and v.lower() in ("true", "false"):
        return True, v.lower() == "true"
    if t == "null" and v.lower() in ("null", "none"):
        return True, None
    return False, None


def convert_value(value: str, schema: Any, declared: bool) -> Any:
    """A parameter's text as the value its schema's type says (the rules in the module's docstring)."""
    if not declared:
        return value
    enum = schema.get("enum") if isinstance(schema, dict) else None
    if isinstance(enum, list) and value not in enum and value.strip() in enum:
        return value.strip()  # the grammar lets one whitespace character stand around a value
    types = _types(schema)
    if types == ["string"] or ("string" in types and value.strip().lower() != "null"):
        return value
    for t in types:
        ok, v = _as_type(value, t)
        if ok:
            return v
    if "string" in types:
        return value
    try:
        return json.loads(value)
    except ValueError:
        pass
    try:
        return python_literal(ast.parse(value.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return value


def _value_text(raw: str) -> str:
    """A parameter's text less one whitespace character at each end: the template's newlines around a value,
    or the one the grammar lets stand there."""
    raw = raw[1:] if raw[:1].isspace() else raw
    return raw[:-1] if raw[-1:].isspace() else raw


def xml_call(body: str, tools: Tools) -> ToolCall | None:
    """The call in a block's body `<function=name><parameter=k>v</parameter>...</function>`, or None."""
    m = _FUNCTION.fullmatch(body)
    if m is None:
        return None
    name = m.group(1).strip()
    schema = tools.get(name) or {}
    props: dict[str, Any] = schema.get("properties") or {}
    props = props if isinstance(props, dict) else {}
    args = {}
    for pm in _PARAMETER.finditer(m.group(2)):
        key = pm.group(1).strip()
        args[key] = convert_value(_value_text(pm.group(2)), props.get(key), key in props)
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


class Qwen3CoderStream(BlockStream):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    markers = (OPEN,)

    def __init__(self, tools: Tools) -> None:
        super().__init__()
        self.tools = tools

    def call(self, body: str) -> ToolCall | None:
        return xml_call(body, self.tools)


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def stream(self, tools: Tools | None = None) -> ToolStream:
        return Qwen3CoderStream(tools or {})

    def instructions(self) -> str:
        return ("To call a function, reply in this format:\n<tool_call>\n<function=example_function_name>\n"
                "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>\n"
                "Write every required parameter; strings as they are, other values as JSON.")

    def format_calls(self, calls: list[tuple[str, Any]]) -> str:
        def value(v: Any) -> str:
            return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)

        def one(name: str, a: Any) -> str:
            params = "".join(f"<parameter={k}>\n{value(v)}\n</parameter>\n"
                             for k, v in (a.items() if isinstance(a, dict) else []))
            return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
        return "\n".join(one(n, a) for n, a in calls)

    def constraint(self, tools: list[tuple[str, dict[str, Any]]], max_calls: int) -> StructuredOutputs:
        # xgrammar's Qwen XML style: <parameter=key>value</parameter> for each property, values by the schema
        tags = [{"type": "tag", "begin": f"<tool_call>\n<function={name}>\n", "end": "\n</function>\n</tool_call>",
                 "content": {"type": "json_schema", "json_schema": params, "style": "qwen_xml",
                             "max_whitespace_cnt": 1}} for name, params in tools]
        return structural_calls(tags, max_calls, "\n")

"""The `pythonic` tool-call format (Llama 3.2 / Llama 4): a Python list of calls with keyword arguments,
`[get_weather(city="San Francisco", metric="celsius"), add(a=1, b=2)]`, optionally between Llama 4's
`<|python_start|>` and `<|python_end|>`.

The list is read with Python's `ast` (parsed, never evaluated): each element must be a call of a (dotted) name
with keyword arguments only, each a literal (strings, numbers, True / False / None, lists, tuples, dicts with
string keys; JSON's true / false / null too). Anything else (positional arguments, expressions, an unclosed list)
stays content as written. A list starts at `[` followed by a name and `(`; text before it is content.

The grammar for `required` / a named function writes each call's arguments as `key=<JSON value>` in the tool's
declared property order (required ones always, optional ones may be left out), so the values validate against
the property schemas; JSON values are Python literals but for true / false / null, which the parser reads.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from pdserve.sampling_params import StructuredOutputs
from pdserve.server.tool_parsers import (
    NOT_A_CALL,
    MarkerStream,
    Taken,
    ToolCall,
    ToolParser,
    Tools,
    ToolStream,
    structural_calls,
)

_JSON_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}
# what a call list looks like so far: "[", a name, "(" and then anything (checked whole once the list closes)
_LIST_PREFIX = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*(?:\(.*)?)?", re.DOTALL)


class NotLiteral(ValueError):
    """An argument that is not a literal value."""


def python_literal(node: ast.AST) -> Any:
    """A JSON-able value from a literal expression; NotLiteral for anything else (names, calls, operators)."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, bool, int, float))):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise NotLiteral("not a finite number")
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = python_literal(node.operand)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise NotLiteral("a sign before what is not a number")
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, (ast.List, ast.Tuple)):
        return [python_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values, strict=True):
            key = python_literal(k) if k is not None else None
            if not isinstance(key, str):
                raise NotLiteral("a dict key that is not a string")
            out[key] = python_literal(v)
        return out
    raise NotLiteral(type(node).__name__)


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _dotted(node.value)) is not None:
        return f"{base}.{node.attr}"
    return None


def pythonic_calls(src: str) -> list[ToolCall] | None:
    """The calls of a Python list-of-calls text, or None when it is not one."""
    try:
        tree = ast.parse(src.strip(), mode="eval")
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = []
        for el in tree.body.elts:
            if not isinstance(el, ast.Call) or el.args or (name := _dotted(el.func)) is None:
                return None
            kwargs = {}
            for kw in el.keywords:
                if kw.arg is None:  # **spread
                    return None
                kwargs[kw.arg] = python_literal(kw.value)
            calls.append(ToolCall(name, json.dumps(kwargs, ensure_ascii=False)))
        return calls
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # NotLiteral is a ValueError
        return None


def list_end(text: str) -> int | None:
    """Where the bracketed list at the start of `text` closes (Python strings skipped), or None while open."""
    depth, quote, i = 0, "", 0
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif text.startswith(quote, i):
                i += len(quote) - 1
                quote = ""
        elif ch in "\"'":
            quote = ch * 3 if text.startswith(ch * 3, i) else ch
            i += len(quote) - 1
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


class PythonicStream(MarkerStream):
    START, END = "<|python_start|>", "<|python_end|>"
    markers = (START, "[")
    separators = (END,)

    def take(self, buf: str, final: bool) -> Taken | None:
        start = len(self.START) if buf.startswith(self.START) else 0
        body = buf[start:]
        lead = len(body) - len(body.lstrip())
        if not body.strip():
            return NOT_A_CALL if final else None
        if not body.lstrip().startswith("["):
            return NOT_A_CALL
        if (end := list_end(body[lead:])) is None:
            ok = _LIST_PREFIX.fullmatch(body[lead:]) is not None
            return NOT_A_CALL if final or not ok else None
        calls = pythonic_calls(body[lead:lead + end])
        return NOT_A_CALL if calls is None else Taken(calls, start + lead + end)


def kwargs_format(params: dict[str, Any]) -> dict[str, Any] | None:
    """The grammar of a call's keyword arguments: the declared properties in order, each `key=<JSON value>`
    valid against its schema, separated by ", "; required ones always, optional ones may be left out. None when
    there are none."""
    props: dict[str, Any] = params.get("properties") or {}
    required = set(params.get("required") or [])
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}  # "#/$defs/..." refs still resolve

    def item(key: str, first: bool) -> dict[str, Any]:
        value = {"type": "json_schema", "json_schema": {**props[key], **defs} if isinstance(props[key], dict)
                 else props[key], "max_whitespace_cnt": 1}
        return {"type": "sequence", "elements": [{"type": "const_string", "value": ("" if first else ", ") + key
                                                  + "="}, value]}

    def rest(keys: list[str], first: bool) -> dict[str, Any] | None:
        """The arguments from keys[0] on; `first`: none written before them."""
        if not keys:
            return None
        key, tail = keys[0], keys[1:]
        with_it = [item(key, first)] + ([r] if (r := rest(tail, False)) is not None else [])
        seq = {"type": "sequence", "elements": with_it} if len(with_it) > 1 else with_it[0]
        if key in required:
            return seq
        if not first:
            opt: dict[str, Any] = {"type": "optional", "content": item(key, False)}
            r = rest(tail, False)
            return {"type": "sequence", "elements": [opt, r]} if r is not None else opt
        without = rest(tail, True)
        return {"type": "or", "elements": [seq, without]} if without is not None else {"type": "optional",
                                                                                         "content": seq}
    return rest(list(props), True)


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def stream(self, tools: Tools | None = None) -> ToolStream:
        return PythonicStream()

    def instructions(self) -> str:
        return ("To call functions, respond with only a Python list of calls with keyword arguments: "
                '[func_name1(param1="value1", param2=2), func_name2(param=True)]')

    def format_calls(self, calls: list[tuple[str, Any]]) -> str:
        # values as JSON, as the grammar writes them (true / false / null for Python's True / False / None)
        def one(name: str, a: Any) -> str:
            items = a.items() if isinstance(a, dict) else []
            return f"{name}({', '.join(f'{k}={json.dumps(v, ensure_ascii=False)}' for k, v in items)})"
        return "[" + ", ".join(one(n, a) for n, a in calls) + "]"

    def constraint(self, tools: list[tuple[str, dict[str, Any]]], max_calls: int) -> StructuredOutputs:
        tags = []
        for name, params in tools:
            inner = kwargs_format(params)
            open_ = {"type": "const_string", "value": f"{name}("}
            close = {"type": "const_string", "value": ")"}
            tags.append({"type": "sequence", "elements": [open_, *([inner] if inner else []), close]})
        return structural_calls(tags, max_calls, ", ", begin="[", end="]")

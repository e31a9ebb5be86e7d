"""Tool-call parsers (`--tool-call-parser`): model text -> OpenAI tool calls plus the remaining content, whole or
streamed, and the output format each one expects (for the default tools prompt, for assistant tool calls in the
history, and for the grammar that enforces `tool_choice: "required"` or a named function).

A parser works on a stream of text deltas and yields events: content text, or a complete `ToolCall` (emitted once
its markup closes and its JSON parsed). `parse(text)` is the same stream fed the whole text, so a streamed reply
always reassembles to the non-streamed one.

- `hermes` (Hermes / Qwen style): calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks,
  any number, anywhere in the text. Text around them is content; the whitespace between content and a call, and
  trailing whitespace after the last call, are dropped. A block whose JSON does not parse into a call (or that
  never closes) stays in the content as written. The markup itself is never streamed as content.
- `json`: the whole output (surrounding whitespace aside) is a JSON object `{"name", "arguments"}` or a non-empty
  list of them; anything else is content. Output that starts with `{` or `[` is held until the end (it may be a
  call); other output streams as content at once.

`arguments` may also be spelled `parameters`, or be a JSON string holding the object; a call's `arguments` are
written out again with `json.dumps` (", " and ": " separators, non-ASCII kept as it is).
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pdserve.sampling_params import StructuredOutputs


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=_call_id, compare=False)

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


Event = str | ToolCall  # content text, or a complete call


@dataclass
class ParsedOutput:
    content: str | None  # None when the output is only tool calls
    tool_calls: list[ToolCall]


def call_from_json(obj: Any) -> ToolCall | None:
    """A call from its decoded JSON {"name": str, "arguments": object}, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """The JSON of one call: {"name": `name`, "arguments": valid against `parameters`}."""
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (held back: the tag may follow)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolStream(ABC):
    """One choice's parse state."""

    @abstractmethod
    def feed(self, text: str) -> list[Event]: ...

    @abstractmethod
    def finish(self) -> list[Event]: ...


class ToolParser(ABC):
    """A tool-call output format. Stateless: `stream()` gives the per-choice state."""

    name: ClassVar[str]

    @abstractmethod
    def stream(self) -> ToolStream: ...

    @abstractmethod
    def instructions(self) -> str:
        """How to call a function, for the default tools system prompt."""

    @abstractmethod
    def format_calls(self, calls: list[tuple[str, Any]]) -> str:
        """(name, arguments) calls as the model writes them: assistant tool calls in the history, as text."""

    @abstractmethod
    def constraint(self, tools: list[tuple[str, dict[str, Any]]], max_calls: int) -> StructuredOutputs:
        """The grammar that makes the whole output 1 to `max_calls` calls of these (name, parameters schema)
        tools, each call's arguments valid against its tool's schema; after the last one allowed, only the stop
        token (the grammar is complete), so a model that would go on calling ends its turn."""

    def parse(self, text: str) -> ParsedOutput:
        return parse_with(self.stream(), text)


def parse_with(stream: ToolStream, text: str) -> ParsedOutput:
    """A whole text through a fresh stream: its calls, and its content (None when it is only calls)."""
    events = stream.feed(text) + stream.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    content = "".join(e for e in events if isinstance(e, str))
    return ParsedOutput(None if calls and not content else content, calls)


class HermesStream(ToolStream):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.buf = ""  # text mode: a held partial "<tool_call>"; call mode: the block's body so far
        self.ws = ""  # trailing whitespace of the content, held: dropped if a call follows
        self.in_call = False
        self.after_call = False  # whitespace right after a call is dropped
        self.any_call = False

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while True:
            if self.in_call:
                end = self.buf.find(self.CLOSE)
                if end < 0:
                    return out
                body, self.buf, self.in_call = self.buf[:end], self.buf[end + len(self.CLOSE):], False
                call = call_from_json(_loads(body.strip()))
                if call is None:  # malformed: content, as written
                    self._text(self.OPEN + body + self.CLOSE, out)
                else:
                    out.append(call)
                    self.ws, self.after_call, self.any_call = "", True, True
                continue
            start = self.buf.find(self.OPEN)
            if start < 0:
                keep = _held_prefix(self.buf, self.OPEN)
                self._text(self.buf[:len(self.buf) - keep], out)
                self.buf = self.buf[len(self.buf) - keep:]
                return out
            self._text(self.buf[:start], out)
            self.buf, self.in_call = self.buf[start + len(self.OPEN):], True

    def finish(self) -> list[Event]:
        out: list[Event] = []
        rest = self.OPEN + self.buf if self.in_call else self.buf
        self.buf, self.in_call = "", False
        self._text(rest, out)
        if not self.any_call and self.ws:
            out.append(self.ws)
        self.ws = ""
        return out

    def _text(self, s: str, out: list[Event]) -> None:
        if self.after_call:
            s = s.lstrip()
            if not s:
                return
            self.after_call = False
        s = self.ws + s
        body = s.rstrip()
        self.ws = s[len(body):]
        if body:
            out.append(body)


class HermesToolParser(ToolParser):
    name = "hermes"

    def stream(self) -> ToolStream:
        return HermesStream()

    def instructions(self) -> str:
        return ("For each function call, return a JSON object with the function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def format_calls(self, calls: list[tuple[str, Any]]) -> str:
        return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n</tool_call>"
                         for n, a in calls)

    def constraint(self, tools: list[tuple[str, dict[str, Any]]], max_calls: int) -> StructuredOutputs:
        # as xgrammar's built-in tool tags: the name is part of the tag's literal beginning, the arguments are the
        # tool's schema (at most one whitespace character in a row: a weak model cannot pad forever)
        tags = [{"type": "tag", "begin": f'{HermesStream.OPEN}\n{{"name": {json.dumps(name)}, "arguments": ',
                 "end": f"}}\n{HermesStream.CLOSE}",
                 "content": {"type": "json_schema", "json_schema": params, "max_whitespace_cnt": 1}}
                for name, params in tools]
        call: dict[str, Any] = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
        fmt = call  # one call, then a newline before each further one, up to max_calls in all
        if max_calls > 1:
            more = {"type": "sequence", "elements": [{"type": "const_string", "value": "\n"}, call]}
            fmt = {"type": "sequence", "elements": [call, {"type": "repeat", "min": 0, "max": max_calls - 1,
                                                             "content": more}]}
        return StructuredOutputs(structural_tag=json.dumps({"type": "structural_tag", "format": fmt},
                                                           ensure_ascii=False, sort_keys=True), param="tool_choice")


class JsonStream(ToolStream):
    def __init__(self) -> None:
        self.buf = ""
        self.mode: str | None = None  # None: undecided (only whitespace so far); "text"; "json": held to the end

    def feed(self, text: str) -> list[Event]:
        if self.mode == "text":
            return [text] if text else []
        self.buf += text
        head = self.buf.lstrip()
        if not head or self.mode == "json":
            return []
        if head[0] in "{[":
            self.mode = "json"
            return []
        self.mode, out, self.buf = "text", self.buf, ""
        return [out]

    def finish(self) -> list[Event]:
        text, self.buf = self.buf, ""
        if self.mode == "json":
            obj = _loads(text.strip())
            items = obj if isinstance(obj, list) else [obj]
            calls = [call_from_json(o) for o in items]
            if calls and all(c is not None for c in calls):
                return [c for c in calls if c is not None]
        return [text] if text else []


class JsonToolParser(ToolParser):
    name = "json"

    def stream(self) -> ToolStream:
        return JsonStream()

    def instructions(self) -> str:
        return ('To call a function, answer with only a JSON object {"name": <function-name>, "arguments": '
                "<args-json-object>}, or a JSON list of such objects to call several at once.")

    def format_calls(self, calls: list[tuple[str, Any]]) -> str:
        objs = [{"name": n, "arguments": a} for n, a in calls]
        return json.dumps(objs[0] if len(objs) == 1 else objs, ensure_ascii=False)

    def constraint(self, tools: list[tuple[str, dict[str, Any]]], max_calls: int) -> StructuredOutputs:
        calls = [call_schema(name, params) for name, params in tools]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = one if max_calls == 1 else {"type": "array", "items": one, "minItems": 1, "maxItems": max_calls}
        return StructuredOutputs(json=schema, param="tool_choice")


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "json": JsonToolParser}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()

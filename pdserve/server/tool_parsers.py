"""Tool-call parsers (`--tool-call-parser`): model text -> OpenAI tool calls plus the remaining content, whole or
streamed, and the output format each one expects (for the default tools prompt, for assistant tool calls in the
history, and for the grammar that enforces `tool_choice: "required"` or a named function).

A parser works on a stream of text deltas and yields events: content text, or a complete `ToolCall` (emitted once
its markup closes and its JSON parsed). `parse(text)` is the same stream fed the whole text, so a streamed reply
always reassembles to the non-streamed one.

Most formats are read by a `MarkerStream`: content until one of the format's markers, then calls read from the
marker on; text at a marker that does not read as a call stays content as written (the marker too), and the
whole output is never lost. The other parsers (`llama3_json`, `mistral`, `pythonic`, `qwen3_coder`) are in
tool_parsers_json.py, tool_parsers_pythonic.py and tool_parsers_xml.py; tool_parser_registry.py names them all.

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
from collections.abc import Mapping
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


def loads_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def decode_prefix(text: str) -> tuple[Any, int] | None:
    """The JSON value at the start of `text` (after whitespace) and where it ends; None while it is incomplete or
    not JSON (an object or array ends at its closing bracket, so no shorter prefix ever decodes to another one)."""
    start = len(text) - len(text.lstrip())
    try:
        obj, end = _DECODER.raw_decode(text, start)
    except ValueError:
        return None
    return obj, end


_DECODER = json.JSONDecoder()


def held_prefix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags` (held back: it may follow)."""
    for n in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        if any(text.endswith(t[:n]) for t in tags if len(t) > n):
            return n
    return 0


def structural_calls(calls: list[dict[str, Any]], max_calls: int, sep: str, begin: str = "",
                     end: str = "") -> StructuredOutputs:
    """xgrammar's structural tag for 1 to `max_calls` of the `calls` formats (one per tool), `sep` between two,
    the whole between `begin` and `end`; complete after the last call allowed (then only the stop token)."""
    call: dict[str, Any] = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    fmt = call
    if max_calls > 1:
        more = {"type": "sequence", "elements": [{"type": "const_string", "value": sep}, call]}
        fmt = {"type": "sequence", "elements": [call, {"type": "repeat", "min": 0, "max": max_calls - 1,
                                                         "content": more}]}
    if begin or end:
        fmt = {"type": "sequence", "elements": [*([{"type": "const_string", "value": begin}] if begin else []), fmt,
                                                 *([{"type": "const_string", "value": end}] if end else [])]}
    return StructuredOutputs(structural_tag=json.dumps({"type": "structural_tag", "format": fmt},
                                                       ensure_ascii=False), param="tool_choice")


def json_call_tag(begin: str, params: dict[str, Any], end: str) -> dict[str, Any]:
    """A call as a tag: its literal beginning (the name in it), arguments valid against `params` (at most one
    whitespace character in a row: a weak model cannot pad forever), its literal end."""
    return {"type": "tag", "begin": begin, "end": end,
            "content": {"type": "json_schema", "json_schema": params, "max_whitespace_cnt": 1}}


class ToolStream(ABC):
    """One choice's parse state."""

    @abstractmethod
    def feed(self, text: str) -> list[Event]: ...

    @abstractmethod
    def finish(self) -> list[Event]: ...


Tools = Mapping[str, dict[str, Any]]  # the request's tools: name -> parameters schema


class ToolParser(ABC):
    """A tool-call output format. Stateless: `stream()` gives the per-choice state."""

    name: ClassVar[str]
    # the format's markers are special tokens (Mistral's [TOOL_CALLS]): with tools, special tokens stay in the text
    keeps_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def stream(self, tools: Tools | None = None) -> ToolStream: ...

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

    def parse(self, text: str, tools: Tools | None = None) -> ParsedOutput:
        return parse_with(self.stream(tools), text)


def parse_with(stream: ToolStream, text: str) -> ParsedOutput:
    """A whole text through a fresh stream: its calls, and its content (None when it is only calls)."""
    events = stream.feed(text) + stream.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    content = "".join(e for e in events if isinstance(e, str))
    return ParsedOutput(None if calls and not content else content, calls)


@dataclass
class Taken:
    """What a parser took from text that starts at one of its markers: the calls, and how many characters they
    used. `used == 0`: not a call; the marker is content and the text after it is scanned again."""
    calls: list[ToolCall]
    used: int


NOT_A_CALL = Taken([], 0)


class MarkerStream(ToolStream):
    """Content until one of `markers`; from a marker on, `take` reads calls (None: it needs more text; at the end
    of the output, what it still cannot read is not a call). Whitespace between content and a call, and after
    the last call, is dropped, and so are the `separators` right after a call; a marker cut across deltas is
    held until it is whole or cannot be, so no markup is streamed as content."""

    markers: ClassVar[tuple[str, ...]]
    separators: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self.buf = ""  # text mode: a held partial marker; call mode: from the marker on
        self.ws = ""  # trailing whitespace of the content, held: dropped if a call follows
        self.in_call = False
        self.after_call = False  # whitespace and separators right after a call are dropped
        self.any_call = False

    @abstractmethod
    def take(self, buf: str, final: bool) -> Taken | None: ...

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        return self._scan(final=False)

    def finish(self) -> list[Event]:
        out = self._scan(final=True)
        self._text(self.buf, out)
        self.buf = ""
        if not self.any_call and self.ws:
            out.append(self.ws)
        self.ws = ""
        return out

    def _scan(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self.in_call:
                taken = self.take(self.buf, final)
                if taken is None:
                    return out
                self.in_call = False
                if taken.used == 0:  # not a call: its marker is content, what follows is scanned again
                    marker = next(m for m in self.markers if self.buf.startswith(m))
                    self._text(marker, out)
                    self.buf = self.buf[len(marker):]
                    continue
                out.extend(taken.calls)
                self.buf = self.buf[taken.used:]
                self.ws, self.after_call, self.any_call = "", True, True
                continue
            hits = [(i, m) for m in self.markers if (i := self.buf.find(m)) >= 0]
            if not hits:
                tags = self.markers + (self.separators if self.after_call else ())
                keep = 0 if final else held_prefix(self.buf, tags)
                self._text(self.buf[:len(self.buf) - keep], out)
                self.buf = self.buf[len(self.buf) - keep:]
                return out
            start = min(hits)[0]
            self._text(self.buf[:start], out)
            self.buf, self.in_call = self.buf[start:], True

    def _text(self, s: str, out: list[Event]) -> None:
        if self.after_call:
            s = s.lstrip()
            while (sep := next((p for p in self.separators if s.startswith(p)), None)) is not None:
                s = s[len(sep):].lstrip()
            if not s:
                return
            self.after_call = False
        s = self.ws + s
        body = s.rstrip()
        self.ws = s[len(body):]
        if body:
            out.append(body)


class BlockStream(MarkerStream):
    """Calls in blocks that open with one of `markers` and close with `CLOSE`; `call` reads a block's body."""

    CLOSE: ClassVar[str]

    def take(self, buf: str, final: bool) -> Taken | None:
        end = buf.find(self.CLOSE)
        if end < 0:
            return NOT_A_CALL if final else None
        marker = next(m for m in self.markers if buf.startswith(m))
        call = self.call(buf[len(marker):end])
        return NOT_A_CALL if call is None else Taken([call], end + len(self.CLOSE))

    @abstractmethod
    def call(self, body: str) -> ToolCall | None: ...


class HermesStream(BlockStream):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    markers = (OPEN,)

    def call(self, body: str) -> ToolCall | None:
        return call_from_json(loads_or_none(body.strip()))


class HermesToolParser(ToolParser):
    name = "hermes"

    def stream(self, tools: Tools | None = None) -> ToolStream:
        return HermesStream()

    def instructions(self) -> str:
        return ("For each function call, return a JSON object with the function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def format_calls(self, calls: list[tuple[str, Any]]) -> str:
        return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n</tool_call>"
                         for n, a in calls)

    def constraint(self, tools: list[tuple[str, dict[str, Any]]], max_calls: int) -> StructuredOutputs:
        # as xgrammar's built-in tool tags: the name is part of the tag's literal beginning; a newline between calls
        tags = [json_call_tag(f'{HermesStream.OPEN}\n{{"name": {json.dumps(name)}, "arguments": ', params,
                              f"}}\n{HermesStream.CLOSE}") for name, params in tools]
        return structural_calls(tags, max_calls, "\n")


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
            obj = loads_or_none(text.strip())
            items = obj if isinstance(obj, list) else [obj]
            calls = [call_from_json(o) for o in items]
            if calls and all(c is not None for c in calls):
                return [c for c in calls if c is not None]
        return [text] if text else []


class JsonToolParser(ToolParser):
    name = "json"

    def stream(self, tools: Tools | None = None) -> ToolStream:
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

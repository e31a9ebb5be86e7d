"""JSON tool-call formats behind a marker: `llama3_json` (Llama 3.1 / 3.2) and `mistral` (tool_parsers.py
explains the stream and its events).

- `llama3_json`: a call is `{"name": ..., "parameters": {...}}` (`arguments` is read too), optionally after
  `<|python_tag|>`; several are separated by `;`. A call starts at `<|python_tag|>` or at `{"name"` anywhere in
  the output; text before it is content. `<|python_tag|>` followed by what is not call JSON (Llama's built-in
  tools, code) stays content.
- `mistral`: `[TOOL_CALLS]` followed by a JSON list of `{"name", "arguments"}` objects (v0.3 tokenizers), or by
  `name[ARGS]{...}` (v11+ tokenizers, one call per `[TOOL_CALLS]`; `name[CALL_ID]id[ARGS]{...}` too). Text before
  it is content. Call ids are 9 letters and digits, as Mistral's chat templates require of the ids sent back.
  `[TOOL_CALLS]` is a special token in Mistral's tokenizers: with tools in a request the server keeps special
  tokens in the text (`skip_special_tokens` off), as vLLM does, so the marker reaches the parser.

An incomplete JSON value is held (the stream waits for the rest); at the end of the output it is content.
"""

from __future__ import annotations

import json
import random
import re
import string
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
    call_from_json,
    decode_prefix,
    json_call_tag,
    structural_calls,
)


class Llama3JsonStream(MarkerStream):
    PYTHON_TAG = "<|python_tag|>"
    markers = (PYTHON_TAG, '{"name"')
    separators = (";",)

    def take(self, buf: str, final: bool) -> Taken | None:
        start = len(self.PYTHON_TAG) if buf.startswith(self.PYTHON_TAG) else 0
        got = decode_prefix(buf[start:])
        if got is None:
            return NOT_A_CALL if final else None
        call = call_from_json(got[0])
        return NOT_A_CALL if call is None else Taken([call], start + got[1])


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def stream(self, tools: Tools | None = None) -> ToolStream:
        return Llama3JsonStream()

    def instructions(self) -> str:
        return ('To call a function, respond with a JSON object {"name": <function-name>, "parameters": '
                "<args-json-object>}; to call several, separate the objects with \"; \".")

    def format_calls(self, calls: list[tuple[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)

    def constraint(self, tools: list[tuple[str, dict[str, Any]]], max_calls: int) -> StructuredOutputs:
        tags = [json_call_tag(f'{{"name": {json.dumps(name)}, "parameters": ', params, "}") for name, params in tools]
        return structural_calls(tags, max_calls, "; ")


_ID_CHARS = string.ascii_letters + string.digits
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def mistral_call_id() -> str:
    return "".join(random.choices(_ID_CHARS, k=9))


class MistralStream(MarkerStream):
    MARKER, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    markers = (MARKER,)

    def take(self, buf: str, final: bool) -> Taken | None:
        rest = buf[len(self.MARKER):]
        head = rest.lstrip()
        if not head:
            return NOT_A_CALL if final else None
        if head[0] in "[{":  # a JSON list of calls (or one call object)
            got = decode_prefix(rest)
            if got is None:
                return NOT_A_CALL if final else None
            items = got[0] if isinstance(got[0], list) else [got[0]]
            calls = [call_from_json(o) for o in items]
            if not calls or any(c is None for c in calls):
                return NOT_A_CALL
            return Taken([ToolCall(c.name, c.arguments, mistral_call_id()) for c in calls if c is not None],
                         len(self.MARKER) + got[1])
        return self._take_v11(rest, final)

    def _take_v11(self, rest: str, final: bool) -> Taken | None:
        """`name[ARGS]{...}` or `name[CALL_ID]id[ARGS]{...}`."""
        at = rest.find(self.ARGS)
        if at < 0:  # still reading the name: a character no name (or id) has means this is not a call
            ok = re.fullmatch(r"\s*[A-Za-z0-9_.\-\[\]]{0,120}", rest) is not None
            return NOT_A_CALL if final or not ok else None
        name, _, call_id = rest[:at].strip().partition(self.CALL_ID)
        got = decode_prefix(rest[at + len(self.ARGS):])
        if got is None:
            return NOT_A_CALL if final else None
        if not _NAME.fullmatch(name) or not isinstance(got[0], dict):
            return NOT_A_CALL
        cid = call_id if re.fullmatch(r"[A-Za-z0-9]{9}", call_id) else mistral_call_id()
        return Taken([ToolCall(name, json.dumps(got[0], ensure_ascii=False), cid)],
                     len(self.MARKER) + at + len(self.ARGS) + got[1])


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def stream(self, tools: Tools | None = None) -> ToolStream:
        return MistralStream()

    def instructions(self) -> str:
        return ('To call functions, respond with [TOOL_CALLS] followed by a JSON list of calls: [TOOL_CALLS]'
                '[{"name": <function-name>, "arguments": <args-json-object>}, ...]')

    def format_calls(self, calls: list[tuple[str, Any]]) -> str:
        return MistralStream.MARKER + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)

    def constraint(self, tools: list[tuple[str, dict[str, Any]]], max_calls: int) -> StructuredOutputs:
        # the v0.3 list form, which every Mistral tokenizer's parser reads
        tags = [json_call_tag(f'{{"name": {json.dumps(name)}, "arguments": ', params, "}") for name, params in tools]
        return structural_calls(tags, max_calls, ", ", begin=MistralStream.MARKER + "[", end="]")

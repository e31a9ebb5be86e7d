"""Tool calling on /v1/chat/completions: `tools`, `tool_choice` and `parallel_tool_calls` checked, the conversation
prepared for the chat template, and the grammar that enforces `tool_choice: "required"` or a named function.

Prompt. The tools go to the chat template as Hugging Face templates take them (`apply_chat_template(messages,
tools=...)`). A template that does not render them (probed once per server: a tool with a sentinel name) gets the
default tools prompt instead: DEFAULT_TOOLS_PROMPT with the tools' JSON and the parser's output format, appended to
a leading system message or sent as a new one. `tool_choice: "none"` (the default without tools) puts no tools in
the prompt.

History. An assistant message's `tool_calls` (their `arguments` decoded from JSON text to an object, as vLLM passes
them) and `role: "tool"` results go to the template as they are when it renders them (probed the same way).
Otherwise the calls are appended to the assistant's content in the parser's format (hermes: `<tool_call>` blocks),
and a tool result becomes a user message `<tool_response>\\n{content}\\n</tool_response>`.

Enforcing. `required` (1 to MAX_PARALLEL_TOOL_CALLS calls; exactly one with `parallel_tool_calls: false`) and a
named function (exactly one call of it) constrain the output with the structured-output machinery: the whole
output is the parser's call markup around `{"name": <one of the tools>, "arguments": <that tool's parameters
schema>}`, so the arguments always validate, and after the last call allowed the grammar admits only the stop
token. Such an output is calls only: what the parser leaves over (a call cut off by max_tokens or a stop string)
is dropped, never content. `auto` is unconstrained: the parser decides what is a call.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.errors import ErrorCode, RequestRejected
from pdserve.sampling_params import MAX_STRUCTURED_SPEC_CHARS, StructuredOutputs
from pdserve.server.tool_parsers import Event, ParsedOutput, ToolCall, ToolParser, ToolStream, parse_with

MAX_TOOLS = 128
# the most calls one reply may make under tool_choice "required" with parallel calls allowed: the grammar ends the
# turn after this many (a small model would otherwise call until max_tokens)
MAX_PARALLEL_TOOL_CALLS = 8
# a tool's parameters schema, as JSON text: bounds each schema check and the memory of the check cache below (its
# keys are the schemas' texts: SCHEMA_CHECK_CACHE x this at most); all tools together are bounded as prompt text
MAX_TOOL_SCHEMA_CHARS = MAX_STRUCTURED_SPEC_CHARS
SCHEMA_CHECK_CACHE = 256
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's rule (letters, digits, _ and -; at most 64), plus "."

DEFAULT_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "{instructions}")


def _bad_tool(message: str, param: str) -> RequestRejected:
    return RequestRejected(message, param, ErrorCode.INVALID_TOOL)


def _bad_choice(message: str, param: str = "tool_choice") -> RequestRejected:
    return RequestRejected(message, param, ErrorCode.INVALID_TOOL_CHOICE)


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str | None
    parameters: dict[str, Any]  # a JSON schema of type object

    def as_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[FunctionTool, ...] = ()
    choice: str = "none"  # none | auto | required | named
    named: str | None = None  # choice "named": the function
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Tools in the prompt and the output parsed for calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def constrained(self) -> bool:
        """The grammar makes the whole output tool calls (required, or a named function)."""
        return self.choice in ("required", "named")


class FilteredStream(ToolStream):
    """A parser's stream with its text dropped (an output the grammar makes all calls) and/or its calls past
    `max_calls` dropped (the request allows no more)."""

    def __init__(self, inner: ToolStream, keep_text: bool, max_calls: int | None) -> None:
        self.inner, self.keep_text, self.max_calls = inner, keep_text, max_calls
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        return self._filter(self.inner.feed(text))

    def finish(self) -> list[Event]:
        return self._filter(self.inner.finish())

    def _filter(self, events: list[Event]) -> list[Event]:
        out: list[Event] = []
        for e in events:
            if not isinstance(e, ToolCall):
                if self.keep_text:
                    out.append(e)
            elif self.max_calls is None or self.num_calls < self.max_calls:
                self.num_calls += 1
                out.append(e)
        return out


def parse_tools(raw: list[Any] | None) -> list[FunctionTool]:
    """OpenAI function tools; RequestRejected (invalid_tool) naming the first bad field."""
    if len(raw or []) > MAX_TOOLS:
        raise _bad_tool(f"tools has {len(raw or [])} entries; at most {MAX_TOOLS} are accepted", "tools")
    out: list[FunctionTool] = []
    for i, t in enumerate(raw or []):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise _bad_tool(f"{p} must be an object", p)
        if t.get("type") != "function":
            raise _bad_tool(f'{p}.type must be "function", got {t.get("type")!r}', f"{p}.type")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise _bad_tool(f"{p}.function must be an object", f"{p}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _bad_tool(f"{p}.function.name must be 1 to 64 letters, digits, '_', '-' or '.', got {name!r}",
                            f"{p}.function.name")
        if any(o.name == name for o in out):
            raise _bad_tool(f"{p}.function.name {name!r} is already used by another tool", f"{p}.function.name")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise _bad_tool(f"{p}.function.description must be a string", f"{p}.function.description")
        params = fn.get("parameters")
        params = {"type": "object", "properties": {}} if params is None else params
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise _bad_tool(f"{p}.function.parameters must be a JSON schema of type object",
                            f"{p}.function.parameters")
        if (size := len(json.dumps(params, ensure_ascii=False))) > MAX_TOOL_SCHEMA_CHARS:
            raise _bad_tool(f"{p}.function.parameters is {size} characters of JSON; at most "
                            f"{MAX_TOOL_SCHEMA_CHARS} are accepted", f"{p}.function.parameters")
        out.append(FunctionTool(name, desc, params))
    return out


def tool_plan(tools_raw: list[Any] | None, choice: Any, parallel: bool = True) -> ToolPlan:
    """The request's tools and tool_choice; RequestRejected naming the first bad field."""
    tools = tuple(parse_tools(tools_raw))
    if choice is None:
        return ToolPlan(tools, "auto" if tools else "none", None, parallel)
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _bad_choice(f"tool_choice must be none, auto, required or a function, got {choice!r}")
        if choice == "required" and not tools:
            raise _bad_choice('tool_choice "required" needs tools')
        return ToolPlan(tools, choice, None, parallel)
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(fn, dict):
        raise _bad_choice('tool_choice must be none, auto, required or {"type": "function", "function": {"name"}}')
    name = fn.get("name")
    if not isinstance(name, str) or not any(t.name == name for t in tools):
        raise _bad_choice(f"tool_choice names the function {name!r}, which is not in tools",
                          "tool_choice.function.name")
    return ToolPlan(tools, "named", name, parallel)


def _history_call(i: int, j: int, call: Any) -> tuple[str, str, Any]:
    """An assistant message's tool call as (id, name, arguments decoded from JSON text when they are JSON)."""
    p = f"messages[{i}].tool_calls[{j}]"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestRejected(f"{p} must be {{id, type: function, function: {{name, arguments}}}}", p,
                              ErrorCode.INVALID_PARAMETER)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            pass  # kept as the text it is
    return str(call.get("id") or f"call_{i}_{j}"), fn["name"], args


class ChatTools:
    """One server's tool calling: the parser, and what the model's chat template renders (probed once)."""

    PROBE = "pdserve_probe_tool_7f3a"

    def __init__(self, tokenizer: Any, parser: ToolParser,
                 schema_error: Callable[[dict[str, Any]], str | None]) -> None:
        self.tokenizer, self.parser = tokenizer, parser
        # a tool's parameters are checked on every request that offers it: cached by the schema's text
        checked = functools.lru_cache(maxsize=SCHEMA_CHECK_CACHE)(lambda text: schema_error(json.loads(text)))
        self.schema_error: Callable[[dict[str, Any]], str | None] = \
            lambda schema: checked(json.dumps(schema, sort_keys=True, ensure_ascii=False))
        self._caps: dict[str, bool] | None = None

    def constraint(self, plan: ToolPlan) -> StructuredOutputs | None:
        """The grammar for required / a named function; None for auto and none."""
        if plan.choice == "named":
            tools, max_calls = [t for t in plan.tools if t.name == plan.named], 1
        elif plan.choice == "required":
            tools, max_calls = list(plan.tools), MAX_PARALLEL_TOOL_CALLS if plan.parallel else 1
        else:
            return None
        return self.parser.constraint([(t.name, t.parameters) for t in tools], max_calls)

    def stream(self, plan: ToolPlan) -> ToolStream:
        """A choice's parse state. Under a constraint the output is calls only: text the parser leaves over (a
        call cut off by max_tokens or a stop string) is never content. Without parallel calls, calls after the
        first are dropped (`auto` cannot enforce it in the grammar; vLLM filters the same way)."""
        s = self.parser.stream({t.name: t.parameters for t in plan.tools})
        if plan.constrained or not plan.parallel:
            return FilteredStream(s, keep_text=not plan.constrained, max_calls=None if plan.parallel else 1)
        return s

    def parse(self, text: str, plan: ToolPlan) -> ParsedOutput:
        """A whole reply's calls and content, as `stream` gives them."""
        parsed = parse_with(self.stream(plan), text)
        return ParsedOutput(None, parsed.tool_calls) if plan.constrained else parsed

    def prepare(self, messages: list[dict[str, Any]],
                plan: ToolPlan) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The conversation and the tools for the chat template (a worker thread: probes and schema checks)."""
        caps = self.capabilities()
        msgs = [self._history(i, m, caps) for i, m in enumerate(messages)]
        if not plan.active:
            return msgs, None
        for i, t in enumerate(plan.tools):
            if (err := self.schema_error(t.parameters)) is not None:
                raise _bad_tool(f"tools[{i}].function.parameters is not a usable JSON schema: {err}",
                                f"tools[{i}].function.parameters")
        tools = [t.as_openai() for t in plan.tools]
        if caps["tools"]:
            return msgs, tools
        prompt = DEFAULT_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools),
                                             instructions=self.parser.instructions())
        if msgs and msgs[0]["role"] == "system":
            first = msgs[0]["content"]
            return [{**msgs[0], "content": f"{first}\n\n{prompt}" if first else prompt}, *msgs[1:]], None
        return [{"role": "system", "content": prompt}, *msgs], None

    def _history(self, i: int, m: dict[str, Any], caps: dict[str, bool]) -> dict[str, Any]:
        m = dict(m)
        raw = m.pop("tool_calls", None)
        if raw:
            if m["role"] != "assistant" or not isinstance(raw, list):
                raise RequestRejected(f"messages[{i}].tool_calls: only an assistant message carries tool calls "
                                      "(a list)", f"messages[{i}].tool_calls", ErrorCode.INVALID_PARAMETER)
            calls = [_history_call(i, j, c) for j, c in enumerate(raw)]
            if caps["tool_calls"]:
                m["tool_calls"] = [{"id": cid, "type": "function", "function": {"name": n, "arguments": a}}
                                   for cid, n, a in calls]
            else:
                text = self.parser.format_calls([(n, a) for _, n, a in calls])
                m["content"] = f"{m['content']}\n{text}" if m["content"] else text
        if m["role"] == "tool" and not caps["tool_role"]:
            return {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        return m

    def capabilities(self) -> dict[str, bool]:
        """What the chat template renders: `tools`, assistant `tool_calls`, `role: "tool"` messages."""
        if self._caps is None:
            user = {"role": "user", "content": "hi"}
            def asked(name: str) -> dict[str, Any]:
                call = {"id": "call_probe", "type": "function", "function": {"name": name, "arguments": {}}}
                return {"role": "assistant", "content": "", "tool_calls": [call]}

            tool = {"type": "function", "function": {"name": self.PROBE, "description": "probe",
                                                     "parameters": {"type": "object", "properties": {}}}}
            self._caps = {
                "tools": self._renders([user], [tool]),
                "tool_calls": self._renders([user, asked(self.PROBE)]),
                "tool_role": self._renders([user, asked("get"), {"role": "tool", "tool_call_id": "call_probe",
                                                          "content": self.PROBE}]),
            }
        return self._caps

    def _renders(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> bool:
        try:
            kw = {"tools": tools} if tools else {}
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
        except Exception:  # a template that refuses the shape does not know it
            return False
        return self.PROBE in str(text)

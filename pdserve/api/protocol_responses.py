"""OpenAI's Responses API request (POST /v1/responses) and its mapping onto a chat completion request.

A Responses request becomes the chat request it means: `instructions` a leading system message, the stored
conversation of `previous_response_id` and then `input` the messages (message items; `function_call` items an
assistant message's tool_calls, `function_call_output` items tool messages; reasoning items are left out of the
prompt, as chat templates drop earlier reasoning), function `tools` and `tool_choice` in chat's shape,
`text.format` as `response_format`, `max_output_tokens` as `max_completion_tokens`. The chat path then renders,
constrains and parses it exactly as it does a chat request.

Every other field of the API is refused by name (400 unsupported_parameter) unless it is set to a value that changes
nothing (RESPONSES_REFUSED); so are the chat fields a client may send here by mistake (`messages`, `stop`, `seed`,
...). Other unknown fields are accepted and logged once, as on the chat endpoint.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pdserve.api.protocol import ChatCompletionRequest
from pdserve.api.request_fields import refused_field
from pdserve.errors import ErrorCode, RequestRejected

# name -> the values that change nothing; any other value is refused (400, param: the name)
RESPONSES_REFUSED: dict[str, tuple[Any, ...]] = {
    "access_programs": (None,), "background": (None, False), "background_options": (None,),
    "context_management": (None, []), "conversation": (None,), "image": (None,), "include": (None, []),
    "max_tool_calls": (None,), "moderation": (None,), "prompt": (None,), "prompt_cache_options": (None,),
    "prompt_cache_retention": (None,), "service_tier": (None, "auto", "default"),
    "stream_options": (None, {}, {"include_obfuscation": False}), "top_logprobs": (None, 0),
    "truncation": (None, "disabled"),
    # chat completion fields, not part of this API: refused rather than silently ignored
    **{name: (None,) for name in ("messages", "max_tokens", "max_completion_tokens", "n", "stop", "seed",
                                  "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                                  "logit_bias", "logprobs", "response_format", "structured_outputs",
                                  "functions", "function_call", "chat_template_kwargs")},
}
MAX_METADATA = 16  # OpenAI's bounds on `metadata`: pairs, key and value lengths
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512
ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")


def _unsupported(message: str, param: str) -> RequestRejected:
    return RequestRejected(message, param, ErrorCode.UNSUPPORTED_PARAMETER)


def _invalid(message: str, param: str) -> RequestRejected:
    return RequestRejected(message, param, ErrorCode.INVALID_PARAMETER)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {format: {type: text | json_object | json_schema, ...}, verbosity}
    reasoning: dict[str, Any] | None = None  # accepted empty; output reasoning comes from --reasoning-parser
    store: bool | None = None  # null: true
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None  # identifiers, echoed (they never change the output)
    prompt_cache_key: str | None = None
    stream: bool = False

    def check(self) -> None:
        """RequestRejected naming the first field that cannot be honoured or is malformed."""
        if (name := refused_field(self.model_extra, RESPONSES_REFUSED)) is not None:
            raise _unsupported(f"{name} is not supported by this server", name)
        for key, value in (self.reasoning or {}).items():
            if value is not None:  # effort, summary: no way to honour them here
                raise _unsupported(f"reasoning.{key} is not supported by this server", f"reasoning.{key}")
        text = self.text or {}
        if (extra := sorted(set(text) - {"format", "verbosity"})):
            raise _unsupported(f"text.{extra[0]} is not supported by this server", f"text.{extra[0]}")
        if text.get("verbosity") not in (None, "medium"):
            raise _unsupported("text.verbosity is not supported by this server", "text.verbosity")
        meta = self.metadata or {}
        if len(meta) > MAX_METADATA or any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE
                                           for k, v in meta.items()):
            raise _invalid(f"metadata takes at most {MAX_METADATA} pairs, keys of at most {MAX_METADATA_KEY} and "
                           f"values of at most {MAX_METADATA_VALUE} characters", "metadata")
        if not self.input and not self.previous_response_id:
            raise _invalid("input is required (a string or a list of input items)", "input")

    def input_items(self) -> list[dict[str, Any]]:
        """`input` as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return list(self.input or [])

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this one means, after the stored conversation `history` (previous_response_id)."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += items_to_messages(history, "previous_response_id")
        messages += items_to_messages(self.input_items(), "input")
        if not messages:
            raise _invalid("input is empty", "input")
        return ChatCompletionRequest.model_validate({
            "model": self.model, "messages": messages, "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "tools": chat_tools(self.tools),
            "tool_choice": chat_tool_choice(self.tool_choice), "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": None if self.forces_calls() else response_format(self.text), "user": self.user,
            "stream": self.stream})

    def forces_calls(self) -> bool:
        """tool_choice required or a named function: the output is tool calls only, so `text.format` (which shapes
        text output) has nothing to shape; the tool grammar alone constrains it."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, dict))


def items_to_messages(items: list[dict[str, Any]], param: str) -> list[dict[str, Any]]:
    """Input items as chat messages; RequestRejected naming the first item that is not supported."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        p = f"{param}[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ROLES:
                raise _invalid(f"{p}.role must be one of {', '.join(ROLES)}", f"{p}.role")
            out.append({"role": item["role"], "content": _content_text(item.get("content"), f"{p}.content")})
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", p), "type": "function",
                    "function": {"name": _text(item, "name", p), "arguments": _text(item, "arguments", p)}}
            if out and out[-1]["role"] == "assistant":  # calls after the assistant's text: one message
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _text(item, "call_id", p),
                        "content": _content_text(item.get("output"), f"{p}.output")})
        elif kind != "reasoning":  # reasoning items: not part of the prompt
            raise _unsupported(f"{p}.type {kind!r} is not supported (message, function_call, "
                               "function_call_output and reasoning items only)", f"{p}.type")
    return out


def _text(item: dict[str, Any], key: str, p: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _invalid(f"{p}.{key} must be a string", f"{p}.{key}")
    return value


def _content_text(content: Any, p: str) -> str:
    """A message's content (a string, or text parts) as one text; other parts (images, files) are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(f"{p} must be a string or a list of content parts", p)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise _unsupported(f"{p}[{j}]: content part type {kind!r} is not supported (text parts only)",
                               f"{p}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools ({type, name, description, parameters, strict}) in chat's shape; other tool types
    (web search, file search, MCP, ...) are refused."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise RequestRejected(f"tools[{i}].type {t.get('type')!r} is not supported (function tools only)",
                                  f"tools[{i}].type", ErrorCode.INVALID_TOOL)
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                     if t.get(k) is not None}})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """none, auto, required, or {type: function, name} in chat's shape; other choices are refused."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestRejected('tool_choice must be none, auto, required or {"type": "function", "name": ...}',
                          "tool_choice", ErrorCode.INVALID_TOOL_CHOICE)


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format: text (none), json_object, json_schema {name, schema, strict}."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise RequestRejected(f"text.format.type must be text, json_object or json_schema, got {kind!r}",
                              "text.format.type", ErrorCode.INVALID_STRUCTURED_OUTPUT)
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema"),
                                                   "strict": fmt.get("strict")}}


# chat's param paths -> this API's (an error raised on the chat request names the field the client sent)
PARAM_NAMES = (("response_format.json_schema.schema", "text.format.schema"), ("response_format", "text.format"),
               ("tool_choice.function.name", "tool_choice.name"), ("max_completion_tokens", "max_output_tokens"),
               ("max_tokens", "max_output_tokens"), ("messages", "input"), ("prompt", "input"))


def responses_param(param: str | None) -> str | None:
    """A chat request's error param as the Responses field it came from."""
    if param is None:
        return None
    if param.startswith("tools[") and ".function" in param:  # tools[i].function.name -> tools[i].name
        head, _, rest = param.partition(".function")
        return head + rest
    for chat, ours in PARAM_NAMES:
        if param == chat or param.startswith(chat + ".") or param.startswith(chat + "["):
            return ours if chat in ("messages", "prompt") else ours + param[len(chat):]
    return param

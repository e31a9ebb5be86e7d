"""Anthropic Messages request bodies (POST /v1/messages, /v1/messages/count_tokens) and their translation into the
chat request the chat serving path runs (pdserve/server/serving_messages.py).

Implemented: model, messages (string content, or text / tool_use / tool_result blocks), system (a string or text
blocks), max_tokens, temperature, top_p, top_k, stop_sequences, stream, tools (custom tools: name, description,
input_schema), tool_choice (auto, any, tool, none; disable_parallel_tool_use), metadata.user_id (the tenant when
no X-Tenant header is sent). `cache_control` (on the request, blocks and tools) is accepted and has no effect (the
prefix cache is automatic). Every other field, block type or tool type is refused with a 400 naming it
(`unsupported_parameter`): nothing is dropped silently. A field sent as null counts as absent (the SDK's own
blocks, dumped, carry nulls: `citations`, `caller`, ...); a tool_use block's `caller` may be the direct caller,
`{"type": "direct"}`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdserve.api.protocol import ChatCompletionRequest
from pdserve.errors import ErrorCode, RequestRejected

_BLOCK_KEYS = {"text": {"type", "text", "cache_control"},
               "tool_use": {"type", "id", "name", "input", "cache_control"},
               "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"}}
_DIRECT = {"type": "direct"}  # a tool_use block's caller: the model itself
_TOOL_KEYS = {"name", "description", "input_schema", "type", "cache_control"}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # "tool" names one: a function tool_choice


def _refuse(param: str, what: str = "is not supported by this server") -> RequestRejected:
    return RequestRejected(f"{param} {what}", param, ErrorCode.UNSUPPORTED_PARAMETER)


def _invalid(param: str, what: str) -> RequestRejected:
    return RequestRejected(f"{param} {what}", param, ErrorCode.INVALID_PARAMETER)


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept to be refused by name

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens: the prompt part of a Messages request."""

    model_config = ConfigDict(extra="allow")  # kept to be refused by name

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None  # a prompt-caching hint: no effect (the prefix cache is automatic)

    def refused(self) -> str | None:
        """The first field this server does not implement (any undeclared one), or None."""
        return next((k for k, v in (self.model_extra or {}).items() if v is not None), None)

    def to_chat(self) -> ChatCompletionRequest:
        """The same conversation as a chat request; RequestRejected naming the first field it cannot carry."""
        if (name := self.refused()) is not None:
            raise _refuse(name)
        try:
            return ChatCompletionRequest.model_validate({"model": self.model, **self._conversation(),
                                                         **self._chat_fields()})
        except ValidationError as e:  # a value the chat request cannot hold (the blocks were checked above)
            raise RequestRejected(f"invalid request: {e.errors()[0].get('msg')}", None) from e

    def _chat_fields(self) -> dict[str, Any]:
        return {"max_tokens": 1}

    def _conversation(self) -> dict[str, Any]:
        out: dict[str, Any] = {"messages": [*_system(self.system), *chat_messages(self.messages)]}
        if self.tools is not None:
            out["tools"] = [_tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            out["tool_choice"], parallel = _tool_choice(self.tool_choice)
            out["parallel_tool_calls"] = parallel
        return out


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None

    @property
    def user(self) -> str | None:
        """metadata.user_id: the request's tenant when no X-Tenant header names one."""
        uid = (self.metadata or {}).get("user_id")
        return uid if isinstance(uid, str) else None

    def _chat_fields(self) -> dict[str, Any]:
        for key, value in (self.metadata or {}).items():
            if key != "user_id" and value is not None:
                raise _refuse(f"metadata.{key}")
        fields: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "top_k": self.top_k, "stop": self.stop_sequences, "stream": self.stream, "user": self.user}
        if self.stream:  # the last chunk carries the usage that message_delta reports
            fields["stream_options"] = {"include_usage": True}
        return fields


def _system(system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    return [{"role": "system", "content": "\n".join(_texts(system, "system"))}]


def _texts(blocks: list[dict[str, Any]], param: str) -> list[str]:
    """Text blocks' texts (system, a tool_result's content)."""
    out = []
    for j, b in enumerate(blocks):
        _check_block(b, f"{param}[{j}]", ("text",))
        out.append(b["text"])
    return out


def _check_block(b: Any, p: str, allowed: tuple[str, ...]) -> str:
    """The block's type, checked: one of `allowed`, with no key it does not implement and its fields typed."""
    kind = b.get("type") if isinstance(b, dict) else None
    if kind not in allowed:
        raise _refuse(f"{p}.type", f"{kind!r} is not supported here (supported: {', '.join(allowed)})")
    for key, value in b.items():
        if key not in _BLOCK_KEYS[kind] and value is not None and not (key == "caller" and value == _DIRECT):
            raise _refuse(f"{p}.{key}")
    if kind == "text" and not isinstance(b.get("text"), str):
        raise _invalid(f"{p}.text", "must be a string")
    if kind == "tool_use" and not (isinstance(b.get("id"), str) and isinstance(b.get("name"), str)
                                   and isinstance(b.get("input"), dict)):
        raise _invalid(p, "must have an id and a name (strings) and an input (an object)")
    if kind == "tool_result" and not isinstance(b.get("tool_use_id"), str):
        raise _invalid(f"{p}.tool_use_id", "must be a string")
    return kind


def chat_messages(messages: list[AnthropicMessage]) -> list[dict[str, Any]]:
    """Anthropic turns as chat messages: an assistant's tool_use blocks become its tool_calls, a user's
    tool_result blocks become `role: "tool"` messages (in block order, text between them as user messages)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        for key, value in (m.model_extra or {}).items():
            if value is not None:
                raise _refuse(f"messages[{i}].{key}")
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            out.append(_assistant(i, m.content))
        else:
            out += _user(i, m.content)
    return out


def _assistant(i: int, blocks: list[dict[str, Any]]) -> dict[str, Any]:
    texts, calls = [], []
    for j, b in enumerate(blocks):
        if _check_block(b, f"messages[{i}].content[{j}]", ("text", "tool_use")) == "text":
            texts.append(b["text"])
        else:
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}})
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user(i: int, blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, b in enumerate(blocks):
        p = f"messages[{i}].content[{j}]"
        if _check_block(b, p, ("text", "tool_result")) == "text":
            texts.append(b["text"])
            continue
        if texts:
            out.append({"role": "user", "content": "".join(texts)})
            texts = []
        content = b.get("content", "")
        if isinstance(content, list):
            content = "".join(_texts(content, f"{p}.content"))
        elif not isinstance(content, str):
            raise _invalid(f"{p}.content", "must be a string or text blocks")
        if b.get("is_error"):  # the template has no error flag: the model reads it in the text
            content = f"Error: {content}"
        out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": content})
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _tool(i: int, t: Any) -> dict[str, Any]:
    """An Anthropic custom tool as an OpenAI function tool (checked again there: name, schema)."""
    p = f"tools[{i}]"
    if not isinstance(t, dict):
        raise _invalid(p, "must be an object")
    if t.get("type", "custom") != "custom":  # server tools (web_search, bash, text_editor, ...)
        raise _refuse(f"{p}.type", f"{t.get('type')!r} is not supported (custom tools only)")
    for key, value in t.items():
        if key not in _TOOL_KEYS and value is not None:
            raise _refuse(f"{p}.{key}")
    if not isinstance(t.get("input_schema"), dict):
        raise RequestRejected(f"{p}.input_schema must be a JSON schema object", f"{p}.input_schema",
                              ErrorCode.INVALID_TOOL)
    fn = {"name": t.get("name"), "parameters": t["input_schema"]}
    if t.get("description") is not None:
        fn["description"] = t["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: dict[str, Any]) -> tuple[Any, bool]:
    """(the chat tool_choice, parallel calls allowed)."""
    kind = choice.get("type")
    for key, value in choice.items():
        if key not in ("type", "name", "disable_parallel_tool_use") and value is not None:
            raise _refuse(f"tool_choice.{key}")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    if kind not in _TOOL_CHOICES:
        raise RequestRejected(f"tool_choice.type must be auto, any, tool or none, got {kind!r}", "tool_choice.type",
                              ErrorCode.INVALID_TOOL_CHOICE)
    return _TOOL_CHOICES[kind], parallel

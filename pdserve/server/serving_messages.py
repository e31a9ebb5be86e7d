"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat serving path.

The body becomes a chat request (pdserve/api/protocol_messages.py) that runs exactly as /v1/chat/completions does:
the same checks, chat template, tool parsers and tool grammar (OpenAIServingChat.start_chat), the same choice and
stream chunks. What differs is only the reply's shape, built here from the chat reply: content blocks (thinking,
text, tool_use) instead of a message, Anthropic's stop reasons, and its named SSE events:

    message_start, ping, (content_block_start, content_block_delta*, content_block_stop)*, message_delta,
    message_stop

A tool call streams as a tool_use block whose input arrives as one input_json_delta (calls are parsed whole).
Errors leave in Anthropic's body on these routes (pdserve/api/errors.py), mid-stream as an `error` event.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from pdserve.api.errors import APIError
from pdserve.api.protocol import ChatCompletionRequest
from pdserve.api.protocol_messages import CountTokensRequest, MessagesRequest
from pdserve.api.sse import sse
from pdserve.errors import RequestRejected
from pdserve.server.serving import RequestContext, ServingResult
from pdserve.server.serving_chat import ChatRun, OpenAIServingChat

# chat field names in refusals raised by the shared chat checks -> the Messages API's names
_NAMES = [(re.compile(r"\.function\.parameters\b"), ".input_schema"), (re.compile(r"\.function\.(?=\w)"), "."),
          (re.compile(r"^stop$"), "stop_sequences")]


def _anthropic_name(text: str | None) -> str | None:
    for pattern, repl in _NAMES:
        text = pattern.sub(repl, text) if text is not None else None
    return text


@contextmanager
def anthropic_names() -> Iterator[None]:
    """Refusals from the shared chat checks name the Messages API's fields (tools[0].input_schema, not
    tools[0].function.parameters)."""
    try:
        yield
    except RequestRejected as e:  # renamed in place, then on to the app's one handler
        e.args, e.param = (str(_anthropic_name(str(e))),), _anthropic_name(e.param)
        raise
    except APIError as e:
        e.message, e.param = str(_anthropic_name(e.message)), _anthropic_name(e.param)
        e.args = (e.message,)
        raise


def tool_use_id(call_id: str) -> str:
    """Anthropic's id spelling for a parsed call (toolu_...); it comes back as a tool_result's tool_use_id."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(finish: str | None, stop: int | str | None, sequences: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a chat choice's finish_reason and matched stop string or token."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop, str) and stop in (sequences or []):
        return "stop_sequence", stop
    return "end_turn", None


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat reply's assistant message as content blocks: thinking, text, then its tool calls."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for tc in message.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": tool_use_id(tc["id"]), "name": tc["function"]["name"],
                       "input": json.loads(tc["function"]["arguments"])})
    return blocks


class BlockStream:
    """Chat stream deltas -> content block events: a block opens when a delta of another kind arrives (or a new
    tool call) and closes before the next one opens, or at the end."""

    def __init__(self) -> None:
        self.index = -1  # the open block's index
        self.kind: str | None = None  # the open block's type; None: none open

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if text := delta.get("reasoning_content"):
            out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": text}))
        if text := delta.get("content"):
            out += self._open("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": text}))
        for tc in delta.get("tool_calls") or []:
            fn = tc.get("function") or {}
            if tc.get("id"):  # a call's first delta: id and name
                out += self._open("tool_use", {"type": "tool_use", "id": tool_use_id(tc["id"]), "name": fn["name"],
                                               "input": {}}, new=True)
            if fn.get("arguments"):
                out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out

    def close(self) -> list[dict[str, Any]]:
        if self.kind is None:
            return []
        self.kind = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _open(self, kind: str, block: dict[str, Any], new: bool = False) -> list[dict[str, Any]]:
        if self.kind == kind and not new:
            return []
        out = self.close()
        self.index, self.kind = self.index + 1, kind
        return [*out, {"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}


class ServingMessages:
    """One model's Messages API: a view of its chat serving object (no state of its own)."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_message(self, body: MessagesRequest, ctx: RequestContext) -> ServingResult:
        """Validate and start (APIError / RequestRejected before anything is sent), then the message or its
        event stream."""
        with anthropic_names():
            req = body.to_chat()
            run = await self.chat.start_chat(req, ctx, f"msg_{uuid.uuid4().hex[:24]}")
        if body.stream:
            return self.chat.guarded(self._lines(self._events(req, run, body)), run.children)
        outs = await self.chat.collect(run.children, ctx)
        c = outs[0].outputs[0]
        message = self.chat.choice(0, c, req, run.plan)
        reason, sequence = stop_reason(message["finish_reason"], c.stop_reason, body.stop_sequences)
        usage = self.chat.usage(run.children)
        return {**self._shell(run), "content": content_blocks(message["message"]), "stop_reason": reason,
                "stop_sequence": sequence, "usage": {"input_tokens": usage["prompt_tokens"],
                                                     "output_tokens": usage["completion_tokens"]}}

    async def count_tokens(self, body: CountTokensRequest) -> dict[str, Any]:
        """The prompt's token count, rendered exactly as a Messages request with these fields would be."""
        with anthropic_names():
            req = body.to_chat()
            self.chat.check_model(req.model)
            prompt = await self.chat.chat_prompt(req, self.chat.tool_plan(req))
        return {"input_tokens": len(prompt["prompt_token_ids"])}

    @staticmethod
    def _shell(run: ChatRun) -> dict[str, Any]:
        return {"id": run.rid, "type": "message", "role": "assistant", "model": run.model}

    async def _lines(self, events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        """The events as SSE (`event: <type>`); an error mid-stream ends it with an `error` event in Anthropic's
        body (no [DONE]: Anthropic's streams end with their last event)."""
        try:
            async for event in events:
                yield sse(event, event["type"])
        except APIError as e:
            if self.chat.metrics is not None:
                self.chat.metrics.error(e.kind)
            yield sse(e.anthropic_body(), "error")

    async def _events(self, req: ChatCompletionRequest, run: ChatRun,
                      body: MessagesRequest) -> AsyncIterator[dict[str, Any]]:
        children, plan = run.children, run.plan
        usage = {"input_tokens": len(children.reqs[0].prompt_token_ids), "output_tokens": 0}
        yield {"type": "message_start", "message": {**self._shell(run), "content": [], "stop_reason": None,
                                                    "stop_sequence": None, "usage": usage}}
        yield {"type": "ping"}
        blocks = BlockStream()
        finish: str | None = None
        stop: int | str | None = None
        async for chunk in self.chat.chunks(req, children, {}, plan):
            if "usage" in chunk:  # the last chunk (stream_options.include_usage)
                usage["output_tokens"] = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                for event in blocks.feed(choice["delta"]):
                    yield event
                if choice["finish_reason"] is not None:
                    finish, stop = choice["finish_reason"], choice.get("stop_reason")
        for event in blocks.close():
            yield event
        reason, sequence = stop_reason(finish, stop, body.stop_sequences)
        yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
               "usage": {"output_tokens": usage["output_tokens"]}}
        yield {"type": "message_stop"}

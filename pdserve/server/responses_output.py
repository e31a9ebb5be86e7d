"""A Responses API reply built from the chat path's assistant deltas: output items and their typed stream events.

The chat path yields the reply as deltas (`reasoning_content`, `content`, and tool calls: a first piece with the
call's id and name, then its arguments). OutputBuilder turns them into the Responses output: a `reasoning` item
(reasoning_text content), a `message` item (output_text content), a `function_call` item per call (call_id, name,
arguments); consecutive deltas of one kind extend the open item, another kind closes it. Each step returns the
events OpenAI streams for it, numbered by `sequence_number`:

  response.output_item.added, response.content_part.added, response.output_text.delta (or reasoning_text),
  response.output_text.done, response.content_part.done, response.output_item.done;
  for a call: response.output_item.added, response.function_call_arguments.delta, ...arguments.done,
  response.output_item.done.

The non-streamed reply is built by the same builder (its events dropped), so both carry the same items.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

Event = dict[str, Any]

_TEXT_KINDS = {  # item type -> (its content part type, the delta / done event prefix)
    "message": ("output_text", "response.output_text"),
    "reasoning": ("reasoning_text", "response.reasoning_text"),
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    def __init__(self) -> None:
        self.output: list[dict[str, Any]] = []
        self.seq = 0
        self._open: dict[str, Any] | None = None  # the item deltas still extend

    def event(self, type_: str, **fields: Any) -> Event:
        ev = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    # ---- chat deltas -------------------------------------------------------------------------------------------
    def feed(self, delta: dict[str, Any]) -> list[Event]:
        """A chat stream delta's events."""
        out: list[Event] = []
        if text := delta.get("reasoning_content"):
            out += self.add_text("reasoning", text)
        if text := delta.get("content"):
            out += self.add_text("message", text)
        for tc in delta.get("tool_calls") or []:
            fn = tc.get("function") or {}
            if tc.get("id"):  # a call's first piece: id and name
                out += self.add_call(tc["id"], fn.get("name", ""))
            if fn.get("arguments"):
                out += self.add_arguments(fn["arguments"])
        return out

    def add_message(self, message: dict[str, Any]) -> None:
        """A whole assistant message (chat's non-streamed reply): reasoning, content, then its calls."""
        self.feed({"reasoning_content": message.get("reasoning_content"), "content": message.get("content")})
        for call in message.get("tool_calls") or []:
            self.add_call(call["id"], call["function"]["name"])
            self.add_arguments(call["function"]["arguments"])

    # ---- items -------------------------------------------------------------------------------------------------
    def add_text(self, kind: str, text: str) -> list[Event]:
        out: list[Event] = []
        item = self._open
        if item is None or item["type"] != kind:
            out += self.close()
            item = self._start({"id": new_id("msg" if kind == "message" else "rs"), "type": kind,
                                "status": "in_progress", "content": [],
                                **({"role": "assistant"} if kind == "message" else {"summary": []})}, out)
            part_type, _ = _TEXT_KINDS[kind]
            part = {"type": part_type, "text": "", **({"annotations": [], "logprobs": []}
                                                      if kind == "message" else {})}
            item["content"].append(part)
            out.append(self.event("response.content_part.added", **self._where(item), part=copy.deepcopy(part)))
        item["content"][0]["text"] += text
        out.append(self.event(f"{_TEXT_KINDS[kind][1]}.delta", **self._where(item), delta=text,
                              **({"logprobs": []} if kind == "message" else {})))
        return out

    def add_call(self, call_id: str, name: str) -> list[Event]:
        out = self.close()
        self._start({"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call_id,
                     "name": name, "arguments": ""}, out)
        return out

    def add_arguments(self, text: str) -> list[Event]:
        item = self._open
        assert item is not None and item["type"] == "function_call", "arguments before their call"
        item["arguments"] += text
        return [self.event("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=self._index(item), delta=text)]

    def close(self, status: str = "completed") -> list[Event]:
        """End the open item (if any): its done events."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        out: list[Event] = []
        if item["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=self._index(item), name=item["name"], arguments=item["arguments"]))
        else:
            part, (_, prefix) = item["content"][0], _TEXT_KINDS[item["type"]]
            where = self._where(item)
            out.append(self.event(f"{prefix}.done", **where, text=part["text"],
                                  **({"logprobs": []} if item["type"] == "message" else {})))
            out.append(self.event("response.content_part.done", **where, part=copy.deepcopy(part)))
        out.append(self.event("response.output_item.done", output_index=self._index(item),
                              item=copy.deepcopy(item)))
        return out

    def _start(self, item: dict[str, Any], out: list[Event]) -> dict[str, Any]:
        self.output.append(item)
        self._open = item
        out.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                              item=copy.deepcopy(item)))
        return item

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, it in enumerate(self.output) if it is item)

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self._index(item), "content_index": 0}

    def reasoning_text(self) -> str:
        return "".join(it["content"][0]["text"] for it in self.output if it["type"] == "reasoning")

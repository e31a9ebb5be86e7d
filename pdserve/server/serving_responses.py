"""POST /v1/responses (OpenAI's Responses API) on the chat path, and the stored responses behind
`previous_response_id` and GET / DELETE /v1/responses/{id}.

A request is mapped to the chat request it means (protocol_responses.py) and run by OpenAIServingChat.start_chat:
the same checks, chat template, tools prompt, tool-call grammar, structured output and parsers as
/v1/chat/completions. Its reply (chat's deltas, or chat's whole message) becomes Responses output items through
OutputBuilder (responses_output.py); a reply cut by `max_output_tokens` is `incomplete` with
`incomplete_details.reason: "max_output_tokens"`. Errors raised on the chat request name the Responses field
(`text.format.schema`, not `response_format.json_schema.schema`).

Streamed, the events go out as typed SSE (`event: <type>` and `data: {..., "sequence_number"}`), with no `[DONE]`:
response.created, response.in_progress, the items' events, then response.completed or response.incomplete; an error
mid-stream is an `error` event followed by response.failed. A response is stored (`store`, default true) once it
completed or is incomplete, with the conversation up to it (the previous one's, the input, the output), so
`previous_response_id` prepends that conversation to the next request's input (instructions are not carried over,
as OpenAI's).
"""

from __future__ import annotations

import copy
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from pdserve.api.errors import APIError
from pdserve.api.protocol import ChatCompletionRequest
from pdserve.api.protocol_responses import ResponsesRequest, responses_param
from pdserve.api.sse import sse
from pdserve.errors import RequestRejected
from pdserve.server.response_store import ResponseStore
from pdserve.server.responses_output import Event, OutputBuilder, new_id
from pdserve.server.serving import RequestContext, ServingResult
from pdserve.server.serving_chat import ChatRun, OpenAIServingChat


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"response {response_id!r} not found", param=param, code="response_not_found",
                    kind="not_found")


@contextmanager
def responses_params() -> Iterator[None]:
    """Errors raised on the mapped chat request name the Responses field the client sent."""
    try:
        yield
    except RequestRejected as e:
        e.param = responses_param(e.param)
        raise
    except APIError as e:
        e.param = responses_param(e.param)
        raise


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat, self.store = chat, store

    async def create(self, body: ResponsesRequest, ctx: RequestContext, owner: str) -> ServingResult:
        """Validate, map and start the request (APIError / RequestRejected before anything is sent), then its
        response object or its event stream."""
        self.chat.log_unknown_fields(body.model_extra)
        body.check()
        with responses_params():
            history = self.history(body, owner)
            chat_body = body.chat_request(history)
            run = await self.chat.start_chat(chat_body, ctx, new_id("resp"))
        resp = self.response_object(body, run)
        conversation = [*history, *body.input_items()]
        if body.stream:
            return self.chat.guarded(self._events(body, chat_body, run, resp, owner, conversation), run.children)
        out = (await self.chat.collect(run.children, ctx))[0].outputs[0]
        builder = OutputBuilder()
        builder.add_message(self.chat.choice(0, out, chat_body, run.plan)["message"])
        self._finish(body, run, resp, builder, out.finish_reason, owner, conversation)
        return resp

    def history(self, body: ResponsesRequest, owner: str) -> list[dict[str, Any]]:
        """The stored conversation `previous_response_id` continues (404 when it is unknown to this owner)."""
        if body.previous_response_id is None:
            return []
        entry = self.store.get(owner, body.previous_response_id)
        if entry is None:
            raise not_found(body.previous_response_id, "previous_response_id")
        return copy.deepcopy(entry.items)

    def response_object(self, body: ResponsesRequest, run: ChatRun) -> dict[str, Any]:
        """The response as created (in progress, no output yet); the request's settings echoed."""
        fmt = (body.text or {}).get("format") or {"type": "text"}
        return {
            "id": run.rid, "object": "response", "created_at": run.created, "status": "in_progress", "error": None,
            "incomplete_details": None, "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": run.model, "output": [], "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": body.store is not False, "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": fmt}, "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled", "usage": None,
            "user": body.user, "metadata": body.metadata or {}, "background": False,
            "safety_identifier": body.safety_identifier, "prompt_cache_key": body.prompt_cache_key}

    def _finish(self, body: ResponsesRequest, run: ChatRun, resp: dict[str, Any], builder: OutputBuilder,
                finish_reason: str | None, owner: str, conversation: list[dict[str, Any]]) -> list[Event]:
        """Close the output, complete `resp` (status, output, usage) and store it; the closing item events."""
        cut = finish_reason == "length"
        events = builder.close("incomplete" if cut else "completed")
        usage = self.chat.usage(run.children)
        reasoning = builder.reasoning_text()
        resp.update(status="incomplete" if cut else "completed", output=builder.output, usage={
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": len(self.chat.client.tokenizer.encode(
                reasoning, add_special_tokens=False)) if reasoning else 0},
            "total_tokens": usage["total_tokens"]})
        if cut:
            resp["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            resp["completed_at"] = int(time.time())
        if body.store is not False:
            self.store.put(owner, copy.deepcopy(resp), [*conversation, *copy.deepcopy(builder.output)])
        return events

    async def _events(self, body: ResponsesRequest, chat_body: ChatCompletionRequest, run: ChatRun,
                      resp: dict[str, Any], owner: str, conversation: list[dict[str, Any]]) -> AsyncIterator[str]:
        b = OutputBuilder()
        for kind in ("response.created", "response.in_progress"):
            yield _sse(b.event(kind, response=copy.deepcopy(resp)))
        finish: str | None = None
        base = {"id": run.rid, "object": "chat.completion.chunk", "created": run.created, "model": resp["model"]}
        try:
            async for chunk in self.chat.chunks(chat_body, run.children, base, run.plan):
                for choice in chunk["choices"]:
                    for ev in b.feed(choice["delta"]):
                        yield _sse(ev)
                    finish = choice.get("finish_reason") or finish
        except APIError as e:
            if self.chat.metrics is not None:
                self.chat.metrics.error(e.kind)
            yield _sse(b.event("error", code=e.code or str(e.status), message=e.message, param=e.param))
            resp.update(status="failed", output=b.output, error={"code": e.code or "server_error",
                                                                  "message": e.message})
            yield _sse(b.event("response.failed", response=resp))
            return
        for ev in self._finish(body, run, resp, b, finish, owner, conversation):
            yield _sse(ev)
        yield _sse(b.event(f"response.{resp['status']}", response=resp))


def _sse(ev: Event) -> str:
    return sse(ev, ev["type"])


def retrieve_response(store: ResponseStore, owner: str, response_id: str) -> dict[str, Any]:
    entry = store.get(owner, response_id)
    if entry is None:
        raise not_found(response_id)
    return entry.response


def delete_response(store: ResponseStore, owner: str, response_id: str) -> dict[str, Any]:
    if not store.delete(owner, response_id):
        raise not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}

"""/v1/chat/completions: messages through the model's chat template to an assistant message, with tool calls
parsed out of it when the request offers tools (tools.py, tool_parsers.py)."""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pdserve.api.errors import APIError
from pdserve.api.protocol import ChatCompletionRequest
from pdserve.errors import ErrorCode
from pdserve.outputs import CompletionOutput
from pdserve.sampling_params import SamplingParams
from pdserve.server.reasoning import ReasoningStream
from pdserve.server.serving import Children, OpenAIServing, RequestContext, ServingResult
from pdserve.server.tool_parsers import ToolCall, ToolStream
from pdserve.server.tools import ToolPlan, tool_plan


@dataclass(frozen=True)
class ChatRun:
    """A chat request admitted to the engine: its id, creation time, children and tool plan (what the chat and
    the Responses endpoints build their replies from)."""

    rid: str
    created: int
    children: Children
    plan: ToolPlan
    model: str  # the name replies carry: the model's, or the LoRA adapter's the request asked for


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, body: ChatCompletionRequest, ctx: RequestContext) -> ServingResult:
        """Validate and start the request. Raises APIError or RequestRejected (the app answers both) before
        anything is sent when the body is refused."""
        run = await self.start_chat(body, ctx, f"chatcmpl-{uuid.uuid4().hex}")
        rid, children, plan = run.rid, run.children, run.plan
        if body.stream:
            base = {"id": rid, "object": "chat.completion.chunk", "created": run.created, "model": run.model}
            return self.sse_stream(self.chunks(body, children, base, plan), children)
        outs = await self.collect(children, ctx)
        choices = [self.choice(i, out.outputs[0], body, plan) for i, out in enumerate(outs)]
        resp = {"id": rid, "object": "chat.completion", "created": run.created, "model": run.model,
                "choices": choices}
        if body.prompt_logprobs is not None:  # as vLLM: one list for the conversation, beside the choices
            resp["prompt_logprobs"] = self.prompt_logprobs(outs[0])
        return self.finish_response(resp, children, body)

    async def start_chat(self, body: ChatCompletionRequest, ctx: RequestContext, rid: str) -> ChatRun:
        """Check the body, render the conversation (tools included) and admit it under `rid`; nothing is sent yet.
        Raises APIError or RequestRejected when the body is refused."""
        self.check_body(body, 1)
        plan = self.tool_plan(body)
        params = self.to_params(body)
        self.constrain_tools(plan, params)
        prompt = await self.chat_prompt(body, plan)
        children = await self.start([prompt], params, rid, body, ctx)
        return ChatRun(rid, int(time.time()), children, plan, self.served_name(body.model))

    async def chat_prompt(self, body: ChatCompletionRequest, plan: ToolPlan) -> dict[str, Any]:
        """The conversation and its tools through the chat template, as a token-id prompt (also what
        /v1/messages/count_tokens counts)."""
        return await self.render_chat(body.messages, body.add_generation_prompt,
                                      functools.partial(self.tools.prepare, plan=plan), body.chat_template_kwargs)

    def tool_plan(self, body: ChatCompletionRequest) -> ToolPlan:
        plan = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls is not False)
        if body.tools:
            self.check_texts([json.dumps(body.tools, ensure_ascii=False)], "tools")
        return plan

    def constrain_tools(self, plan: ToolPlan, params: SamplingParams) -> None:
        """tool_choice required / a named function: the output is constrained to tool calls. A parser whose
        markers are special tokens keeps them in the text whenever tools are on (vLLM does the same)."""
        if plan.active and self.tools.parser.keeps_special_tokens:
            params.skip_special_tokens = False
        so = self.tools.constraint(plan)
        if so is None:
            return
        if params.structured_outputs is not None:
            raise APIError(400, f"tool_choice {plan.choice} and {params.structured_outputs.param} both constrain "
                           "the output; set one", param="tool_choice", code=ErrorCode.INVALID_STRUCTURED_OUTPUT.value)
        params.structured_outputs = so

    def choice(self, i: int, c: CompletionOutput, body: ChatCompletionRequest, plan: ToolPlan) -> dict[str, Any]:
        text = c.text
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            message["reasoning_content"], text = self.reasoning.extract(text)
            message["content"] = text
        finish = c.finish_reason
        if plan.active:
            parsed = self.tools.parse(text, plan)
            message["content"] = parsed.content
            if parsed.tool_calls:
                message["tool_calls"] = [tc.as_openai() for tc in parsed.tool_calls]
                finish = "tool_calls" if finish == "stop" else finish
        return {"index": i, "message": message,
                "logprobs": self._logprobs(c.logprobs or []) if body.logprobs else None,
                "finish_reason": finish, "stop_reason": c.stop_reason}

    async def chunks(self, body: ChatCompletionRequest, children: Children, base: dict[str, Any],
                      plan: ToolPlan) -> AsyncIterator[dict[str, Any]]:
        # A choice's role chunk goes out right before its first token's chunk, never at arrival: clients (vLLM's
        # bench, the openai SDK) stamp time to first token at the first chunk, so an early one would book the
        # whole prefill as an inter-token gap. vLLM does the same.
        started: set[int] = set()
        streams: dict[int, ToolStream] = {}
        thinking: dict[int, ReasoningStream] = {}
        num_calls: dict[int, int] = {}
        async for i, out in self.stream_all(children):
            if i not in started:
                started.add(i)
                if plan.active:
                    streams[i], num_calls[i] = self.tools.stream(plan), 0
                if self.reasoning is not None:
                    thinking[i] = self.reasoning.stream()
                yield {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]}
            c = out.outputs[0]
            lps = None
            if body.logprobs and c.delta_logprobs:
                lps = self._logprobs(c.delta_logprobs)
            if not c.delta_text and not c.finished and lps is None:
                continue
            deltas = self._reasoned_deltas(c, thinking.get(i), streams.get(i), num_calls, i)
            if not deltas and not c.finished and lps is None:  # held by the reasoning or the tool parser
                continue
            deltas = deltas or [{} if c.finished else {"content": ""}]
            finish = c.finish_reason
            if finish == "stop" and num_calls.get(i):
                finish = "tool_calls"
            for k, delta in enumerate(deltas):
                last = k == len(deltas) - 1
                yield {**base, "choices": [{"index": i, "delta": delta, "logprobs": lps if k == 0 else None,
                                            "finish_reason": finish if last else None,
                                            "stop_reason": c.stop_reason if last else None}]}
        if (last_chunk := self.final_chunk(base, children, body)) is not None:
            yield last_chunk

    def _reasoned_deltas(self, c: CompletionOutput, thinking: ReasoningStream | None, stream: ToolStream | None,
                         num_calls: dict[int, int], i: int) -> list[dict[str, Any]]:
        """With a reasoning parser: its reasoning pieces as reasoning_content deltas, its content through _deltas."""
        if thinking is None:
            return self._deltas(c.delta_text, c.finished, stream, num_calls, i)
        pieces = thinking.feed(c.delta_text) if c.delta_text else []
        if c.finished:
            pieces += thinking.finish()
        out: list[dict[str, Any]] = []
        content = "".join(t for kind, t in pieces if kind == "content")
        if reasoning := "".join(t for kind, t in pieces if kind == "reasoning"):
            out.append({"reasoning_content": reasoning})
        if content or c.finished:
            out += self._deltas(content, c.finished, stream, num_calls, i, allow_empty=not out)
        return out

    @staticmethod
    def _deltas(text: str, finished: bool, stream: ToolStream | None, num_calls: dict[int, int],
                i: int, allow_empty: bool = True) -> list[dict[str, Any]]:
        """A step's deltas: its text as content, or, with tools, the parser's content and calls. A call goes out
        as OpenAI sends one: index, id, type, name and empty arguments, then its arguments."""
        if stream is None:
            return [{"content": text}] if text or (not finished and allow_empty) else []
        events = stream.feed(text) if text else []
        if finished:
            events += stream.finish()
        out: list[dict[str, Any]] = []
        for e in events:
            if not isinstance(e, ToolCall):
                out.append({"content": e})
                continue
            n = num_calls[i]
            num_calls[i] += 1
            out.append({"tool_calls": [{"index": n, "id": e.id, "type": "function",
                                        "function": {"name": e.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": n, "function": {"arguments": e.arguments}}]})
        return out

    def _logprobs(self, out_lps: list[Any]) -> dict[str, Any]:
        def entry(tid: int, v: float) -> dict[str, Any]:
            t = self.token_text(tid)
            return {"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                            for lp in out_lps]}

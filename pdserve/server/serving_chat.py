"""/v1/chat/completions: messages through the model's chat template to an assistant message."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pdserve.server.protocol import ChatCompletionRequest
from pdserve.server.serving import Children, OpenAIServing, RequestContext, ServingResult


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, body: ChatCompletionRequest, ctx: RequestContext) -> ServingResult:
        """Validate and start the request. Raises APIError before anything is sent when the body is refused."""
        self.check_body(body, 1)
        params = self.to_params(body)
        prompt = await self.render_chat(body.messages, body.add_generation_prompt)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        children = await self.start([prompt], params, rid, body, ctx)
        reqs = children.reqs
        created = int(time.time())
        if body.stream:
            base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
            return self.sse_stream(self._chunks(body, children, base), children)
        outs = await self.collect(children, ctx)
        choices = []
        for i, out in enumerate(outs):
            c = out.outputs[0]
            choices.append({"index": i, "message": {"role": "assistant", "content": c.text},
                            "logprobs": self._logprobs(c.logprobs or []) if body.logprobs else None,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        resp = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": choices}
        if body.prompt_logprobs is not None:  # as vLLM: one list for the conversation, beside the choices
            resp["prompt_logprobs"] = self.prompt_logprobs(outs[0])
        return self.finish_response(resp, reqs, body)

    async def _chunks(self, body: ChatCompletionRequest, children: Children,
                      base: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        # A choice's role chunk goes out right before its first token's chunk, never at arrival: clients (vLLM's
        # bench, the openai SDK) stamp time to first token at the first chunk, so an early one would book the
        # whole prefill as an inter-token gap. vLLM does the same.
        started: set[int] = set()
        reqs = children.reqs
        async for i, out in self.stream_all(children):
            if i not in started:
                started.add(i)
                yield {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]}
            c = out.outputs[0]
            lps = None
            if body.logprobs and c.delta_logprobs:
                lps = self._logprobs(c.delta_logprobs)
            if not c.delta_text and not c.finished and lps is None:
                continue
            delta = {"content": c.delta_text} if c.delta_text or not c.finished else {}
            yield {**base, "choices": [{"index": i, "delta": delta, "logprobs": lps,
                                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
        if (last := self.final_chunk(base, reqs, body)) is not None:
            yield last

    def _logprobs(self, out_lps: list[Any]) -> dict[str, Any]:
        def entry(tid: int, v: float) -> dict[str, Any]:
            t = self.token_text(tid)
            return {"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                            for lp in out_lps]}

"""/v1/completions: prompts (text, token ids, or lists of either) to text completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pdserve.api.errors import APIError
from pdserve.api.protocol import CompletionRequest
from pdserve.engine.client import EngineRequest, PromptType
from pdserve.outputs import RequestOutput
from pdserve.server.serving import Children, OpenAIServing, RequestContext, ServingResult


def prompts_of(body: CompletionRequest) -> list[PromptType]:
    p = body.prompt
    if isinstance(p, str):
        prompts: list[PromptType] = [p]
    elif p and isinstance(p[0], int):
        prompts = [{"prompt_token_ids": p}]
    elif p and isinstance(p[0], list):
        prompts = [{"prompt_token_ids": x} for x in p]  # type: ignore[misc]
    else:
        prompts = list(p)  # type: ignore[arg-type]
    if not prompts:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return prompts


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, body: CompletionRequest, ctx: RequestContext) -> ServingResult:
        """Validate and start the request. Raises APIError or RequestRejected (the app answers both) before
        anything is sent when the body is refused."""
        prompts = prompts_of(body)
        self.check_body(body, len(prompts))
        self.check_texts((p for p in prompts if isinstance(p, str)), "prompt")
        params = self.to_params(body)
        if self._echo_logprobs(body) and params.prompt_logprobs is None:
            params.prompt_logprobs = body.logprobs  # as vLLM: echoed prompt tokens are scored with the same k
        rid = f"cmpl-{uuid.uuid4().hex}"
        children = await self.start(prompts, params, rid, body, ctx)
        reqs = children.reqs
        base = {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": self.served_name(body.model)}
        if body.stream:
            return self.sse_stream(self._chunks(body, children, base), children)
        outs = await self.collect(children, ctx)
        choices = []
        for i, out in enumerate(outs):
            c = out.outputs[0]
            prefix = self._echo_text(body, reqs[i])
            lps = self._logprobs(body, out, c.logprobs or [], len(prefix)) if body.logprobs is not None else None
            choices.append({"index": i, "text": prefix + c.text, "logprobs": lps, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason})
            if body.prompt_logprobs is not None:
                choices[-1]["prompt_logprobs"] = self.prompt_logprobs(out)
        return self.finish_response({**base, "choices": choices}, children, body)

    async def _chunks(self, body: CompletionRequest, children: Children,
                      base: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        # Nothing goes out for a choice before its first token: the echoed prompt rides on the first token's
        # chunk (as vLLM does), so a client's time to first chunk is the time to first token.
        started: set[int] = set()
        reqs = children.reqs
        async for i, out in self.stream_all(children):
            c = out.outputs[0]
            text = c.delta_text
            first = i not in started
            if first:
                started.add(i)
                text = self._echo_text(body, reqs[i]) + text
            lps = None
            if body.logprobs is not None and (c.delta_logprobs or first and self._echo_logprobs(body)):
                lps = self._logprobs(body, out if first else None, c.delta_logprobs or [], 0)
            if not text and not c.finished and lps is None:
                continue
            yield {**base, "choices": [{"index": i, "text": text, "logprobs": lps, "finish_reason": c.finish_reason,
                                        "stop_reason": c.stop_reason}]}
        if (last := self.final_chunk(base, children, body)) is not None:
            yield last

    def _echo_text(self, body: CompletionRequest, req: EngineRequest) -> str:
        if not body.echo:
            return ""
        return req.prompt if req.prompt is not None else str(self.client.tokenizer.decode(req.prompt_token_ids))

    @staticmethod
    def _echo_logprobs(body: CompletionRequest) -> bool:
        """echo + logprobs: the echoed prompt's tokens lead `logprobs` (OpenAI, vLLM); a PD hand-off computes no
        prompt logprobs (its prompt is not scored where it decodes), so there they are left out."""
        return body.echo and body.logprobs is not None and body.kv_transfer_params is None

    def _logprobs(self, body: CompletionRequest, out: RequestOutput | None, out_lps: list[Any],
                  text_offset: int) -> dict[str, Any]:
        """OpenAI's legacy `logprobs` of the output tokens; with echo, of the prompt tokens first (the first with
        logprob and top_logprobs None), offsets then summed over the tokens' texts from the prompt's start, as vLLM
        (a token that ends inside a character decodes longer than its share of the text). `out`: where the
        prompt's come from (None: not in this chunk)."""
        tokens: list[str] = []
        lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        off = text_offset
        if out is not None and self._echo_logprobs(body) and out.prompt_logprobs is not None:
            off = 0
            for tid, plp in zip(out.prompt_token_ids, out.prompt_logprobs):
                tokens.append(t := self.token_text(tid))
                lps.append(None if plp is None else plp.logprob)
                tops.append(None if plp is None else {self.token_text(i): v for i, v in plp.top})
                offsets.append(off)
                off += len(t)
        for lp in out_lps:
            t = self.token_text(lp.token_id)
            tokens.append(t)
            lps.append(lp.logprob)
            tops.append({self.token_text(i): v for i, v in lp.top})
            offsets.append(off)
            off += len(t)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

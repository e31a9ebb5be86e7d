"""/tokenize and /detokenize (vLLM's extra endpoints): the served model's tokenizer and chat template.
Tokenizer work runs in a worker thread, never on the event loop."""

from __future__ import annotations

from typing import Any

from pdserve.api.errors import APIError
from pdserve.api.protocol import DetokenizeRequest, TokenizeRequest
from pdserve.server.serving import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        self.log_unknown_fields(body.model_extra)
        if body.messages is not None:
            ids = (await self.render_chat(body.messages))["prompt_token_ids"]
        elif body.prompt is not None:
            self.check_texts([body.prompt], "prompt")
            ids = await self.in_thread(lambda: self.client.tokenizer.encode(
                body.prompt, add_special_tokens=body.add_special_tokens))
        else:
            raise APIError(400, "give either prompt or messages", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": self.model_info.max_model_len}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        self.log_unknown_fields(body.model_extra)
        vocab = self.model_info.vocab_size
        if any(t < 0 or t >= vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": await self.in_thread(self.client.tokenizer.decode, body.tokens)}

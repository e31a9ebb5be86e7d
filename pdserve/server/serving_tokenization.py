"""/tokenize and /detokenize (vLLM's extra endpoints): the served model's tokenizer and chat template."""

from __future__ import annotations

from typing import Any

from pdserve.server.errors import APIError
from pdserve.server.protocol import DetokenizeRequest, TokenizeRequest
from pdserve.server.serving import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        if body.messages is not None:
            msgs = [{"role": m.role, "content": m.content or ""} for m in body.messages]
            ids = self.engine.encode_chat(msgs)["prompt_token_ids"]
        elif body.prompt is not None:
            ids = self.engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise APIError(400, "give either prompt or messages", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_model_len}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        vocab = self.engine.arch.vocab_size
        if any(t < 0 or t >= vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": self.engine.tokenizer.decode(body.tokens)}

"""/v1/embeddings (OpenAI): each input's mean-pooled, L2-normalised final hidden state of the served model.

An input becomes a pooling engine request (`EngineClient.process_embedding_inputs`): the engine thread prefills it like
any prompt (chunked, batched with generation, preemptible), sums the final hidden states (after the model's final
norm) of all its tokens, and finishes it without sampling; its KV blocks are freed then, as any request's.
"""

from __future__ import annotations

import base64
import struct
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.api.errors import APIError
from pdserve.api.request_fields import EMBEDDING_REFUSED, refused_field
from pdserve.engine.client import EngineRequest, PromptType
from pdserve.errors import ErrorCode, RequestRejected
from pdserve.server.serving import OpenAIServing, RequestContext


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # only the model's hidden size: no truncation (Matryoshka) is done
    user: str | None = None
    priority: int = Field(0, description="vLLM: lower runs first (--scheduling-policy priority; else must be 0)")


def embedding_prompts(inp: str | list[str] | list[int] | list[list[int]]) -> list[PromptType]:
    """OpenAI's `input`: a string, strings, token ids, or lists of token ids; each one embedding."""
    if isinstance(inp, str):
        prompts: list[PromptType] = [inp]
    elif inp and all(isinstance(x, int) for x in inp):
        prompts = [{"prompt_token_ids": inp}]
    else:
        prompts = [x if isinstance(x, str) else {"prompt_token_ids": x} for x in inp]  # type: ignore[misc]
    if not prompts:
        raise APIError(400, "input must not be empty", param="input", code=ErrorCode.INVALID_PROMPT.value)
    return prompts


def encode_base64(vec: list[float]) -> str:
    """OpenAI's base64 encoding: the float32 little-endian bytes (the `openai` client decodes it with numpy)."""
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")


class OpenAIServingEmbedding(OpenAIServing):
    async def create_embedding(self, body: EmbeddingRequest, ctx: RequestContext) -> dict[str, Any]:
        """Validate, run every input as a pooling request, and answer OpenAI's embedding list with `usage`."""
        self.check_model(body.model)
        if self.client.lora_request(body.model) is not None:
            raise APIError(400, f"{body.model!r} is a LoRA adapter; embeddings use the base model "
                           f"{self.model_name!r}", param="model", code=ErrorCode.UNSUPPORTED_PARAMETER.value)
        self.log_unknown_fields(body.model_extra)
        if (name := refused_field(body.model_extra, EMBEDDING_REFUSED)) is not None:
            raise APIError(400, f"{name} is not supported by this server", param=name,
                           code=ErrorCode.UNSUPPORTED_PARAMETER.value)
        hidden = self.model_info.hidden_size
        if body.dimensions is not None and body.dimensions != hidden:
            raise APIError(400, f"dimensions is {body.dimensions}; this model's embeddings have {hidden} (no "
                           "truncation is done: omit dimensions or send it)", param="dimensions",
                           code=ErrorCode.UNSUPPORTED_PARAMETER.value)
        prompts = embedding_prompts(body.input)
        if len(prompts) > self.options.max_sequences_per_request:
            raise APIError(400, f"input has {len(prompts)} entries; this server allows at most "
                           f"{self.options.max_sequences_per_request} per request (--max-sequences-per-request)",
                           param="input", code=ErrorCode.INVALID_PARAMETER.value)
        self.check_texts((p for p in prompts if isinstance(p, str)), "input")
        self.check_texts([body.user or ""], "user")
        rid = f"embd-{uuid.uuid4().hex}"
        reqs = await self.in_thread(self._make, prompts, rid, body.priority)
        outs = await self.collect(self.admit(reqs, ctx), ctx)
        data = []
        for i, out in enumerate(outs):
            vec = out.embedding or []
            data.append({"object": "embedding", "index": i,
                         "embedding": encode_base64(vec) if body.encoding_format == "base64" else vec})
        tokens = sum(len(r.prompt_token_ids) for r in reqs)
        return {"object": "list", "data": data, "model": self.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def _make(self, prompts: list[PromptType], rid: str, priority: int) -> list[EngineRequest]:
        try:
            return self.client.process_embedding_inputs(prompts, rid, priority)
        except RequestRejected as e:  # named as this endpoint's field; answered by the app (api/errors.py)
            if e.param == "prompt":
                e.param = "input"
            raise

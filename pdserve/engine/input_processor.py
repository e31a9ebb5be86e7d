"""Input processing: prompts become validated Requests before the engine core sees them.

Tokenizing, validating against the model (vocabulary, context length, KV cache size, priority), fanning an API
request out into its sequences (n samples of each prompt), the prefix-cache salt, the PD hand-off parameters and
compiling a structured-output grammar all happen here. Nothing here touches engine state, so a server worker thread
runs it while the engine thread steps (vLLM's InputProcessor). Chat templates are the caller's: prompts arrive as
text or token ids.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.engine.request import Request
from pdserve.engine.structured import StructuredOutputManager
from pdserve.errors import ErrorCode, RequestRejected
from pdserve.lora_request import LoRARequest
from pdserve.model.kv_layout import KVCacheLayout
from pdserve.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]  # text, token ids, or {"prompt_token_ids": [...], "prompt": text}
MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1  # request priorities: the int32 range


@dataclass(frozen=True)
class InputLimits:
    """What a request is validated against: the model and the engine's options."""

    vocab_size: int
    max_model_len: int
    num_blocks: int  # KV blocks in the whole cache
    block_size: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    priority_scheduling: bool  # scheduling_policy "priority": requests may carry a non-zero priority
    kv_layout: KVCacheLayout | None = None  # KV cache groups (None: one table of every layer)


class InputProcessor:
    def __init__(self, tokenizer: Any, limits: InputLimits, eos_token_ids: set[int],
                 structured: StructuredOutputManager,
                 check_kv_params: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        """`eos_token_ids`: shared with every Request (the set, not a copy). `check_kv_params`: a PD role's check
        of a request's kv_transfer_params (signed by a trusted router, or from an allowed peer; raises
        RequestRejected); None: not a PD instance, such params are ignored."""
        self.tokenizer = tokenizer
        self.limits = limits
        self.eos_token_ids = eos_token_ids
        self.structured = structured
        self.check_kv_params = check_kv_params
        self._ids = itertools.count()

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def make_request(self, prompt: PromptType, params: SamplingParams | None = None, request_id: str | None = None,
                     arrival_time: float | None = None, priority: int = 0) -> Request:
        """Tokenize and validate one sequence; raises RequestRejected if it can never be served. `priority`: lower
        runs first; only under scheduling_policy `priority` may it be non-zero (as vLLM)."""
        params = params or SamplingParams()
        self._validate_priority(priority)
        text, token_ids = self.tokenize(prompt)
        max_tokens = self._validate(token_ids, params)
        rid = request_id if request_id is not None else str(next(self._ids))
        req = Request(rid, token_ids, params, self.eos_token_ids, max_tokens, prompt=text, arrival_time=arrival_time,
                      priority=priority)
        if params.structured_outputs is not None:  # compiled here, off the engine thread (cached: once for n > 1)
            req.matcher = self.structured.new_matcher(self.structured.compile(params.structured_outputs))
        return req

    def make_requests(self, prompts: list[PromptType], params: SamplingParams, parent_id: str,
                      arrival_time: float | None = None, cache_salt: str | None = None, priority: int = 0,
                      kv_transfer_params: dict[str, Any] | None = None,
                      lora_request: LoRARequest | None = None) -> list[Request]:
        """Fan one API request out into its sequences: `params.n` samples of each prompt, ids
        `<parent_id>-<prompt index>-<sample index>`, sample j seeded with `seed + j`. The prefix cache shares the
        samples' prompt blocks. `cache_salt` (vLLM's request field): prefix-cache blocks are shared only with
        requests of the same salt. `kv_transfer_params` (PD disaggregation, one prompt and n=1): checked by this
        instance's KV transfer, ignored where there is none. Raises RequestRejected for the first child that can
        never be served. `lora_request`: the LoRA adapter every child runs with (None: the base model)."""
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise RequestRejected("cache_salt must be a non-empty string", "cache_salt", ErrorCode.INVALID_PARAMETER)
        kv_params = self._check_kv_transfer_params(kv_transfer_params, len(prompts), params)
        reqs = []
        for i, prompt in enumerate(prompts):
            for j in range(params.n):
                child = params if params.n == 1 else dataclasses.replace(
                    params, n=1, seed=None if params.seed is None else params.seed + j)
                req = self.make_request(prompt, child, f"{parent_id}-{i}-{j}", arrival_time, priority)
                req.parent_id, req.prompt_index, req.sample_index = parent_id, i, j
                req.cache_salt = cache_salt  # set before the scheduler first looks the prompt up
                req.lora_int_id = lora_request.lora_int_id if lora_request is not None else 0
                req.kv_transfer_params = kv_params
                reqs.append(req)
        return reqs

    def make_embedding_requests(self, prompts: list[PromptType], parent_id: str,
                                priority: int = 0) -> list[Request]:
        """One pooling request per prompt (ids `<parent_id>-<i>-0`): prefilled, never sampled; it finishes when its
        prompt is computed, with `RequestOutput.embedding` the mean over its tokens of the final hidden state (after
        the model's final norm), L2-normalised. A prompt may have at most max_model_len - 1 tokens."""
        reqs = self.make_requests(prompts, SamplingParams(max_tokens=1, temperature=0.0), parent_id,
                                  priority=priority)
        for r in reqs:
            r.pooling = True
        return reqs

    # ---- validation ----------------------------------------------------------------------------------------
    def _check_kv_transfer_params(self, kv_params: dict[str, Any] | None, num_prompts: int,
                                  params: SamplingParams) -> dict[str, Any] | None:
        if not kv_params:
            return None
        if num_prompts > 1 or params.n > 1:
            raise RequestRejected("kv_transfer_params needs a single prompt and n=1", "kv_transfer_params",
                                  ErrorCode.INVALID_PARAMETER)
        if params.prompt_logprobs is not None:  # a decode instance never computes the prompt
            raise RequestRejected("prompt_logprobs cannot be combined with kv_transfer_params", "prompt_logprobs",
                                  ErrorCode.UNSUPPORTED_PARAMETER)
        if self.check_kv_params is None:  # not a PD instance: the request runs colocated
            return None
        return self.check_kv_params(kv_params)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> int:
        """The request's max_tokens (resolved), or RequestRejected."""
        n, lim = len(token_ids), self.limits
        if n == 0:
            raise RequestRejected("the prompt is empty", "prompt", ErrorCode.INVALID_PROMPT)
        vocab = lim.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})", "prompt", ErrorCode.INVALID_PROMPT)
        limit = lim.max_model_len
        if n >= limit:
            raise RequestRejected(f"the prompt has {n} tokens; this model's maximum context length is {limit} "
                                  f"tokens, which must also hold at least one output token", "prompt",
                                  ErrorCode.CONTEXT_LENGTH_EXCEEDED)
        self._validate_sampling(params)
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
        if n + max_tokens > limit:
            raise RequestRejected(f"the prompt has {n} tokens and max_tokens is {max_tokens}: {n + max_tokens} "
                                  f"tokens exceed this model's maximum context length of {limit}", "max_tokens",
                                  ErrorCode.CONTEXT_LENGTH_EXCEEDED)
        need = -(-(n + max_tokens) // lim.block_size) if lim.kv_layout is None else \
            lim.kv_layout.blocks_needed(n + max_tokens, lim.block_size, lim.max_num_batched_tokens)
        if need > lim.num_blocks:
            raise RequestRejected(f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) needs {need} KV blocks "
                                  f"of {lim.block_size} tokens but the whole cache has {lim.num_blocks}",
                                  "max_tokens", ErrorCode.CONTEXT_LENGTH_EXCEEDED)
        if not lim.enable_chunked_prefill and n > lim.max_num_batched_tokens:
            raise RequestRejected(f"the prompt has {n} tokens; with chunked prefill off a prompt may have at most "
                                  f"max_num_batched_tokens={lim.max_num_batched_tokens}", "prompt",
                                  ErrorCode.INVALID_PROMPT)
        return max_tokens

    def _validate_priority(self, priority: int) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise RequestRejected("priority must be an integer", "priority", ErrorCode.INVALID_PARAMETER)
        if priority != 0 and not self.limits.priority_scheduling:
            raise RequestRejected(f"priority is {priority} but priority scheduling is off; start the server with "
                                  "--scheduling-policy priority, or send priority 0", "priority",
                                  ErrorCode.INVALID_PARAMETER)
        if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            raise RequestRejected(f"priority must be in [{MIN_PRIORITY}, {MAX_PRIORITY}] (int32)", "priority",
                                  ErrorCode.INVALID_PARAMETER)

    def _validate_sampling(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check without the model: token ids must index its logits (the sampler
        would raise for the whole batch otherwise)."""
        vocab = self.limits.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {})):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestRejected(f"{name} has token id {bad[0]}, outside this model's vocabulary [0, {vocab})",
                                      name, ErrorCode.INVALID_PARAMETER)

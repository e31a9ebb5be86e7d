"""A request's state: token counters, status and phase timestamps. Once added to the engine, only the scheduler
writes it (engine/scheduler.py: tests/test_architecture.py checks it).

Whether a step does prefill or decode work for a request follows from the counters alone:
`num_computed_tokens < num_tokens - 1` means prompt (or recompute) tokens are still pending; a request whose
only pending token is its newest output token is decoding. Chunked prefill and prefix-cache hits are just
different advances of `num_computed_tokens`.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import torch

from pdserve.errors import ErrorCode
from pdserve.outputs import RequestTimes, TokenLogprobs
from pdserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its blocks freed; will recompute
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # PD disaggregation: blocks held, KV being pulled
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
             RequestStatus.FINISHED_ERROR}


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: set[int], max_tokens: int, prompt: str | None = None,
                 arrival_time: float | None = None, cache_salt: str | None = None, priority: int = 0) -> None:
        self.request_id = request_id
        self.priority = priority  # lower runs first, under the scheduler's `priority` policy
        # prefix-cache isolation: blocks are shared only between requests with the same salt (BlockManager)
        self.cache_salt = cache_salt
        self.lora_int_id = 0  # LoRA: the adapter it runs with (pdserve/lora_request.py); 0: the base model
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens  # resolved: never None
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)  # prompt + output, kept in step
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 before that
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.error_code: ErrorCode | None = None
        # fan-out of one API request (n samples of several prompts): see InputProcessor.make_requests
        self.parent_id: str = request_id
        self.prompt_index = 0
        self.sample_index = 0
        self.times = RequestTimes(arrival=arrival_time if arrival_time is not None else time.perf_counter())
        # per prompt token (the first has none: None), when sampling_params.prompt_logprobs is set; filled as the
        # prompt's chunks are computed, never twice (a preempted request recomputes without rescoring)
        self.prompt_logprobs: list[TokenLogprobs | None] = \
            [None] if sampling_params.prompt_logprobs is not None else []
        # pooling (an embedding request): prefilled, never sampled; the final hidden states of its prompt summed
        # over the positions pooled so far (a preempted request recomputes without pooling a position twice)
        self.pooling = False
        self.pool_sum: torch.Tensor | None = None
        self.num_pooled = 0
        # PD disaggregation (pdserve.kv_transfer): the request's `kv_transfer_params` as sent by the router, and what
        # the KV hand-off reports back (the prefill side's response params, or the decode side's transfer stats)
        self.kv_transfer_params: dict[str, Any] | None = None
        self.kv_transfer_result: dict[str, Any] | None = None
        # structured output: an xgrammar GrammarMatcher over the output tokens accepted so far; None: unconstrained
        self.matcher: Any = None
        # speculative decoding (pdserve/engine/spec_decode): the drafts proposed for its next step (by the runner's
        # drafter; the scheduler keeps those the step takes, and clears them once verified), and how many drafts
        # were verified and accepted in all
        self.spec_token_ids: list[int] = []
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def needs_prompt_rows(self) -> bool:
        """Prompt positions still to be scored (prompt logprobs) or pooled: the prefix cache must not skip them."""
        if self.pooling:
            return self.num_pooled < self.num_prompt_tokens
        return self.sampling_params.prompt_logprobs is not None and \
            len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")

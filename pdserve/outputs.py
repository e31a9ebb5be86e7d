"""What the engine returns, in vLLM's shape: RequestOutput with one CompletionOutput per sequence."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.request import RequestTimes
from pdserve.errors import ErrorCode
from pdserve.model.sampler import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str  # full output, filled in once the request finishes (as token_ids and logprobs); stream the deltas
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprobs] | None = None
    delta_text: str = ""  # text new since the previous output of this request (for streaming)
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestTimes
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None
    error_code: ErrorCode | None = None

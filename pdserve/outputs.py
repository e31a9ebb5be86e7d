"""What the engine returns, in vLLM's shape: RequestOutput with one CompletionOutput per sequence, its logprobs
and its phase timestamps. Plain data: imports nothing from the engine or the model layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.errors import ErrorCode


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int  # 1-based rank of the sampled token under the model's distribution
    top: list[tuple[int, float]]  # the `logprobs` most likely tokens, best first


@dataclass
class RequestTimes:
    """Monotonic timestamps (time.perf_counter seconds) of one request's life, for phase metrics.

    queue = first_scheduled - arrival; prefill = first_token - first_scheduled; TTFT = first_token - arrival;
    decode = finished - first_token; ITL = diffs of token_times.
    """

    arrival: float
    first_scheduled: float | None = None
    prefill_chunks: list[tuple[float, int]] = field(default_factory=list)  # (end time of step, tokens computed)
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per output token
    preemptions: list[float] = field(default_factory=list)
    finished: float | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def prefill_time(self) -> float | None:
        if self.first_token is None or self.first_scheduled is None:
            return None
        return self.first_token - self.first_scheduled

    @property
    def decode_time(self) -> float | None:
        if self.finished is None or self.first_token is None:
            return None
        return self.finished - self.first_token

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """Mean decode time per output token after the first: (E2E - TTFT) / (n - 1)."""
        n = len(self.token_times)
        if n < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (n - 1)

    def as_dict(self) -> dict[str, Any]:
        return {"queue_time": self.queue_time, "prefill_time": self.prefill_time, "ttft": self.ttft,
                "decode_time": self.decode_time, "e2e": self.e2e, "tpot": self.tpot,
                "num_prefill_chunks": len(self.prefill_chunks), "num_preemptions": len(self.preemptions)}



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
    # per prompt token (first: None), when SamplingParams.prompt_logprobs is set; complete from the first token on
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    embedding: list[float] | None = None  # a pooling (embedding) request's vector, once finished
    # PD disaggregation: the prefill side's hand-off params for the router (`do_remote_prefill`...), or the decode
    # side's pull stats; None without a hand-off
    kv_transfer_result: dict[str, Any] | None = None
    num_draft_tokens: int = 0  # speculative decoding: this request's drafts verified, and of those accepted
    num_accepted_tokens: int = 0

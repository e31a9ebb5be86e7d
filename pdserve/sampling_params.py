"""Per-request sampling options, in vLLM's shape and meaning."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # >1 discourages tokens seen in prompt or output (CTRL-style)
    presence_penalty: float = 0.0  # OpenAI: subtract once if the token occurred in the output
    frequency_penalty: float = 0.0  # OpenAI: subtract per occurrence in the output
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top alternatives besides the sampled token; None: off
    prompt_logprobs: None = None  # not supported; kept for vLLM signature compatibility
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (self.n >= 1, "n must be >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be -1, 0 (disabled) or positive"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.min_tokens >= 0, "min_tokens must be >= 0"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens must be <= max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

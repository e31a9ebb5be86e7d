"""Per-request sampling options, in vLLM's shape and meaning.

`SamplingParams` validates everything that needs no model (types, ranges, sizes) and raises `ValueError` naming
the field: a `RequestRejected`, so callers also get `param` and `code` without reading the message. The engine
checks what depends on the model (token ids against the vocabulary, `LLMEngine._validate`).
Sizes are bounded so that one request cannot make every step of the batch it shares slow.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from pdserve.errors import ErrorCode, RequestRejected

MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_LOGPROBS = 20  # logprobs, top_logprobs and prompt_logprobs: alternatives per position, as OpenAI and vLLM
LOGIT_BIAS_LIMIT = 100.0  # OpenAI: each bias in [-100, 100]
MAX_TOP_K = 2**31 - 1  # larger than any vocabulary; the sampler clamps top_k to the vocabulary
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # torch.Generator seeds, as vLLM (int64)
MAX_STRUCTURED_SPEC_CHARS = 65536  # a schema, regex or grammar (as text): bounds compile time and cache memory
MAX_CHOICES = 1024
_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputs:
    """vLLM's `structured_outputs`: constrain the output to exactly one of a JSON schema (`json`, a dict or its JSON
    text), any JSON object (`json_object`), a regular expression, one of a list of strings (`choice`), or an EBNF
    grammar (GBNF-style, xgrammar's dialect). Validated here (shape and size); compiling happens in the engine.
    `structural_tag` (xgrammar's structural tag, as JSON text) is built by the server for tool calling
    (`tool_choice`); `from_dict`, the request field, does not accept it."""

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    # the request field it came from (e.g. "response_format"): the `param` of its errors; None: the kind's name
    param: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise _structured(self.param or "structured_outputs", "structured_outputs needs exactly one of json, "
                              f"json_object, regex, choice, grammar; got {given or 'none'}")
        kind = given[0]
        if kind == "json":
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except ValueError as e:
                    raise _structured(self.param or "json", f"the JSON schema is not valid JSON: {e}") from e
                if not isinstance(parsed, dict | bool):
                    raise _structured(self.param or "json", "the JSON schema must be an object")
            elif not isinstance(self.json, dict):
                raise _structured(self.param or "json", "the JSON schema must be an object or its JSON text")
        elif kind == "json_object" and self.json_object is not True:
            raise _structured(self.param or "json_object", "json_object must be true")
        elif kind in ("regex", "grammar", "structural_tag") and \
                (not isinstance(getattr(self, kind), str) or not getattr(self, kind)):
            raise _structured(self.param or kind, f"{kind} must be a non-empty string")
        elif kind == "choice":
            if not isinstance(self.choice, list) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise _structured(self.param or "choice", "choice must be a non-empty list of non-empty strings")
            if len(self.choice) > MAX_CHOICES:
                raise _structured(self.param or "choice", f"choice may have at most {MAX_CHOICES} entries")
        if len(self.spec) > MAX_STRUCTURED_SPEC_CHARS:
            raise _structured(self.param or kind, f"the {kind} spec is {len(self.spec)} characters; at most "
                              f"{MAX_STRUCTURED_SPEC_CHARS} are accepted")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as canonical text: with `kind`, the grammar cache key."""
        kind = self.kind
        if kind == "json":
            return self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True,
                                                                            ensure_ascii=False)
        if kind == "choice":
            return json.dumps(self.choice, ensure_ascii=False)
        return "" if kind == "json_object" else str(getattr(self, kind))

    @classmethod
    def from_dict(cls, d: object, param: str | None = None) -> StructuredOutputs:
        """From the request field's JSON object; unknown keys are refused, never dropped."""
        if isinstance(d, StructuredOutputs):
            return d
        if not isinstance(d, dict):
            raise _structured("structured_outputs", "structured_outputs must be an object")
        unknown = sorted(set(d) - {"json", "json_object", "regex", "choice", "grammar"})
        if unknown:
            raise RequestRejected(f"structured_outputs.{unknown[0]} is not supported by this server",
                                  f"structured_outputs.{unknown[0]}", ErrorCode.UNSUPPORTED_PARAMETER)
        return cls(**d, param=param)


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
    # vLLM: for each prompt token after the first, its logprob and the top `prompt_logprobs` at its position (raw
    # model distribution); None: off. Such a request takes no prefix-cache hits until its prompt is scored.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # OpenAI: token id -> bias added to its logit, in [-100, 100]
    structured_outputs: StructuredOutputs | None = None  # constrained decoding (a dict is converted)

    def __post_init__(self) -> None:
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputs.from_dict(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            _check_finite(name, getattr(self, name))
        for name in ("n", "top_k", "min_tokens", "max_tokens", "seed", "logprobs", "prompt_logprobs"):
            _check_int(name, getattr(self, name))
        checks = [
            (self.n >= 1, "n", "n must be >= 1"),
            (self.temperature >= 0, "temperature", "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "top_p must be in (0, 1]"),
            (0 <= self.top_k <= MAX_TOP_K, "top_k", f"top_k must be -1, 0 (disabled) or in [1, {MAX_TOP_K}]"),
            (0 <= self.min_p <= 1, "min_p", "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty", "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "max_tokens must be >= 1"),
            (self.min_tokens >= 0, "min_tokens", "min_tokens must be >= 0"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             "min_tokens must be <= max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
             f"logprobs must be in [0, {MAX_LOGPROBS}]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]"),
            # sample j of n is seeded with seed + j (InputProcessor.make_requests): all of them must be valid seeds
            (self.seed is None or SEED_MIN <= self.seed and self.seed + self.n - 1 <= SEED_MAX, "seed",
             f"seed must be in [{SEED_MIN}, {SEED_MAX}] (seed + n - 1 too)"),
        ]
        for ok, name, msg in checks:
            if not ok:
                raise _invalid(name, msg)
        self._check_stops()

    def _check_stops(self) -> None:
        if not all(isinstance(s, str) for s in self.stop):
            raise _invalid("stop", "stop must be a string or a list of strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise _invalid("stop", f"stop may have at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise _invalid("stop", f"each stop string may have at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise _invalid("stop_token_ids", f"stop_token_ids may have at most {MAX_STOP_TOKEN_IDS} entries, "
                             f"got {len(self.stop_token_ids)}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise _invalid("stop_token_ids", "stop_token_ids must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1


def _invalid(param: str, message: str) -> RequestRejected:
    return RequestRejected(message, param, ErrorCode.INVALID_PARAMETER)


def _structured(param: str, message: str) -> RequestRejected:
    return RequestRejected(message, param, ErrorCode.INVALID_STRUCTURED_OUTPUT)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_int(name: str, x: object) -> None:
    if x is not None and not _is_int(x):
        raise _invalid(name, f"{name} must be an integer")


def _check_finite(name: str, x: object) -> None:
    # NaN fails every range check below by accident; Infinity would pass some (temperature >= 0)
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        raise _invalid(name, f"{name} must be a finite number")


def _logit_bias(bias: object) -> dict[int, float]:
    """Validated copy with int keys: JSON objects (OpenAI's logit_bias) have string keys such as "1234"."""
    if not isinstance(bias, dict):
        raise _invalid("logit_bias", "logit_bias must be an object mapping token ids to biases")
    if len(bias) > MAX_LOGIT_BIAS:
        raise _invalid("logit_bias", f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    out: dict[int, float] = {}
    for k, v in bias.items():
        tid = int(k) if isinstance(k, str) and k.strip().lstrip("-").isdigit() else k
        if not _is_int(tid) or tid < 0:
            raise _invalid("logit_bias", f"logit_bias keys must be non-negative token ids, got {k!r}")
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                or abs(v) > LOGIT_BIAS_LIMIT:
            raise _invalid("logit_bias", f"logit_bias values must be numbers in [-100, 100], got {v!r} for token "
                           f"{tid}")
        out[tid] = float(v)
    return out

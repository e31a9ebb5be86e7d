"""OpenAI request bodies (pydantic) and their mapping to SamplingParams.

Unknown fields are kept (`model_extra`) so the serving layer can log them; fields pdserve parses but cannot honour
are declared, and `unsupported()` names the first one set to a value that would otherwise be dropped silently.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from pdserve.api.request_fields import (
    CHAT_REFUSED,
    COMPLETION_REFUSED,
    STREAM_OPTIONS_REFUSED,
    refused_field,
)
from pdserve.errors import ErrorCode, RequestRejected
from pdserve.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputs

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept to be refused (continuous_usage_stats) or ignored, never lost

    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow", strict=False)
    refused_extras: ClassVar[dict[str, tuple[Any, ...]]] = COMPLETION_REFUSED  # request_fields.py

    model: str | None = None
    n: int | None = 1  # null: the default, 1
    best_of: int | None = None  # only None, 1 or n (every sample returned): no server-side ranking
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[int, float] | None = None  # token id (a string key in JSON, converted) -> bias in [-100, 100]
    cache_salt: str | None = Field(None, max_length=1024, description="prefix-cache blocks are shared only between "
                                   "requests with the same salt")
    # structured output: one of response_format (OpenAI), structured_outputs (vLLM) or a guided_* field (older vLLM)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM: score the prompt (top-k per position); not with stream. Strict: `true` is refused, not taken as 1
    prompt_logprobs: StrictInt | None = None
    # chat honours tools and tool_choice (pdserve/server/tools.py); completions refuse them. Parsed only to be
    # refused when set: functions / function_call (OpenAI's older spelling)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    return_timings: bool = Field(False, description="pdserve extension: add per-phase timings to the response")
    priority: int = Field(0, description="vLLM: lower runs first (--scheduling-policy priority; else must be 0)")
    kv_transfer_params: dict[str, Any] | None = Field(
        None, description="PD disaggregation hand-off, as vLLM's NixlConnector: do_remote_decode (to a prefill "
        "instance) or do_remote_prefill + remote_* (to a decode instance)")

    @property
    def num_samples(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def unsupported(self) -> str | None:
        """The first field set to a value pdserve cannot honour, or None."""
        if (name := refused_field(self.model_extra, self.refused_extras)) is not None:
            return name
        if self.stream_options is not None and (name := refused_field(
                self.stream_options.model_extra, STREAM_OPTIONS_REFUSED, "stream_options.")) is not None:
            return name
        for name, harmless in self._harmless().items():
            if not harmless:
                return name
        return None

    def _harmless(self) -> dict[str, bool]:
        return {"best_of": self.best_of in (None, 1, self.num_samples),
                "tools": not self.tools, "tool_choice": self.tool_choice in (None, "none", "auto"),
                "functions": not self.functions, "function_call": self.function_call in (None, "none", "auto")}

    def structured(self) -> StructuredOutputs | None:
        """The output constraint, from whichever one field sets it; RequestRejected (400) naming the field when it
        is malformed or when two fields set one."""
        found: list[StructuredOutputs] = []
        if self.response_format is not None:
            found += [so for so in [_response_format(self.response_format)] if so is not None]
        if self.structured_outputs is not None:
            found.append(StructuredOutputs.from_dict(self.structured_outputs, "structured_outputs"))
        for name, kind in _GUIDED.items():
            if getattr(self, name) is not None:
                found.append(StructuredOutputs(**{kind: getattr(self, name)}, param=name))
        if len(found) > 1:
            raise RequestRejected(f"{found[0].param} and {found[1].param} both constrain the output; set one",
                                  found[1].param, ErrorCode.INVALID_STRUCTURED_OUTPUT)
        return found[0] if found else None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            logit_bias=self.logit_bias, n=self.num_samples,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty, seed=self.seed,
            stop=self.stop_list, stop_token_ids=list(self.stop_token_ids or []), max_tokens=max_tokens,
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logprobs=logprobs, structured_outputs=self.structured(),
            prompt_logprobs=self.prompt_logprobs)


def _response_format(rf: dict[str, Any]) -> StructuredOutputs | None:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema {name, schema, strict}."""
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True, param="response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise RequestRejected("response_format.json_schema.schema must be a JSON schema object",
                                  "response_format.json_schema.schema", ErrorCode.INVALID_STRUCTURED_OUTPUT)
        return StructuredOutputs(json=js["schema"], param="response_format.json_schema.schema")
    raise RequestRejected(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                          "response_format.type", ErrorCode.INVALID_STRUCTURED_OUTPUT)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None  # refused when non-empty: no fill-in-the-middle

    def _harmless(self) -> dict[str, bool]:
        return {**super()._harmless(), "suffix": not self.suffix}

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(16 if self.max_tokens is None else self.max_tokens, self.logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant: the calls it made (checked in tools.py)
    tool_call_id: str | None = None  # tool: the call this message answers
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    refused_extras: ClassVar[dict[str, tuple[Any, ...]]] = CHAT_REFUSED
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's per-request template: refused, the model's own is used
    parallel_tool_calls: bool | None = None  # null: true. false: one call (enforced under required / a function)
    # extra variables for the chat template, as vLLM (e.g. {"enable_thinking": false} for Qwen3); keys the renderer
    # sets itself are refused (server/chat_template.py RESERVED_TEMPLATE_KWARGS)
    chat_template_kwargs: dict[str, Any] | None = None

    def _harmless(self) -> dict[str, bool]:
        # tools and tool_choice are honoured here, and validated by pdserve/server/tools.py
        return {**super()._harmless(), "tools": True, "tool_choice": True,
                "modalities": self.modalities in (None, ["text"]), "audio": self.audio is None,
                "prediction": self.prediction is None, "chat_template": self.chat_template is None}

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise RequestRejected(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", "top_logprobs",
                                  ErrorCode.INVALID_PARAMETER)
        n_top = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, n_top)



def plain_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: text content only, plus `tool_calls`, `tool_call_id` and `name`
    where set (as sent: pdserve/server/tools.py checks and maps them). A content part that is not text (image_url,
    input_audio, file) raises ValueError naming it: it is refused, never dropped."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):  # OpenAI content parts
            texts = []
            for j, part in enumerate(content):
                text = part.get("text")
                if part.get("type") != "text" or not isinstance(text, str):
                    raise ContentPartError(f"messages[{i}].content[{j}]: content part type {part.get('type')!r} is "
                                           "not supported (text parts only)", f"messages[{i}].content[{j}]")
                texts.append(text)
            content = "".join(texts)
        msg: dict[str, Any] = {"role": m.role, "content": content or ""}
        for key in ("tool_calls", "tool_call_id", "name"):
            if getattr(m, key) is not None:
                msg[key] = getattr(m, key)
        out.append(msg)
    return out


class ContentPartError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]

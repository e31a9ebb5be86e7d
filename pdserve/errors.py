"""Error codes shared by every layer. Callers branch on `code`, never on message text.

The values are the strings that reach clients (the OpenAI error body's `code`), so they are stable API.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """Why a request was refused or failed."""

    INVALID_PROMPT = "invalid_prompt"  # empty, token ids out of the vocabulary, over the per-step budget
    INVALID_PARAMETER = "invalid_parameter"  # a sampling or request value the model cannot honour
    UNSUPPORTED_PARAMETER = "unsupported_parameter"  # a field pdserve parses but cannot honour
    # structured_outputs / response_format / guided_*: malformed, or a schema, regex or grammar that does not compile
    INVALID_STRUCTURED_OUTPUT = "invalid_structured_output"
    INVALID_TOOL = "invalid_tool"  # a `tools` entry: unknown type, bad name, parameters not a usable JSON schema
    # tool_choice: not none/auto/required/a function, names a tool not in `tools`, or asks for a call without tools
    INVALID_TOOL_CHOICE = "invalid_tool_choice"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # prompt + max_tokens over max_model_len or the KV cache
    MODEL_STEP_FAILED = "model_step_failed"  # the forward pass raised for this request's step
    SAMPLING_FAILED = "sampling_failed"  # sampling this request's row raised (its neighbours were sampled)
    POSTPROCESS_FAILED = "postprocess_failed"  # detokenizing or stop checks raised for this request
    KV_TRANSFER_FAILED = "kv_transfer_failed"  # PD disaggregation: pulling the prompt's KV failed
    # PD disaggregation: kv_transfer_params not signed by a trusted router, or naming a peer off the allow-list
    KV_TRANSFER_PARAMS_REJECTED = "kv_transfer_params_rejected"


class RequestRejected(ValueError):
    """The request can never be served as given; nothing was allocated for it."""

    def __init__(self, message: str, param: str | None = None,
                 code: ErrorCode = ErrorCode.INVALID_PARAMETER) -> None:
        super().__init__(message)
        self.param = param
        self.code = code

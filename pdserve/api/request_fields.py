"""Request fields of OpenAI's and vLLM's APIs that pdserve does not declare. Pydantic keeps any undeclared field
(`model_extra`); each name below would change the result when set to anything but its listed no-op values, so it is
refused by name (400, `code: "unsupported_parameter"`) instead of dropped. Every other undeclared field is harmless
(`store`, `metadata`, `service_tier`, `request_id`, `guided_decoding_backend`, `prompt_cache_key`, ...): accepted and
logged once per field name (OpenAIServing.log_unknown_fields).
"""

from __future__ import annotations

from typing import Any

# name -> values that change nothing (its default, spelled as clients send it); any other value is refused
SAMPLING_REFUSED: dict[str, tuple[Any, ...]] = {
    # vLLM sampling extensions pdserve does not implement
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "early_stopping": (None, False),
    "truncate_prompt_tokens": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logits_processors": (None, []),
    "spaces_between_special_tokens": (None, True),
    "prompt_embeds": (None,),
    "guided_whitespace_pattern": (None,),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "vllm_xargs": (None, {}),
    "mm_processor_kwargs": (None, {}),
    "thinking_token_budget": (None,),
    # OpenAI
    "reasoning_effort": (None,),
    "reasoning": (None,),
    "web_search_options": (None,),
    "verbosity": (None,),
}
COMPLETION_REFUSED: dict[str, tuple[Any, ...]] = {**SAMPLING_REFUSED, "add_special_tokens": (None, True)}
CHAT_REFUSED: dict[str, tuple[Any, ...]] = {
    **SAMPLING_REFUSED,
    "echo": (None, False),  # vLLM chat: echo the last message
    "continue_final_message": (None, False),
    "add_special_tokens": (None, False),  # chat templates write their own special tokens
    "documents": (None, []),
    "tool_choice_required": (None,),
}
EMBEDDING_REFUSED: dict[str, tuple[Any, ...]] = {
    "truncate_prompt_tokens": (None,),
    "add_special_tokens": (None, True),
    "normalize": (None, True),
    "embed_dtype": (None, "float32"),
    "mm_processor_kwargs": (None, {}),
    "messages": (None,),  # vLLM's chat-style embedding input
}
STREAM_OPTIONS_REFUSED: dict[str, tuple[Any, ...]] = {"continuous_usage_stats": (None, False)}


def refused_field(extra: dict[str, Any] | None, table: dict[str, tuple[Any, ...]], prefix: str = "") -> str | None:
    """The first undeclared field of `extra` that `table` refuses at its value, as a `param` path; None if none."""
    for name, value in (extra or {}).items():
        allowed = table.get(name)
        if allowed is not None and not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
            return prefix + name
    return None

"""Chat templates: a conversation becomes a prompt through the model's own template (the server and the offline
`LLM.chat` render it; the engine takes text or token ids)."""

from __future__ import annotations

from typing import Any

from pdserve.errors import ErrorCode, RequestRejected

# arguments render_chat passes to the template itself: a request's chat_template_kwargs may not set them
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "tokenize",
                                      "add_generation_prompt", "continue_final_message", "return_dict",
                                      "chat_template", "tokenizer"})


def check_template_kwargs(template_kwargs: dict[str, Any] | None) -> None:
    """RequestRejected (400) when a request's chat_template_kwargs sets what the renderer sets itself."""
    bad = sorted(RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs or {}))
    if bad:
        raise RequestRejected(f"chat_template_kwargs may not set {', '.join(bad)}", param="chat_template_kwargs",
                              code=ErrorCode.INVALID_PARAMETER)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Render a conversation with the model's chat template (given `tools`, OpenAI function tools, as Hugging Face
    templates take them; `template_kwargs`, extra template variables such as `enable_thinking`); returns a token-id
    prompt with its text."""
    check_template_kwargs(template_kwargs)
    kw = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)
    # the template writes its own special tokens, so the tokenizer must not add a BOS again
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}

"""Chat templates: a conversation becomes a prompt through the model's own template (the server and the offline
`LLM.chat` render it; the engine takes text or token ids)."""

from __future__ import annotations

from typing import Any


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Render a conversation with the model's chat template (given `tools`, OpenAI function tools, as Hugging Face
    templates take them); returns a token-id prompt with its text."""
    kw = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)
    # the template writes its own special tokens, so the tokenizer must not add a BOS again
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}

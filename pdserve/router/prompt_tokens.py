"""The router's view of a request's prompt tokens, for prefix-aware routing: the model's tokenizer.json through the
`tokenizers` library and its chat template through a jinja2 sandbox, the way the instances' tokenizer does it, but
without transformers (which loads torch, and the router must not: tests/test_architecture.py).

    tok = PromptTokenizer.load("/models/Qwen3-1.7B")           # a directory with tokenizer.json (+ the template)
    tok.prompt_token_ids("/v1/chat/completions", body)         # -> list[int] | None

None means "route without a prefix": a prompt form the router does not render (tools, several prompts, a
continued final message, a template jinja2 cannot compile here). A rendering that differs from the instance's
only costs routing quality (no hit, so least-loaded), never correctness: the instance tokenizes on its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import ValidationError
from tokenizers import Tokenizer

from pdserve.api.protocol import ChatCompletionRequest, ContentPartError, plain_messages
from pdserve.router.prefix import PrefixQuery, PrefixRoutingConfig

logger = logging.getLogger("pdserve.router")

# the tokenizer_config.json entries a chat template reads as variables (transformers passes its special tokens)
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # as transformers' filter: no HTML escaping, UTF-8 kept (CJK content renders as text, not \\u escapes)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def token_id_prompt(prompt: Any) -> list[int] | None:
    """A completion prompt given as one list of token ids, else None."""
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return None


class PromptTokenizer:
    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, special: dict[str, str]) -> None:
        self.tokenizer, self.special = tokenizer, special
        self.template: jinja2.Template | None = None
        if chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
            try:
                self.template = env.from_string(chat_template)
            except jinja2.TemplateError as e:
                logger.warning("prefix routing: the chat template does not compile here (%s); chat requests are "
                               "routed least-loaded", e)

    @classmethod
    def load(cls, path: str) -> PromptTokenizer:
        """From a model directory (or its tokenizer.json): tokenizer.json, and tokenizer_config.json's chat template
        and special tokens (or chat_template.jinja beside it)."""
        p = Path(path)
        d = p.parent if p.is_file() else p
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg: dict[str, Any] = {}
        if (d / "tokenizer_config.json").is_file():
            cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
        template = cfg.get("chat_template")
        if not isinstance(template, str) and (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        special = {k: t for k in _SPECIAL_TOKENS if (t := _token_text(cfg.get(k))) is not None}
        return cls(tok, template if isinstance(template, str) else None, special)

    def prompt_token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The token ids an instance would compute for the body's prompt, or None (see the module docstring)."""
        if path.endswith("/chat/completions"):
            return self._chat(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True).ids)
        return token_id_prompt(prompt)

    def _chat(self, body: dict[str, Any]) -> list[int] | None:
        if self.template is None or body.get("tools") or body.get("continue_final_message"):
            return None
        try:
            messages = plain_messages(ChatCompletionRequest.model_validate(body).messages)
            kwargs = body.get("chat_template_kwargs") or {}
            text = self.template.render(**{**self.special, **kwargs}, messages=messages,
                                        add_generation_prompt=body.get("add_generation_prompt", True))
        except (ValidationError, ContentPartError, jinja2.TemplateError, TypeError) as e:
            logger.debug("prefix routing: not rendering this conversation: %s", e)
            return None
        # the template writes its own special tokens (as the server renders: no BOS added again)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)


class PrefixRouting:
    """The router's prefix routing: its choice's config and the tokenizer that turns a request into a PrefixQuery."""

    def __init__(self, config: PrefixRoutingConfig, tokenizer: PromptTokenizer | None) -> None:
        self.config, self.tokenizer = config, tokenizer

    @classmethod
    def from_config(cls, cfg: Any) -> PrefixRouting | None:
        """From a RouterConfig: None with `routing` least-loaded. Without a tokenizer only token-id prompts are
        routed by prefix (text needs the model's tokenizer: --tokenizer)."""
        if cfg.routing != "prefix":
            return None
        if cfg.tokenizer is None:
            logger.warning("prefix routing without --tokenizer: only token-id prompts are routed by prefix")
        tok = PromptTokenizer.load(cfg.tokenizer) if cfg.tokenizer is not None else None
        return cls(PrefixRoutingConfig(load_cost=cfg.prefix_load_cost, pending_ttl=cfg.prefix_pending_ttl,
                                       disk_cost=cfg.prefix_disk_cost), tok)

    async def query(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> PrefixQuery | None:
        """The request's PrefixQuery (tokenized in a worker thread: a long prompt takes milliseconds), or None."""
        if self.tokenizer is not None:
            ids = await asyncio.to_thread(self.tokenizer.prompt_token_ids, path, body)
        else:
            ids = None if path.endswith("/chat/completions") else token_id_prompt(body.get("prompt"))
        if not ids:
            return None
        salt = body.get("cache_salt")
        tenant = headers.get("x-tenant") or body.get("user")  # as the instance names the tenant
        return PrefixQuery(ids, salt if isinstance(salt, str) else None, tenant if isinstance(tenant, str) else None)

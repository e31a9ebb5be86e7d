"""A saved Hugging Face tokenizer directory loaded as transformers' AutoTokenizer would load it, without the model
config step where that step cannot change the answer.

AutoTokenizer.from_pretrained first builds the directory's model config (AutoConfig), which imports that model type's
configuration module and with it much of torch (torch.export, torch.distributed.tensor): about 1.2 s of a server's
start-up for a tokenizer that loads in 0.3 s. The config only matters when the directory's own class cannot be
trusted: remote code (auto_map), model types transformers lists as having a wrong class on the Hub, and types whose
registered tokenizer is Mistral's. A directory whose tokenizer_config.json names the generic `TokenizersBackend`
(what transformers writes for fast tokenizers) and has a tokenizer.json outside those cases gets TokenizersBackend
from AutoTokenizer (its "trust the Hub class" branches), so it is built directly; every other directory goes
through AutoTokenizer. tests/test_tokenizer_dir.py compares the two on the tokenizers pdserve meets.
"""

from __future__ import annotations

import json
import os
from typing import Any


def _json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def direct_class_applies(path: str) -> bool:
    """Whether AutoTokenizer.from_pretrained(path) is TokenizersBackend.from_pretrained(path) by transformers' own
    rules, decided from the directory's files alone."""
    tok_cfg = _json(os.path.join(path, "tokenizer_config.json"))
    if tok_cfg is None or tok_cfg.get("tokenizer_class") != "TokenizersBackend" or "auto_map" in tok_cfg:
        return False
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return False
    config_path = os.path.join(path, "config.json")
    # no config.json (pdserve's cache of a GGUF's tokenizer): AutoTokenizer falls back to an empty config
    model_cfg = _json(config_path) if os.path.exists(config_path) else {}
    if model_cfg is None or "auto_map" in model_cfg:  # unreadable, or remote code
        return False
    try:
        from transformers.models.auto.tokenization_auto import (
            MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
            TOKENIZER_MAPPING_NAMES,
        )
    except ImportError:  # another transformers layout: let AutoTokenizer decide
        return False
    model_type = model_cfg.get("model_type")
    if model_type in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS or model_cfg.get("model_name") in \
            MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS:
        return False
    return (TOKENIZER_MAPPING_NAMES.get(str(model_type)) or "") != "MistralCommonBackend"


def load_tokenizer_dir(path: str) -> Any:
    """The tokenizer saved in directory `path`: the one AutoTokenizer.from_pretrained(path) returns."""
    if direct_class_applies(path):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)

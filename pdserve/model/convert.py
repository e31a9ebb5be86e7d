"""`pdserve convert`: a GGUF file -> a Hugging Face directory (config.json, generation_config.json,
model.safetensors, tokenizer files) that transformers and vLLM load."""

from __future__ import annotations

import json
import os

import torch

from pdserve.model.loader import load_gguf, load_tokenizer

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def convert_gguf_to_hf(gguf_path: str, out_dir: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write a Hugging Face checkpoint (config.json, generation_config.json, model.safetensors, tokenizer files)
    that transformers' AutoModelForCausalLM / AutoTokenizer and vLLM load."""
    import transformers
    from safetensors.torch import save_file

    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"convert_gguf_to_hf: dtype must be one of {list(_DTYPE_NAMES)}, got {dtype}")
    loaded = load_gguf(gguf_path, dtype)
    os.makedirs(out_dir, exist_ok=True)
    cfg = dict(loaded.hf_config)
    cfg["torch_dtype"] = cfg["dtype"] = _DTYPE_NAMES[dtype]
    cfg["transformers_version"] = transformers.__version__
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
    gen["transformers_version"] = transformers.__version__
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2, sort_keys=True)
    tensors = {k: v.contiguous() for k, v in loaded.state_dict.items() if isinstance(v, torch.Tensor)}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    tok = load_tokenizer(gguf_path)
    tok.save_pretrained(out_dir)
    _portable_tokenizer_config(out_dir)


def _portable_tokenizer_config(out_dir: str) -> None:
    """Make the saved tokenizer loadable by transformers 4.x too (vLLM may run on it): transformers>=5 writes the
    class name TokenizersBackend (4.x: PreTrainedTokenizerFast reads the same tokenizer.json) and keeps the chat
    template only in chat_template.jinja (old versions read tokenizer_config.json's chat_template)."""
    p = os.path.join(out_dir, "tokenizer_config.json")
    if not os.path.isfile(p):
        return
    with open(p) as f:
        tc = json.load(f)
    if tc.get("tokenizer_class") in (None, "TokenizersBackend"):
        tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    jinja = os.path.join(out_dir, "chat_template.jinja")
    if "chat_template" not in tc and os.path.isfile(jinja):
        with open(jinja) as f:
            tc["chat_template"] = f.read()
    tc.pop("is_local", None)
    with open(p, "w") as f:
        json.dump(tc, f, indent=2, ensure_ascii=False)

"""Phi-3 / Phi-3.5 / Phi-4-mini GGUF files (llama.cpp's `phi3` architecture) in Hugging Face terms.

llama.cpp's converter keeps the checkpoint's fused matrices (`attn_qkv` = qkv_proj, `ffn_up` = gate_up_proj, gate
rows first; q/k rows are not permuted for this architecture) and stores LongRoPE as two tensors
(`rope_factors_long`, `rope_factors_short`, one factor per rotary frequency) plus
`phi3.rope.scaling.original_context_length`, without a `rope.scaling.type` key. The rotary dims are
`phi3.rope.dimension_count` (partial rotary: Phi-4-mini), and `phi3.attention.sliding_window` is 0 when the model has
none (Phi-4). The attention factor it stores (`rope.scaling.attn_factor`) is the one transformers derives from
context_length / original_context_length, so the config leaves it to be derived.
"""

from __future__ import annotations

from typing import Any

import numpy as np

PHI3_GGUF_ARCHS = {"phi3": "Phi3ForCausalLM"}

GGUF_BLOCK_TENSORS = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}
ROPE_FACTOR_TENSORS = {"long_factor": "rope_factors_long.weight", "short_factor": "rope_factors_short.weight"}


def phi3_layer_names() -> list[str]:
    """The per-layer Hugging Face weights of a Phi-3 layer (for the loader's completeness check). q/k/v and gate/up
    are left out: a file may store them fused (`attn_qkv`, as the converter writes) or split (`attn_q`, ...), and the
    model's weight loader names whichever is missing."""
    return ["self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
            "post_attention_layernorm.weight"]


def phi3_hf_config(meta: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` (gguf_config.gguf_hf_config's Llama-family fields of the file `meta`: a gguf_config.GGUFFile)
    completed into a Phi3Config-style config.json dict."""
    head_dim = cfg["head_dim"]
    rotary = int(meta.get("{arch}.rope.dimension_count", head_dim))
    window = int(meta.get("{arch}.attention.sliding_window", 0) or 0)
    factors = {key: np.asarray(meta.tensors[name].data, dtype=np.float32).reshape(-1).tolist()
               for key, name in ROPE_FACTOR_TENSORS.items() if name in meta.tensors}
    partial = rotary / head_dim
    rope = {"rope_theta": cfg["rope_theta"], "partial_rotary_factor": partial}
    cfg = {**cfg, "model_type": "phi3", "partial_rotary_factor": partial, "sliding_window": window or None}
    if not factors:
        cfg["rope_parameters"] = {"rope_type": "default", **rope}
        return cfg
    if len(factors) != 2:
        raise ValueError(f"{meta.path}: phi3 GGUF with only one of {sorted(ROPE_FACTOR_TENSORS.values())}")
    orig = meta.get("{arch}.rope.scaling.original_context_length")
    if orig is None:
        raise ValueError(f"{meta.path}: phi3 GGUF with rope factors but no "
                         f"{meta.arch}.rope.scaling.original_context_length")
    scaling = {"rope_type": "longrope", **factors, "original_max_position_embeddings": int(orig)}
    cfg.update(original_max_position_embeddings=int(orig), rope_scaling=scaling,
               rope_parameters={**scaling, **rope})
    return cfg

"""Gemma 3 GGUF files (llama.cpp's `gemma3` architecture) in Hugging Face terms: the config.json fields llama.cpp
does not store, the tensor names that differ from the Llama family's, and the norm weights' convention.

What llama.cpp fixes in code rather than in the file, and this module therefore supplies: every 6th layer is global,
the others local (sliding window), unless `gemma3.attention.sliding_window_pattern` says otherwise; the local rope
base is 10000; the attention scale is head_dim ** -0.5 except for the 27B model (62 layers), where it is
(hidden / heads) ** -0.5. llama.cpp's converter stores Gemma's norm weights as 1 + w (its RMSNorm multiplies by
the weight as stored); Hugging Face names hold w, so the loader subtracts the 1 (`GGUF_NORM_SHIFT`) and the model
adds it back at load (model/gemma.py), as transformers' own GGUF loader and Gemma3RMSNorm do.
"""

from __future__ import annotations

from typing import Any

GEMMA_GGUF_ARCHS = {"gemma3": "Gemma3ForCausalLM"}

# GGUF block tensor -> Hugging Face module, where Gemma's names differ from the Llama family's (loader.py)
GGUF_BLOCK_TENSORS = {
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
GGUF_NORM_SHIFT = {"gemma3": 1.0}  # stored norm weight = Hugging Face's + this

_LOCAL_ROPE_BASE = 10000.0  # llama.cpp: rope_freq_base_train_swa of gemma3
_SLIDING_PATTERN = 6  # llama.cpp: set_swa_pattern(6): layers 5, 11, ... are global
_GEMMA3_27B_LAYERS = 62


def gemma_layer_names() -> list[str]:
    """The per-layer Hugging Face weights of a Gemma 3 layer (for the loader's completeness check)."""
    return ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
            "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
            "post_feedforward_layernorm.weight"]


def _layer_types(pattern: Any, n_layers: int) -> list[str]:
    """`pattern`: the GGUF key's value (an int period, or one bool per layer, true = sliding) or None."""
    if isinstance(pattern, list | tuple):
        if len(pattern) != n_layers:
            raise ValueError(f"gemma3 sliding_window_pattern has {len(pattern)} entries for {n_layers} layers")
        return ["sliding_attention" if p else "full_attention" for p in pattern]
    period = int(pattern) if pattern else _SLIDING_PATTERN
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n_layers)]


def gemma_hf_config(meta: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` (loader.gguf_hf_config's Llama-family fields of the file `meta`: a loader.GGUFFile) completed into a
    Gemma3TextConfig-style config.json dict."""
    n_layers, head_dim = cfg["num_hidden_layers"], cfg["head_dim"]
    window = meta.get("{arch}.attention.sliding_window")
    if window is None:
        raise ValueError(f"{meta.path}: gemma3 GGUF without {meta.arch}.attention.sliding_window")
    scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if n_layers == _GEMMA3_27B_LAYERS else head_dim
    global_rope = cfg["rope_parameters"]
    cfg = {k: v for k, v in cfg.items() if k not in ("hidden_act", "rope_parameters")}
    cfg.update(
        model_type="gemma3_text",
        hidden_activation="gelu_pytorch_tanh",
        sliding_window=int(window),
        layer_types=_layer_types(meta.get("{arch}.attention.sliding_window_pattern"), n_layers),
        rope_local_base_freq=_LOCAL_ROPE_BASE,
        rope_parameters={"full_attention": global_rope,
                         "sliding_attention": {"rope_type": "default", "rope_theta": _LOCAL_ROPE_BASE}},
        query_pre_attn_scalar=scalar,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
    )
    return cfg

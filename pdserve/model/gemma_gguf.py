"""Gemma 2 and Gemma 3 GGUF files (llama.cpp's `gemma2` and `gemma3` architectures) in Hugging Face terms: the
config.json fields llama.cpp does not store, the tensor names that differ from the Llama family's, and the norm
weights' convention.

What llama.cpp fixes in code rather than in the file, and this module therefore supplies (Gemma 3): every 6th layer
is global,
the others local (sliding window), unless `gemma3.attention.sliding_window_pattern` says otherwise; the local rope
base is 10000; the attention scale is head_dim ** -0.5 except for the 27B model (62 layers), where it is
(hidden / heads) ** -0.5. llama.cpp's converter stores Gemma's norm weights as 1 + w (its RMSNorm multiplies by
the weight as stored); Hugging Face names hold w, so the loader subtracts the 1 (`GGUF_NORM_SHIFT`) and the model
adds it back at load (model/gemma.py), as transformers' own GGUF loader and Gemma3RMSNorm do.

Gemma 2 (`gemma2`): the same tensor names and norm convention without q/k norms; llama.cpp fixes every 2nd layer
global (even layers local), one rope (base rope.freq_base, 10000 when absent, as its converter writes none) and the
same attention-scale rule (27B: 46 layers); the file stores the window and both soft-capping values
(`gemma2.attn_logit_softcapping`, `gemma2.final_logit_softcapping`).
"""

from __future__ import annotations

from typing import Any

from pdserve.model.gguf_rope import round_f32

GEMMA_GGUF_ARCHS = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}

# GGUF block tensor -> Hugging Face module, where Gemma's names differ from the Llama family's (loader.py)
_SANDWICH_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GGUF_BLOCK_TENSORS = {arch: _SANDWICH_NORMS for arch in GEMMA_GGUF_ARCHS}
GGUF_NORM_SHIFT = {arch: 1.0 for arch in GEMMA_GGUF_ARCHS}  # stored norm weight = Hugging Face's + this

_LOCAL_ROPE_BASE = 10000.0  # llama.cpp: rope_freq_base_train_swa of gemma3
_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}  # llama.cpp's set_swa_pattern: every n-th layer is global
_LARGEST_LAYERS = {"gemma2": 46, "gemma3": 62}  # the 27B models: attention scale (hidden / heads) ** -0.5


def gemma_layer_names(architecture: str) -> list[str]:
    """The per-layer Hugging Face weights of a Gemma 2/3 layer (for the loader's completeness check)."""
    qk_norm = ["self_attn.q_norm.weight", "self_attn.k_norm.weight"] if architecture == "Gemma3ForCausalLM" else []
    return ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", *qk_norm,
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
            "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
            "post_feedforward_layernorm.weight"]


def _layer_types(pattern: Any, n_layers: int, arch: str) -> list[str]:
    """`pattern`: the GGUF key's value (an int period, or one bool per layer, true = sliding) or None."""
    if isinstance(pattern, list | tuple):
        if len(pattern) != n_layers:
            raise ValueError(f"{arch} sliding_window_pattern has {len(pattern)} entries for {n_layers} layers")
        return ["sliding_attention" if p else "full_attention" for p in pattern]
    period = int(pattern) if pattern else _SLIDING_PATTERN[arch]
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n_layers)]


def _softcap(value: Any) -> float | None:
    return None if value is None else round_f32(value)


def gemma_hf_config(meta: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` (gguf_config.gguf_hf_config's Llama-family fields of the file `meta`: a gguf_config.GGUFFile)
    completed into a Gemma2Config / Gemma3TextConfig-style config.json dict."""
    n_layers, head_dim, arch = cfg["num_hidden_layers"], cfg["head_dim"], meta.arch
    window = meta.get("{arch}.attention.sliding_window")
    if window is None:
        raise ValueError(f"{meta.path}: {arch} GGUF without {arch}.attention.sliding_window")
    largest = n_layers == _LARGEST_LAYERS[arch]
    scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if largest else head_dim
    rope = cfg["rope_parameters"]
    cfg = {k: v for k, v in cfg.items() if k not in ("hidden_act", "rope_parameters")}
    cfg.update(
        hidden_activation="gelu_pytorch_tanh",
        sliding_window=int(window),
        layer_types=_layer_types(meta.get("{arch}.attention.sliding_window_pattern"), n_layers, arch),
        query_pre_attn_scalar=scalar,
        final_logit_softcapping=_softcap(meta.get("{arch}.final_logit_softcapping")),
        attn_logit_softcapping=_softcap(meta.get("{arch}.attn_logit_softcapping")),
    )
    if arch == "gemma2":
        cfg.update(model_type="gemma2", rope_parameters=rope)
        return cfg
    cfg.update(
        model_type="gemma3_text",
        rope_local_base_freq=_LOCAL_ROPE_BASE,
        rope_parameters={"full_attention": rope,
                         "sliding_attention": {"rope_type": "default", "rope_theta": _LOCAL_ROPE_BASE}},
    )
    return cfg

"""Architecture name (Hugging Face's `architectures[0]`, ModelArchConfig.architecture) -> the model class.

Adding an architecture: its config fields in ModelArchConfig.from_hf_config (and the GGUF metadata keys in
model/loader.py), a module with its decoder layer built from model/layers/ and its weight-name mapping
(`load_hf_state_dict`; GGUF tensor names in model/loader.py), and a line here. Its native whole-stack program
comes from its Python definition (model/native_program.py); a new op kind is a NativeOps method and an op in
csrc/native_program.cpp.
"""

from __future__ import annotations

import torch

from pdserve.config import ModelArchConfig
from pdserve.model.causal_lm import CausalLM
from pdserve.model.cpu_linear import pack_model_linears, use_onednn
from pdserve.model.gemma import GemmaForCausalLM
from pdserve.model.kv_layout import KVCacheLayout
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.native_ops import KernelSelection
from pdserve.model.packed_weights import StateDict, pack_float_weights
from pdserve.model.quant import quantize_model

MODEL_CLASSES: dict[str, type[LlamaForCausalLM] | type[GemmaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,  # q/k/v bias: ModelArchConfig.attention_bias
    "Qwen3ForCausalLM": LlamaForCausalLM,  # q/k norm per head: ModelArchConfig.qk_norm
    "Gemma3ForCausalLM": GemmaForCausalLM,  # text only; local/global layers: ModelArchConfig.layer_types
    # even layers local, no q/k norm; attention and final logit soft-capping: ModelArchConfig
    "Gemma2ForCausalLM": GemmaForCausalLM,
    # Phi-3/3.5/4-mini: fused qkv/gate_up as stored; LongRoPE, partial rotary, sliding window: ModelArchConfig
    "Phi3ForCausalLM": LlamaForCausalLM,
    # sparse MLP (top-k experts) on the layers ModelArchConfig.moe_layers marks; Qwen3-MoE adds q/k norm
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,  # and a shared expert gated per token; q/k/v bias
    "MixtralForCausalLM": LlamaForCausalLM,
}


def build_model(cfg: ModelArchConfig, kernels: KernelSelection, max_positions: int) -> CausalLM:
    """The model of `cfg.architecture`, its weights uninitialised (the loader fills them)."""
    cls = MODEL_CLASSES.get(cfg.architecture)
    if cls is None:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}; supported: {sorted(MODEL_CLASSES)}")
    return cls(cfg, kernels, max_positions)


def build_loaded_model(cfg: ModelArchConfig, kernels: KernelSelection, max_positions: int, state_dict: StateDict,
                       dtype: torch.dtype, device: torch.device, quantization: str | None = None,
                       linear_backend: str = "auto", kv_layout: KVCacheLayout | None = None) -> CausalLM:
    """The model of `cfg` holding `state_dict`'s weights in the formats its kernels read, ready to run.

    Native kernels: every matrix becomes a PackedWeight (GGUF matrices packed as stored when the loader kept them,
    `--quantization` blocks, else `pack_float` in `dtype`'s format); norms, biases and rope tables stay float32
    (the activations are float32); the whole stack is recorded into a native program. PyTorch: every tensor in
    `dtype` on `device`, int8 weights or oneDNN's packed copies where asked. `kv_layout`: where each layer's K/V
    live (None: kv_cache[layer], one block table)."""
    native = kernels.native is not None
    model = build_model(cfg, kernels, max_positions)
    if kv_layout is not None:
        model.place_kv(kv_layout)
    model.load_hf_state_dict(state_dict)
    model = model.to(device=device, dtype=torch.float32 if native else dtype).eval()
    model.to_device(device)
    if native:
        if quantization:
            quantize_model(model, quantization, native=True)
        pack_float_weights(model, dtype)
        model.build_native_program()
        return model
    if quantization:
        quantize_model(model, quantization, packed=use_onednn(linear_backend, dtype))
    if device.type == "cpu" and use_onednn(linear_backend, dtype):
        pack_model_linears(model)  # the float projections that remain
    return model

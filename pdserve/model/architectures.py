"""Architecture name (Hugging Face's `architectures[0]`, ModelArchConfig.architecture) -> the model class.

Adding an architecture: its config fields in ModelArchConfig.from_hf_config (and the GGUF metadata keys in
model/loader.py), a module with its decoder layer built from model/layers/ and its weight-name mapping
(`load_hf_state_dict`; GGUF tensor names in model/loader.py), and a line here. Its native whole-stack program
comes from its Python definition (model/native_program.py); a new op kind is a NativeOps method and an op in
csrc/native_program.cpp.
"""

from __future__ import annotations

from pdserve.config import ModelArchConfig
from pdserve.model.causal_lm import CausalLM
from pdserve.model.gemma import Gemma3ForCausalLM
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.native_ops import KernelSelection

MODEL_CLASSES: dict[str, type[LlamaForCausalLM] | type[Gemma3ForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,  # q/k/v bias: ModelArchConfig.attention_bias
    "Qwen3ForCausalLM": LlamaForCausalLM,  # q/k norm per head: ModelArchConfig.qk_norm
    "Gemma3ForCausalLM": Gemma3ForCausalLM,  # text only; local/global layers: ModelArchConfig.layer_types
}


def build_model(cfg: ModelArchConfig, kernels: KernelSelection, max_positions: int) -> CausalLM:
    """The model of `cfg.architecture`, its weights uninitialised (the loader fills them)."""
    cls = MODEL_CLASSES.get(cfg.architecture)
    if cls is None:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}; supported: {sorted(MODEL_CLASSES)}")
    return cls(cfg, kernels, max_positions)

"""Phi-3 / Phi-3.5 / Phi-4-mini decoder: the Llama layers (model/llama.py) with Phi-3's checkpoint layout.

The checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (gate rows first), which are the
fused matrices the Llama modules hold, so they load as they are. What differs lives in the config
(ModelArchConfig.from_hf_config): LongRoPE scaling (short/long factors, its attention factor; model/layers/rotary.py),
a partial rotary (Phi-4-mini: partial_rotary_factor), and one sliding window on every layer when the config sets it.
"""

from __future__ import annotations

import torch

from pdserve.config import ModelArchConfig
from pdserve.model.causal_lm import CausalLM, WeightLoader
from pdserve.model.llama import LlamaDecoderLayer, llama_layers, load_embeddings
from pdserve.model.native_ops import KernelSelection
from pdserve.model.packed_weights import StateDict


class Phi3ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelArchConfig, kernels: KernelSelection, max_positions: int | None = None) -> None:
        super().__init__(cfg, kernels)
        self.build(llama_layers(cfg, kernels, max_positions))

    @torch.no_grad()
    def load_hf_state_dict(self, sd: StateDict) -> None:
        """Copy Phi3ForCausalLM's Hugging Face-named weights in. Raises on missing or unexpected names."""
        load = WeightLoader(sd)
        load_embeddings(self, load)
        load.copy(self.norm.weight, "model.norm.weight")
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, LlamaDecoderLayer)
            p = f"model.layers.{i}."
            att, mlp = layer.self_attn, layer.mlp
            load.matrix(att.qkv_proj, [p + "self_attn.qkv_proj.weight"])
            load.matrix(att.o_proj, [p + "self_attn.o_proj.weight"])
            load.matrix(mlp.gate_up_proj, [p + "mlp.gate_up_proj.weight"])
            load.matrix(mlp.down_proj, [p + "mlp.down_proj.weight"])
            load.copy(layer.input_layernorm.weight, p + "input_layernorm.weight")
            load.copy(layer.post_attention_layernorm.weight, p + "post_attention_layernorm.weight")
        load.finish()

"""Gemma 2 and Gemma 3 decoders (text): the one definition of their layers.

Against the Llama family: the embedding is scaled by sqrt(hidden); every RMSNorm multiplies by (1 + w) (the loader
adds the 1 to the weight, so the norm modules are the usual ones); each layer has four norms (input, post-attention,
pre- and post-feedforward: a "sandwich"); q and k get a per-head norm; the MLP is GeGLU (gelu_pytorch_tanh); the
attention scale is query_pre_attn_scalar ** -0.5; and the layers alternate local ones (sliding window, their own
rope base `rope_local_theta`, unscaled) with global ones (rope_theta and rope_scaling), per `layer_types`.

Gemma 2 is the same layer without the q/k norms and with one rope for all layers (even layers local); it adds
attention logit soft-capping (in every attention backend: layers/paged_attention.py) and final logit soft-capping
(CausalLM.compute_logits), both from the config.

In vLLM's residual form a layer is: input norm with the residual add fused in, attention, a plain post-attention
norm, the pre-feedforward norm with the residual add fused in, the MLP, a plain post-feedforward norm.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.config import ModelArchConfig
from pdserve.model.attention import ForwardContext
from pdserve.model.causal_lm import CausalLM, WeightLoader
from pdserve.model.layers.norm import RMSNorm
from pdserve.model.layers.rotary import RotaryEmbedding
from pdserve.model.llama import LlamaAttention, LlamaMLP, load_attention, load_embeddings, load_mlp
from pdserve.model.native_ops import KernelSelection
from pdserve.model.packed_weights import StateDict

NORM_OFFSET = 1.0  # Gemma's RMSNorm scales by (1 + w): the module's weight is the checkpoint's w + 1


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, rotary: RotaryEmbedding,
                 kernels: KernelSelection) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, kernels)
        self.self_attn = LlamaAttention(cfg, layer_idx, rotary, kernels)
        self.post_attention_layernorm = RMSNorm(h, eps, kernels)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, kernels)
        self.mlp = LlamaMLP(cfg, kernels)
        self.post_feedforward_layernorm = RMSNorm(h, eps, kernels)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, ctx)
        hidden, _ = self.post_attention_layernorm(hidden, None)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        hidden, _ = self.post_feedforward_layernorm(hidden, None)
        return hidden, residual


class GemmaForCausalLM(CausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (architectures.py)."""

    def __init__(self, cfg: ModelArchConfig, kernels: KernelSelection, max_positions: int | None = None) -> None:
        super().__init__(cfg, kernels)
        positions = max_positions or cfg.max_position_embeddings
        global_rope = RotaryEmbedding(cfg.head_dim, positions, cfg.rope_theta, cfg.rope_scaling, kernels)
        local_rope = global_rope if cfg.rope_local_theta is None else \
            RotaryEmbedding(cfg.head_dim, positions, cfg.rope_local_theta, None, kernels)
        self.build([GemmaDecoderLayer(cfg, i, local_rope if cfg.layer_window(i) else global_rope, kernels)
                    for i in range(cfg.num_hidden_layers)], embed_scale=cfg.hidden_size ** 0.5)

    @torch.no_grad()
    def load_hf_state_dict(self, sd: StateDict) -> None:
        """Copy Hugging Face-named weights in (Gemma2/3ForCausalLM's names), fusing q/k/v and gate/up; every norm
        weight gets its 1 added. Raises on missing or unexpected names."""
        load = WeightLoader(sd)
        load_embeddings(self, load)
        load.copy(self.norm.weight, "model.norm.weight", NORM_OFFSET)
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, GemmaDecoderLayer)
            p = f"model.layers.{i}."
            load_attention(load, layer.self_attn, p + "self_attn.", self.cfg.attention_bias, NORM_OFFSET)
            load_mlp(load, layer.mlp, p + "mlp.")
            for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                         "post_feedforward_layernorm"):
                load.copy(getattr(layer, name).weight, p + name + ".weight", NORM_OFFSET)
        load.finish()

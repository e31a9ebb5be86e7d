"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3): the one definition of its layers.

Qwen2 adds a bias to q/k/v, Qwen3 an RMSNorm per head on q and k (config flags, ModelArchConfig). Weights are loaded
from Hugging Face parameter names; q/k/v and gate/up are fused into single matrices.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.config import ModelArchConfig
from pdserve.model.attention import ForwardContext
from pdserve.model.causal_lm import CausalLM, WeightLoader
from pdserve.model.layers.activation import SiluAndMul
from pdserve.model.layers.linear import Embedding, Linear
from pdserve.model.layers.norm import HeadRMSNorm, RMSNorm
from pdserve.model.layers.paged_attention import PagedAttention
from pdserve.model.layers.rotary import RotaryEmbedding
from pdserve.model.native_ops import KernelSelection
from pdserve.model.packed_weights import StateDict


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, rotary: RotaryEmbedding,
                 kernels: KernelSelection) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.q_size, self.kv_size = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias, kernels)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, False, kernels)
        self.q_norm = HeadRMSNorm(hd, cfg.rms_norm_eps, kernels) if cfg.qk_norm else None
        self.k_norm = HeadRMSNorm(hd, cfg.rms_norm_eps, kernels) if cfg.qk_norm else None
        self.rotary_emb = rotary  # shared by every layer
        self.attn = PagedAttention(cfg.num_attention_heads, cfg.num_key_value_heads, hd, hd ** -0.5, layer_idx,
                                   kernels)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, ctx))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig, kernels: KernelSelection) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, False, kernels)
        self.act_fn = SiluAndMul(kernels)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, False, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, rotary: RotaryEmbedding,
                 kernels: KernelSelection) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.self_attn = LlamaAttention(cfg, layer_idx, rotary, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.mlp = LlamaMLP(cfg, kernels)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelArchConfig, kernels: KernelSelection, max_positions: int | None = None) -> None:
        super().__init__(cfg, kernels)
        rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta,
                                 cfg.rope_scaling, kernels)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, kernels)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, rotary, kernels) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, kernels)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.no_grad()
    def load_hf_state_dict(self, sd: StateDict) -> None:
        """Copy Hugging Face-named weights in, fusing q/k/v and gate/up. Raises on missing or unexpected names.
        GGUF matrices are packed as stored (model/packed_weights.py)."""
        load = WeightLoader(sd)
        load.matrix(self.embed_tokens, ["model.embed_tokens.weight"])
        if not self.cfg.tie_word_embeddings:
            load.matrix(self.lm_head, ["lm_head.weight"])
        else:
            if self.embed_tokens.packed is not None:
                self.lm_head.set_packed(self.embed_tokens.packed)  # the same blocks, not a copy
            if "lm_head.weight" in sd:
                load.used.add("lm_head.weight")  # some checkpoints store the tied copy too
        load.copy(self.norm.weight, "model.norm.weight")
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, LlamaDecoderLayer)
            p = f"model.layers.{i}."
            att = layer.self_attn
            load.matrix(att.qkv_proj, [p + f"self_attn.{n}_proj.weight" for n in "qkv"],
                        [p + f"self_attn.{n}_proj.bias" for n in "qkv"] if self.cfg.attention_bias else None)
            load.matrix(att.o_proj, [p + "self_attn.o_proj.weight"])
            if att.q_norm is not None and att.k_norm is not None:
                load.copy(att.q_norm.weight, p + "self_attn.q_norm.weight")
                load.copy(att.k_norm.weight, p + "self_attn.k_norm.weight")
            load.matrix(layer.mlp.gate_up_proj, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
            load.matrix(layer.mlp.down_proj, [p + "mlp.down_proj.weight"])
            load.copy(layer.input_layernorm.weight, p + "input_layernorm.weight")
            load.copy(layer.post_attention_layernorm.weight, p + "post_attention_layernorm.weight")
        load.finish()


"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3): the one definition of its layers.

Qwen2 adds a bias to q/k/v, Qwen3 an RMSNorm per head on q and k (config flags, ModelArchConfig). Weights are loaded
from Hugging Face parameter names; q/k/v and gate/up are fused into single matrices (Phi-3's checkpoints store them
fused already: `qkv_proj`, `gate_up_proj` with the gate rows first; its LongRoPE, partial rotary and sliding window
come from the config). Gemma 2/3 (model/gemma.py) reuse
the attention (its scale, sliding window, soft-capping and rope from the config) and the MLP (GeGLU by `hidden_act`).
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.config import ModelArchConfig
from pdserve.model.attention import ForwardContext
from pdserve.model.causal_lm import CausalLM, WeightLoader
from pdserve.model.layers.activation import GeluTanhAndMul, SiluAndMul
from pdserve.model.layers.linear import Linear
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
        self.rotary_emb = rotary  # shared by the layers of one rope base
        scale = (cfg.query_pre_attn_scalar or hd) ** -0.5
        self.attn = PagedAttention(cfg.num_attention_heads, cfg.num_key_value_heads, hd, scale, layer_idx, kernels,
                                   cfg.layer_window(layer_idx), cfg.attn_logit_softcapping)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, ctx))


ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}  # ModelArchConfig.hidden_act -> gated op


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig, kernels: KernelSelection) -> None:
        super().__init__()
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}; supported: {sorted(ACTIVATIONS)}")
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, False, kernels)
        self.act_fn = ACTIVATIONS[cfg.hidden_act](kernels)
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
                                 cfg.rope_scaling, kernels, cfg.rotary_dim)
        self.build([LlamaDecoderLayer(cfg, i, rotary, kernels) for i in range(cfg.num_hidden_layers)])

    @torch.no_grad()
    def load_hf_state_dict(self, sd: StateDict) -> None:
        """Copy Hugging Face-named weights in, fusing q/k/v and gate/up. Raises on missing or unexpected names.
        GGUF matrices are packed as stored (model/packed_weights.py)."""
        load = WeightLoader(sd)
        load_embeddings(self, load)
        load.copy(self.norm.weight, "model.norm.weight")
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, LlamaDecoderLayer)
            p = f"model.layers.{i}."
            load_attention(load, layer.self_attn, p + "self_attn.", self.cfg.attention_bias)
            load_mlp(load, layer.mlp, p + "mlp.")
            load.copy(layer.input_layernorm.weight, p + "input_layernorm.weight")
            load.copy(layer.post_attention_layernorm.weight, p + "post_attention_layernorm.weight")
        load.finish()


def load_embeddings(model: CausalLM, load: WeightLoader) -> None:
    """The token embedding and the lm_head (the embedding's own weight, blocks included, when tied)."""
    load.matrix(model.embed_tokens, ["model.embed_tokens.weight"])
    if not model.cfg.tie_word_embeddings:
        load.matrix(model.lm_head, ["lm_head.weight"])
        return
    if model.embed_tokens.packed is not None:
        model.lm_head.set_packed(model.embed_tokens.packed)  # the same blocks, not a copy
    if "lm_head.weight" in load.sd:
        load.used.add("lm_head.weight")  # some checkpoints store the tied copy too


def load_attention(load: WeightLoader, att: LlamaAttention, prefix: str, bias: bool, norm_offset: float = 0.0) -> None:
    """q/k/v fused (or as stored fused), o, and the q/k norms (`norm_offset` added: Gemma stores w for its (1 + w)
    scale)."""
    parts = ["qkv"] if prefix + "qkv_proj.weight" in load.sd else list("qkv")  # Phi-3 stores them fused
    load.matrix(att.qkv_proj, [prefix + f"{n}_proj.weight" for n in parts],
                [prefix + f"{n}_proj.bias" for n in parts] if bias else None)
    load.matrix(att.o_proj, [prefix + "o_proj.weight"])
    if att.q_norm is not None and att.k_norm is not None:
        load.copy(att.q_norm.weight, prefix + "q_norm.weight", norm_offset)
        load.copy(att.k_norm.weight, prefix + "k_norm.weight", norm_offset)


def load_mlp(load: WeightLoader, mlp: LlamaMLP, prefix: str) -> None:
    parts = ["gate_up"] if prefix + "gate_up_proj.weight" in load.sd else ["gate", "up"]  # Phi-3: fused
    load.matrix(mlp.gate_up_proj, [prefix + f"{n}_proj.weight" for n in parts])
    load.matrix(mlp.down_proj, [prefix + "down_proj.weight"])


"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3, and with a sparse MLP Qwen3-MoE, Qwen2-MoE
and Mixtral): the one definition of its layers.

Qwen2 adds a bias to q/k/v, Qwen3 an RMSNorm per head on q and k (config flags, ModelArchConfig). Weights are loaded
from Hugging Face parameter names; q/k/v and gate/up are fused into single matrices (Phi-3's checkpoints store them
fused already: `qkv_proj`, `gate_up_proj` with the gate rows first; its LongRoPE, partial rotary and sliding window
come from the config). Qwen3-MoE, Qwen2-MoE (plus a gated shared expert) and Mixtral are this decoder with a sparse
MLP (layers/moe.py) on the layers `ModelArchConfig.moe_layers` marks; their checkpoints name experts per expert
(Qwen3: `mlp.experts.E.gate_proj`, Mixtral: `block_sparse_moe.experts.E.w1/w3/w2`) or, as transformers 5 holds them,
as 3-D `mlp.experts.gate_up_proj` / `down_proj`. Gemma 2/3 (model/gemma.py) reuse the attention (its scale, sliding
window, soft-capping and rope from the config) and the MLP (GeGLU by `hidden_act`).
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.config import ModelArchConfig
from pdserve.model.attention import ForwardContext
from pdserve.model.causal_lm import CausalLM, WeightLoader
from pdserve.model.layers.activation import GeluTanhAndMul, SiluAndMul
from pdserve.model.layers.linear import Linear
from pdserve.model.layers.moe import Expert, SparseMoE
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
        self.mlp: LlamaMLP | SparseMoE = SparseMoE(
            cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob,
            kernels, cfg.shared_expert_intermediate_size) if cfg.is_moe_layer(layer_idx) else LlamaMLP(cfg, kernels)

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
        load = WeightLoader(split_fused_experts(sd) if self.cfg.is_moe else sd)
        load_embeddings(self, load)
        load.copy(self.norm.weight, "model.norm.weight")
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, LlamaDecoderLayer)
            p = f"model.layers.{i}."
            load_attention(load, layer.self_attn, p + "self_attn.", self.cfg.attention_bias)
            if isinstance(layer.mlp, SparseMoE):
                load_moe(load, layer.mlp, p)
            else:
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


# Mixtral's checkpoint names of an expert's gate, up and down matrices
_MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")


def split_fused_experts(sd: StateDict) -> StateDict:
    """`sd` with transformers 5's fused 3-D expert tensors (mlp.experts.gate_up_proj [E, 2I, H], gate rows first;
    mlp.experts.down_proj [E, H, I]) replaced by per-expert views under the checkpoint names; `sd` itself when none."""
    fused = [k for k in sd if k.endswith("mlp.experts.gate_up_proj")]
    if not fused:
        return sd
    out = dict(sd)
    for key in fused:
        mlp = key.removesuffix("experts.gate_up_proj")
        gate_up, down = out.pop(key), out.pop(mlp + "experts.down_proj")
        assert isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            out[f"{mlp}experts.{e}.gate_proj.weight"] = gate_up[e, :inter]
            out[f"{mlp}experts.{e}.up_proj.weight"] = gate_up[e, inter:]
            out[f"{mlp}experts.{e}.down_proj.weight"] = down[e]
    return out


def _expert_names(sd: StateDict, layer_prefix: str, num_experts: int) -> tuple[str, list[list[str]]]:
    """The router's name and each expert's [gate, up, down] names under `layer_prefix` ("model.layers.N."), in the
    checkpoint's spelling (Qwen3-MoE's, or Mixtral's block_sparse_moe with w1/w3/w2)."""
    mlp = layer_prefix + "mlp."
    if mlp + "gate.weight" in sd:
        return mlp + "gate.weight", [[f"{mlp}experts.{e}.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
                                     for e in range(num_experts)]
    moe = layer_prefix + "block_sparse_moe."
    return moe + "gate.weight", [[f"{moe}experts.{e}.{w}.weight" for w in _MIXTRAL_EXPERT_NAMES]
                                 for e in range(num_experts)]


def load_moe(load: WeightLoader, moe: SparseMoE, layer_prefix: str) -> None:
    """The router and every expert's gate|up (fused) and down; GGUF experts packed as stored, one matrix each."""
    router, experts = _expert_names(load.sd, layer_prefix, len(moe.experts))
    load.matrix(moe.gate, [router])
    for expert, (gate, up, down) in zip(moe.experts, experts):
        assert isinstance(expert, Expert)
        load.matrix(expert.gate_up_proj, [gate, up])
        load.matrix(expert.down_proj, [down])
    if moe.shared_expert is not None and moe.shared_expert_gate is not None:  # Qwen2-MoE
        shared = layer_prefix + "mlp.shared_expert."
        load.matrix(moe.shared_expert.gate_up_proj, [shared + "gate_proj.weight", shared + "up_proj.weight"])
        load.matrix(moe.shared_expert.down_proj, [shared + "down_proj.weight"])
        load.matrix(moe.shared_expert_gate, [layer_prefix + "mlp.shared_expert_gate.weight"])

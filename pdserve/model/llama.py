"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) on flat token batches.

`forward(input_ids [T], positions [T], kv_cache, attn_meta)` runs every token of a step (decodes and prefill
chunks of many sequences) as one [T, hidden] matrix; only attention looks at sequence boundaries. Weights are
loaded from Hugging Face parameter names; q/k/v and gate/up are fused into single matmuls.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.config import ModelArchConfig
from pdserve.model.attention import AttentionBackend, AttentionMetadata
from pdserve.model.quant_linear import QuantEmbedding, QuantizedWeight, QuantLinear, StateDict


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op instead of six
        # As Hugging Face: normalise in float32, scale in the input dtype.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_inv_freq(cfg: ModelArchConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling
    if not rs:
        return inv_freq
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        return inv_freq / float(rs["factor"])
    if kind == "llama3":
        factor = float(rs["factor"])
        low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
        old_ctx = float(rs["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Hugging Face's rotate-half RoPE with a precomputed cos/sin table indexed by position."""

    def __init__(self, cfg: ModelArchConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(cfg)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        # plain attributes, not buffers: they stay float32 when the model is cast to bf16
        self.cos = freqs.cos()  # [P, D/2]
        self.sin = freqs.sin()

    def to_device(self, device: torch.device) -> None:
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D/2] of a step's positions: looked up once per step, shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def rotate(rope: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor,
              k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layer_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.rotate(rope, q, k)
        o = backend.forward(q, k, v, layer_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))

    def forward_native(self, x: torch.Tensor, positions: torch.Tensor, layer_cache: torch.Tensor,
                       meta: AttentionMetadata, rotary: RotaryEmbedding, ops: Any) -> torch.Tensor:
        """The same computation in four native calls on views of the fused qkv output (no copies)."""
        t, hd = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(t, self.num_heads, hd)).reshape(t, self.q_size)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, hd)).reshape(t, self.kv_size)
        ops.rotary_embedding(positions, q, k, rotary.cos, rotary.sin, hd)
        ops.reshape_and_cache(k.view(t, self.num_kv_heads, hd), v.view(t, self.num_kv_heads, hd), layer_cache,
                              meta.slot_mapping)
        out = torch.empty(t, self.num_heads, hd)
        ops.paged_attention(out, q.view(t, self.num_heads, hd), layer_cache, meta.block_table, meta.query_start_loc,
                            meta.seq_lens, self.scale)
        return self.o_proj(out.view(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layer_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, layer_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                       layer_cache: torch.Tensor, meta: AttentionMetadata, rotary: RotaryEmbedding,
                       ops: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's residual form: returns (normed-input-free output, residual stream). Fused norm+add, RoPE in
        place, K/V written in place, attention on the blocks, SiLU*mul: 9 dispatched calls per layer."""
        if residual is None:
            residual, x = x, torch.empty_like(x)
            ops.rms_norm(x, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        else:
            ops.fused_add_rms_norm(x, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        x = self.self_attn.forward_native(x, positions, layer_cache, meta, rotary, ops)
        ops.fused_add_rms_norm(x, residual, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        gate_up = self.mlp.gate_up_proj(x)
        act = torch.empty(x.shape[0], self.mlp.intermediate)
        ops.silu_and_mul(act, gate_up)
        return self.mlp.down_proj(act), residual


_INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                   "xavier_normal_", "trunc_normal_", "zeros_", "ones_", "constant_")
_init_lock = threading.Lock()


@contextlib.contextmanager
def skip_weight_init() -> Iterator[None]:
    """Modules built inside skip their random initialisation (nn.init's functions return their tensor as is), as
    transformers' `no_init_weights` does: the loader overwrites every weight anyway. Building on the meta device
    instead would import torch._dynamo (its meta kernels) and random-fill a 28M-row embedding: about 1.5 s."""
    with _init_lock:
        saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
        try:
            for name in _INIT_FUNCTIONS:
                setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
            yield
        finally:
            for name, fn in saved.items():
                setattr(nn.init, name, fn)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelArchConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """Returns final hidden states [T, hidden]; call `compute_logits` on the rows that need sampling."""
        ops = getattr(backend, "ops", None)
        if ops is not None:  # the native backend: fused layer ops as well as its attention
            return self._forward_native(input_ids, positions, kv_cache, meta, ops)
        x = self.embed_tokens(input_ids)
        rope = self.rotary.table(positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, kv_cache[i], meta, backend)
        return self.norm(x)

    def build_native_decoder(self, ops: Any) -> bool:
        """Hand the decoder layers to the native NativeDecoder (one call per step for the whole stack) when every
        projection is GGUF blocks and the architecture has no per-head q/k norm; else the Python loop runs."""
        self._native_decoder = None
        layers = cast("list[DecoderLayer]", self.layers)
        linears = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                    layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if not all(isinstance(m, QuantLinear) for m in linears) or self.cfg.qk_norm:
            return False
        att0 = layers[0].self_attn
        dec = ops.NativeDecoder(att0.num_heads, att0.num_kv_heads, att0.head_dim, self.cfg.intermediate_size,
                                self.cfg.rms_norm_eps, att0.scale, self.rotary.cos.contiguous(),
                                self.rotary.sin.contiguous())
        for layer in layers:
            qkv, o = cast(QuantLinear, layer.self_attn.qkv_proj), cast(QuantLinear, layer.self_attn.o_proj)
            gu, down = cast(QuantLinear, layer.mlp.gate_up_proj), cast(QuantLinear, layer.mlp.down_proj)
            dec.add_layer(layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                          qkv.qweight, qkv.qtype, qkv.bias, o.qweight, o.qtype, gu.qweight, gu.qtype, down.qweight,
                          down.qtype)
        self._native_decoder = dec
        return True

    def _forward_native(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                        meta: AttentionMetadata, ops: Any) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        decoder = getattr(self, "_native_decoder", None)
        if decoder is not None:
            x, residual = decoder.forward(x, positions, kv_cache, meta.slot_mapping, meta.block_table,
                                          meta.query_start_loc, meta.seq_lens)
        else:
            for i, layer in enumerate(cast("list[DecoderLayer]", self.layers)):
                x, residual = layer.forward_native(x, residual, positions, kv_cache[i], meta, self.rotary, ops)
        assert residual is not None
        ops.fused_add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_hf_state_dict(self, sd: StateDict) -> None:
        """Copy Hugging Face-named weights in, fusing q/k/v and gate/up. Raises on missing or unexpected names.
        QuantizedWeight entries (GGUF blocks kept as stored) replace their nn.Linear / nn.Embedding by the native
        QuantLinear / QuantEmbedding; a fused projection whose parts differ in block type is dequantized."""
        cfg = self.cfg
        used: set[str] = set()

        def take(name: str) -> torch.Tensor | QuantizedWeight:
            if name not in sd:
                raise KeyError(f"checkpoint lacks {name}")
            used.add(name)
            return sd[name]

        emb = take("model.embed_tokens.weight")
        if isinstance(emb, QuantizedWeight):
            self.embed_tokens = QuantEmbedding(emb)  # type: ignore[assignment]
            if cfg.tie_word_embeddings:
                self.lm_head = cast(QuantEmbedding, self.embed_tokens).as_linear()  # type: ignore[assignment]
        else:
            self.embed_tokens.weight.copy_(emb)
        self.norm.weight.copy_(cast(torch.Tensor, take("model.norm.weight")))
        if not cfg.tie_word_embeddings:
            _load_linear(self, "lm_head", [take("lm_head.weight")], None)
        elif "lm_head.weight" in sd:
            used.add("lm_head.weight")  # some checkpoints store the tied copy too
        for i, layer in enumerate(cast("list[DecoderLayer]", self.layers)):
            p = f"model.layers.{i}."
            att = layer.self_attn
            bias = None
            if cfg.attention_bias:
                bias = torch.cat([cast(torch.Tensor, take(p + f"self_attn.{n}_proj.bias")) for n in "qkv"])
            _load_linear(att, "qkv_proj", [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], bias)
            _load_linear(att, "o_proj", [take(p + "self_attn.o_proj.weight")], None)
            if att.q_norm is not None and att.k_norm is not None:
                att.q_norm.weight.copy_(cast(torch.Tensor, take(p + "self_attn.q_norm.weight")))
                att.k_norm.weight.copy_(cast(torch.Tensor, take(p + "self_attn.k_norm.weight")))
            _load_linear(layer.mlp, "gate_up_proj", [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")],
                         None)
            _load_linear(layer.mlp, "down_proj", [take(p + "mlp.down_proj.weight")], None)
            layer.input_layernorm.weight.copy_(cast(torch.Tensor, take(p + "input_layernorm.weight")))
            layer.post_attention_layernorm.weight.copy_(cast(torch.Tensor, take(p + "post_attention_layernorm.weight")))
        unexpected = [k for k in sd if k not in used and "rotary_emb" not in k]
        if unexpected:
            raise KeyError(f"checkpoint has unexpected weights, e.g. {unexpected[:5]}")


def _load_linear(owner: nn.Module, attr: str, parts: list[torch.Tensor | QuantizedWeight],
                 bias: torch.Tensor | None) -> None:
    """Fill owner.attr (an nn.Linear) with the row-concatenation of `parts`, or replace it by a QuantLinear when
    every part is a QuantizedWeight of one block type."""
    qparts = [p for p in parts if isinstance(p, QuantizedWeight)]
    if qparts and len(qparts) == len(parts) and len({p.qtype for p in qparts}) == 1:
        setattr(owner, attr, QuantLinear(QuantizedWeight.cat(qparts), bias))
        return
    linear = cast(nn.Linear, getattr(owner, attr))
    floats = [p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts]
    linear.weight.copy_(torch.cat(floats))
    if bias is not None:
        linear.bias.copy_(bias)

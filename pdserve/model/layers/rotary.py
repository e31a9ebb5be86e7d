"""Rotary position embedding (Hugging Face's rotate-half form) with a cos/sin table precomputed per position.

One instance per distinct (head_dim, base, scaling): the layers that share it hold the same module (Gemma 3's local
and global layers would hold two, each with its own base). q and k are [T, heads * head_dim], possibly column slices
of the fused qkv output: the native kernel rotates them in place there, the reference returns new tensors. With a
partial rotary (Phi-4-mini) only the first `rotary_dim` dims of each head turn; the rest pass through.

LongRoPE (Phi-3/3.5/4-mini) keeps two factor sets. transformers picks one per forward call (long when the call's
highest position reaches original_max_position_embeddings), so what a token gets depends on how its sequence was
split into calls. Here the choice is per position (short below the original length, long from it on): the same for
any chunking, batching or prefix-cache hit, and transformers' result whenever its calls cut at that length (as when
a conversation grows past it token by token). Both sets' tables carry the attention factor
sqrt(1 + ln(factor) / ln(original)), factor = max_position_embeddings / original unless given.

YaRN (Qwen2.5/Qwen3 long context) is one static table, as transformers computes it (its frequencies do not depend
on the call), its cos/sin scaled by the attention factor. Dynamic NTK is refused (config.unsupported_rope_message).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pdserve.config import unsupported_rope_message
from pdserve.model.native_ops import KernelSelection


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The scaling's kind ("default" when none), under its current key or the old `type`."""
    return str(scaling.get("rope_type", scaling.get("type", "default"))) if scaling else "default"


def rope_inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """The inverse frequencies [head_dim / 2] of a rope base and the factor on cos/sin (1 but for YaRN), with
    Hugging Face's linear, llama3 or YaRN scaling."""
    pos_freqs = base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    inv_freq = 1.0 / pos_freqs
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq, 1.0
    assert scaling is not None
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(head_dim, base, pos_freqs, scaling)
    raise ValueError(unsupported_rope_message(kind))


def _yarn(dim: int, base: float, pos_freqs: torch.Tensor, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN as transformers' _compute_yarn_parameters: frequencies that turn fewer than beta_slow times over the
    original context are interpolated (divided by factor), those that turn more than beta_fast times kept, a linear
    ramp between; cos/sin scaled by attention_factor (0.1 ln(factor) + 1 unless given, or mscale's ratio)."""
    factor = float(scaling["factor"])
    orig = float(scaling["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: the frequency is kept
    # as transformers rounds them: 1 / (factor * base^(2i/d)), not (1 / base^(2i/d)) / factor
    return 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation, float(attention_factor)


def _longrope_inv_freq(dim: int, base: float, factors: list[float]) -> torch.Tensor:
    if len(factors) != dim // 2:
        raise ValueError(f"longrope factors have {len(factors)} entries for a rotary dim of {dim} (need {dim // 2})")
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** exponent)


def rope_tables(dim: int, max_positions: int, base: float,
                scaling: dict[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, dim / 2] of rotary dim `dim` (see the module docstring for LongRoPE)."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    if rope_type(scaling) not in ("longrope", "su"):
        inv_freq, attention_factor = rope_inv_freq(dim, base, scaling)
        freqs = torch.outer(positions, inv_freq)
        if attention_factor == 1.0:
            return freqs.cos(), freqs.sin()
        return freqs.cos() * attention_factor, freqs.sin() * attention_factor
    assert scaling is not None
    orig = int(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or 1.0)
    given = scaling.get("attention_factor")
    if given is not None:
        attention_factor = float(given)
    else:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1.0 else 1.0
    short = torch.outer(positions, _longrope_inv_freq(dim, base, scaling["short_factor"]))
    long = torch.outer(positions, _longrope_inv_freq(dim, base, scaling["long_factor"]))
    freqs = torch.where((positions < orig).unsqueeze(1), short, long)
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict[str, Any] | None,
                 kernels: KernelSelection, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        if self.rotary_dim % 2 or self.rotary_dim > head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and at most head_dim {head_dim}")
        # plain attributes, not buffers: they stay float32 when the model is cast to bf16 (to_device moves them)
        self.cos, self.sin = rope_tables(self.rotary_dim, max_positions, base, scaling)  # [P, rotary_dim / 2]
        self.kernels = kernels
        self._impl = self._native if kernels.native is not None else self._reference

    def to_device(self, device: torch.device) -> None:
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._impl(positions, q, k)

    def _reference(self, positions: torch.Tensor, q: torch.Tensor,
                   k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [T, 1, D/2]
        return _rotate(q, cos, sin, self.head_dim), _rotate(k, cos, sin, self.head_dim)

    def _native(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.kernels.ops.rotary(positions, q, k, self.cos, self.sin, self.head_dim)
        return q, k


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    dtype = x.dtype
    xf = x.unflatten(-1, (-1, head_dim)).float()
    rot = 2 * cos.shape[-1]
    x1, x2 = xf[..., :rot].chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, xf[..., rot:]), dim=-1).to(dtype).flatten(-2)

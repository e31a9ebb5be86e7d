"""The attention op of one layer: write the step's K/V into the layer's blocks of the paged cache, then attend
(model/attention.py has the cache layout and the backends). q [T, Hq * D], k and v [T, Hkv * D] (column slices of the
fused qkv output are fine) -> [T, Hq * D]. `sliding_window` > 0 (Gemma 3's local layers): the query at position p
attends to keys p - sliding_window < j <= p only; `softcap` > 0 (Gemma 2): scores s become softcap * tanh(s / softcap)
before the softmax, on every backend (sdpa, flex, the native kernels); plain data handed to the kernels with the
rest."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.model.attention import ForwardContext
from pdserve.model.native_ops import KernelSelection


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int,
                 kernels: KernelSelection, sliding_window: int = 0, softcap: float = 0.0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.layer_idx = layer_idx
        # where its K/V live (model/kv_layout.py): kv_cache[kv_index] with KV group kv_group's block table
        self.kv_group, self.kv_index = 0, layer_idx
        self.kernels = kernels
        self._impl = self._native if kernels.native is not None else self._reference

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self._impl(q, k, v, ctx)

    def _reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        d = self.head_dim
        out = self.kernels.attention.forward(q.unflatten(-1, (-1, d)), k.unflatten(-1, (-1, d)),
                                             v.unflatten(-1, (-1, d)), ctx.kv_cache[self.kv_index],
                                             ctx.meta.for_group(self.kv_group), self.scale, self.sliding_window,
                                             self.softcap)
        return out.reshape(q.shape[0], self.num_heads * d)

    def _native(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.kernels.ops.attention(q, k, v, ctx, self.kv_index, self.num_heads, self.num_kv_heads,
                                          self.head_dim, self.scale, self.sliding_window, self.softcap, self.kv_group)

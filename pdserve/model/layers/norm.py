"""RMSNorm in vLLM's residual form, and the per-head RMSNorm of q and k (Qwen3, Gemma 3).

`norm(x, None)` -> (rms_norm(x), x): the first layer's input norm, whose input becomes the residual stream.
`norm(x, residual)` -> (rms_norm(x + residual), x + residual): every later norm, the residual add fused in (the
native kernel does both in place, in one pass). Gemma's (1 + w) scaling is a weight-loading matter (the loader adds
the 1), not a variant here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.native_ops import KernelSelection


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Row-wise RMSNorm of x [..., H] as Hugging Face computes it: in float32, scaled in the input dtype."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op instead of six
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: KernelSelection) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = kernels
        self._impl = self._native if kernels.native is not None else self._reference

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, new residual); see the module docstring."""
        return self._impl(x, residual)

    def _reference(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        return rms_norm_reference(x, self.weight, self.eps), x

    def _native(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        ops = self.kernels.ops
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps), x
        ops.add_rms_norm(x, residual, self.weight, self.eps)  # x and residual in place
        return x, residual


class HeadRMSNorm(nn.Module):
    """RMSNorm of every head_dim-wide head of x [T, heads * head_dim] (x may be a column slice of the fused qkv
    output; the native kernel normalises it in place there)."""

    def __init__(self, head_dim: int, eps: float, kernels: KernelSelection) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps
        self.kernels = kernels
        self._impl = self._native if kernels.native is not None else self._reference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._impl(x)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        heads = x.unflatten(-1, (-1, self.weight.shape[0]))
        return rms_norm_reference(heads, self.weight, self.eps).flatten(-2)

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        self.kernels.ops.head_rms_norm(x, self.weight, self.eps)
        return x

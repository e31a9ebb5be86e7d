"""Gated activations of the MLP: x [T, 2I] (gate | up, as the fused gate_up projection writes them) -> [T, I].
GeGLU (Gemma: gelu_tanh(gate) * up) is the same shape with another function and native op."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.native_ops import KernelSelection


class SiluAndMul(nn.Module):
    def __init__(self, kernels: KernelSelection) -> None:
        super().__init__()
        self.kernels = kernels
        self._impl = self._native if kernels.native is not None else self._reference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._impl(x)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.ops.silu_and_mul(x)

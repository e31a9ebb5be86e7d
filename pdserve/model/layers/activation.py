"""Gated activations of the MLP: x [T, 2I] (gate | up, as the fused gate_up projection writes them) -> [T, I]:
SwiGLU (silu(gate) * up: Llama, Qwen) and GeGLU (gelu_tanh(gate) * up: Gemma's gelu_pytorch_tanh)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.native_ops import KernelSelection


class _GatedAndMul(nn.Module):
    """act(gate) * up; a subclass names its function and its native op."""

    def __init__(self, kernels: KernelSelection) -> None:
        super().__init__()
        self.kernels = kernels
        self._impl = self._native if kernels.native is not None else self._reference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._impl(x)

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class SiluAndMul(_GatedAndMul):
    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate)

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.ops.silu_and_mul(x)


class GeluTanhAndMul(_GatedAndMul):
    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh")

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.ops.gelu_tanh_and_mul(x)

"""Linear layers on oneDNN with weights pre-packed once (`--linear-backend onednn`, the default for float32 on CPU).

A plain `F.linear` hands the weight to MKL's GEMM, which re-packs it into its blocked layout on every call: for the
skinny products of decode (a few rows against a large weight) that is a second pass over every weight byte per
step. oneDNN takes the weight already reordered (`torch.ops.mkldnn._reorder_linear_weight`, once at load) and on
this 2-core AVX2 machine runs the SmolLM2 layers 1.3x (batch 1) to 1.6x (batch 8) faster. For large row counts
(prefill chunks) MKL's GEMM is ~5 % faster, so rows above `PACKED_MAX_ROWS` keep using it; the packed copy costs one
more copy of the weights in RAM. Results differ from `F.linear` by float rounding only (a few ulp).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LINEAR_BACKENDS = ("auto", "onednn", "torch")
PACKED_MAX_ROWS = 256  # measured: oneDNN packed wins up to ~a few hundred rows, MKL GEMM above


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's blocked layout (an opaque tensor of the same shape; use only with packed_linear)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())  # no batch hint: best for 1-256 rows


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """nn.Linear with a pre-packed oneDNN copy of its weight for steps of up to PACKED_MAX_ROWS rows."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight  # shared, not copied: a tied embedding keeps reading it
        self.bias = linear.bias
        self.packed = pack_weight(linear.weight)  # not a buffer: the roofline counts one copy of the weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= PACKED_MAX_ROWS:
            return packed_linear(x.contiguous(), self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def use_onednn(backend: str, dtype: torch.dtype) -> bool:
    """auto: oneDNN packed weights for float32 where PyTorch has oneDNN; onednn: require it; torch: never."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    ok = onednn_available() and dtype == torch.float32
    if backend == "onednn" and not ok:
        raise ValueError("linear_backend=onednn needs PyTorch with oneDNN (mkldnn) and dtype float32")
    return ok


def pack_model_linears(model: nn.Module) -> None:
    """Replace every nn.Linear under `model` (decoder projections and lm_head) by a PackedLinear, in place."""
    for name, child in list(model.named_children()):
        if type(child) is nn.Linear:  # not subclasses, not already-quantized layers
            setattr(model, name, PackedLinear(child))
        else:
            pack_model_linears(child)

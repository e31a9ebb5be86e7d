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

from pdserve.model.layers.linear import Linear

LINEAR_BACKENDS = ("auto", "onednn", "torch")
PACKED_MAX_ROWS = 256  # measured: oneDNN packed wins up to ~a few hundred rows, MKL GEMM above


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's blocked layout (an opaque tensor of the same shape; use only with packed_linear)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())  # no batch hint: best for 1-256 rows


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class OneDNNWeight:
    """A float weight W [N, K] with a pre-packed oneDNN copy for steps of up to PACKED_MAX_ROWS rows (a
    PackedMatrix, model/native_ops.py). The plain weight is kept, not copied: larger steps and embedding lookups of
    a tied embedding read it."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach()
        self.packed = pack_weight(weight)  # the roofline counts one copy of the weights: `nbytes` is the plain one's

    @property
    def shape(self) -> tuple[int, int]:
        return (self.weight.shape[0], self.weight.shape[1])

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    @property
    def type_name(self) -> str:
        return "F32"

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                prompt_rows: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] <= PACKED_MAX_ROWS:
            return packed_linear(x.contiguous(), self.packed, bias)
        return F.linear(x, self.weight, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def dequantize(self) -> torch.Tensor:
        return self.weight


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
    """Give every float Linear under `model` (decoder projections and lm_head) a OneDNNWeight, in place."""
    for m in model.modules():
        if isinstance(m, Linear) and m.weight is not None and m.weight.dtype == torch.float32:
            m.set_packed(OneDNNWeight(m.weight))

"""Weight-only quantization of float checkpoints (`--quantization int8|int4`).

With the native kernels (the default where they are built), every projection's weight becomes GGUF
blocks of 32 weights with their own scale (int8 -> Q8_0, int4 -> Q4_1), packed for pdserve/kernels as a GGUF file's
blocks are (model/packed_weights.py). The rest of this file is the PyTorch path (`--kernels torch`, int8 only),
through PyTorch's own CPU kernel:

Each linear layer's weight becomes int8 with one scale per output channel (symmetric, round to nearest). The scale
is rounded to bfloat16 *before* quantizing, so the int8 kernel (which takes bf16 scales) and the dequantized copy
below use exactly the same weights.

Why two paths: a decode step at small batch is bandwidth-bound, so reading 1 byte per weight instead of 4 is what
pays; `torch.ops.aten._weight_int8pack_mm` does that (activations cast to bf16, fp32 accumulation). At larger
batches the step is compute-bound and that kernel is slower than an fp32 GEMM on CPUs without AVX-512, so steps
with more rows than `max_int8_rows` run an fp32 GEMM (oneDNN with a pre-packed copy where available) on the
dequantized weights (int8 values x scale, kept in memory: the same weights, 4 more bytes per parameter of RAM).
Quality is that of the int8 weights either way; the bf16 activation rounding of the int8 path adds a little
(BENCHMARKS.md, "Quantization quality").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.cpu_linear import PACKED_MAX_ROWS, pack_weight, packed_linear
from pdserve.model.layers.linear import Linear
from pdserve.model.packed_weights import quantize

QUANTIZATION_METHODS = ("int8", "int4")
# Steps with at most this many tokens read the int8 weights. Measured crossover on 2 AVX2 cores: 8-16 rows
# against MKL's fp32 GEMM, ~8 rows against oneDNN with pre-packed fp32 weights (cpu_linear.py).
INT8_MAX_ROWS = 12
INT8_MAX_ROWS_VS_PACKED = 6


class Int8Weight:
    """A PackedMatrix (model/native_ops.py) of int8 weights [out, in] with a bf16 scale per output channel, made from
    a float weight; computes in the float weight's dtype."""

    def __init__(self, weight: torch.Tensor, packed: bool = False) -> None:
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(torch.bfloat16)
        q = torch.round(w / scale.float().unsqueeze(1)).clamp(-127, 127).to(torch.int8)
        self.weight_int8 = q.contiguous()
        self.scale = scale
        self.compute_dtype = weight.dtype
        # the live roofline counts the int8 bytes a bandwidth-bound step reads (`nbytes`), not this copy
        self.weight_dequant = (q.float() * scale.float().unsqueeze(1)).to(self.compute_dtype)
        self.packed = pack_weight(self.weight_dequant) if packed else None  # oneDNN copy (cpu_linear.py)
        self.max_int8_rows = INT8_MAX_ROWS_VS_PACKED if packed else INT8_MAX_ROWS

    @property
    def shape(self) -> tuple[int, int]:
        return (self.weight_int8.shape[0], self.weight_int8.shape[1])

    @property
    def nbytes(self) -> int:
        return self.weight_int8.numel()

    @property
    def type_name(self) -> str:
        return "int8"

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                prompt_rows: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] <= self.max_int8_rows:
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.weight_int8, self.scale)
            y = y.to(x.dtype)
            return y if bias is None else y + bias
        if self.packed is not None and x.shape[0] <= PACKED_MAX_ROWS:
            return packed_linear(x.contiguous(), self.packed, bias)
        return F.linear(x, self.weight_dequant, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight_dequant)

    def dequantize(self) -> torch.Tensor:
        return self.weight_dequant


def quantize_model(model: nn.Module, method: str, packed: bool = False, native: bool = False) -> None:
    """Give every float decoder-layer projection and the lm_head its quantized form, in place (projections already
    in GGUF blocks are left as they are). The embedding table stays in the compute dtype (a step reads only its own
    rows of it)."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r}; supported: {', '.join(QUANTIZATION_METHODS)}")
    if method == "int4" and not native:
        raise ValueError("--quantization int4 runs on the native kernels only (not with --kernels torch)")
    for m in model.modules():
        if isinstance(m, Linear) and m.weight is not None:
            if native:
                m.set_packed(quantize(m.weight, method))
            else:
                m.set_packed(Int8Weight(m.weight, packed))

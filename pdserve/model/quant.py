"""Weight-only quantization of float checkpoints (`--quantization int8|int4`).

With the native kernels (the default where they are built), every projection becomes a `QuantLinear` over GGUF
blocks of 32 weights with their own scale (int8 -> Q8_0, int4 -> Q4_1), read as stored by pdserve/kernels. The rest
of this file is the PyTorch path (`--kernels torch`, int8 only), through PyTorch's own CPU kernel:

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

from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.cpu_linear import PACKED_MAX_ROWS, pack_weight, packed_linear
from pdserve.model.quant_linear import QUANTIZATION_QTYPES, QuantizedWeight, QuantLinear

if TYPE_CHECKING:
    from pdserve.model.llama import DecoderLayer, LlamaForCausalLM

QUANTIZATION_METHODS = ("int8", "int4")
# Steps with at most this many tokens read the int8 weights. Measured crossover on 2 AVX2 cores: 8-16 rows
# against MKL's fp32 GEMM, ~8 rows against oneDNN with pre-packed fp32 weights (cpu_linear.py).
INT8_MAX_ROWS = 12
INT8_MAX_ROWS_VS_PACKED = 6


class Int8Linear(nn.Module):
    """Drop-in for nn.Linear: int8 weight [out, in] + bf16 per-channel scale; optional bias in the compute dtype."""

    def __init__(self, linear: nn.Linear, packed: bool = False) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(torch.bfloat16)
        q = torch.round(w / scale.float().unsqueeze(1)).clamp(-127, 127).to(torch.int8)
        self.out_features, self.in_features = w.shape
        self.register_buffer("weight_int8", q.contiguous())
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.compute_dtype = linear.weight.dtype
        # not a buffer: the live roofline counts the int8 bytes a bandwidth-bound step reads
        self.weight_dequant = (q.float() * scale.float().unsqueeze(1)).to(self.compute_dtype)
        self.packed = pack_weight(self.weight_dequant) if packed else None  # oneDNN copy (cpu_linear.py)
        self.max_int8_rows = INT8_MAX_ROWS_VS_PACKED if packed else INT8_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.max_int8_rows:
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.weight_int8, self.scale)
            y = y.to(x.dtype)
            return y if self.bias is None else y + self.bias
        if self.packed is not None and x.shape[0] <= PACKED_MAX_ROWS:
            return packed_linear(x.contiguous(), self.packed, self.bias)
        return F.linear(x, self.weight_dequant, self.bias)


def quantize_model(model: LlamaForCausalLM, method: str, packed: bool = False,
                   native: bool = False) -> LlamaForCausalLM:
    """Replace every float decoder-layer projection and the lm_head by its quantized form, in place (projections
    already in GGUF blocks are left as they are). The embedding table stays in the compute dtype (a step reads
    only its own rows of it)."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r}; supported: {', '.join(QUANTIZATION_METHODS)}")
    if method == "int4" and not native:
        raise ValueError("--quantization int4 runs on the native kernels only (not with --kernels torch)")

    def convert(linear: nn.Module) -> nn.Module:
        if not isinstance(linear, nn.Linear):
            return linear
        if native:
            weight = QuantizedWeight.quantize(linear.weight, QUANTIZATION_QTYPES[method])
            return QuantLinear(weight, linear.bias)
        return Int8Linear(linear, packed)

    for layer in cast("list[DecoderLayer]", model.layers):
        att, mlp = layer.self_attn, layer.mlp
        att.qkv_proj = convert(att.qkv_proj)  # type: ignore[assignment]
        att.o_proj = convert(att.o_proj)  # type: ignore[assignment]
        mlp.gate_up_proj = convert(mlp.gate_up_proj)  # type: ignore[assignment]
        mlp.down_proj = convert(mlp.down_proj)  # type: ignore[assignment]
    model.lm_head = convert(model.lm_head)  # type: ignore[assignment]
    return model

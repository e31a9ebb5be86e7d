"""Weights that stay in GGUF block format, multiplied by the native kernels.

A `QuantizedWeight` is a weight matrix [N, K] stored as N rows of K/32 blocks (ggml's Q4_0, Q4_1 or Q8_0: 32
weights and an fp16 scale per block, Q4_1 also an fp16 minimum). GGUF files hold them this way; `--quantization
int8|int4` produces them from a float checkpoint (Q8_0 | Q4_1, i.e. per-group scales with groups of 32). Nothing is
dequantized at load: a step's matmuls read the blocks (pdserve/kernels, quant_linear.cpp), so a bandwidth-bound
decode step reads 4.5-8.5 bits per weight instead of 32. It is a PackedMatrix (model/native_ops.py): the Linear and
Embedding modules (model/layers/linear.py) hold it as they would any packed weight.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from pdserve import kernels

# ggml type id -> (name, bytes per block of 32 weights)
QTYPES: dict[int, tuple[str, int]] = {2: ("Q4_0", 18), 3: ("Q4_1", 20), 8: ("Q8_0", 34)}
QTYPE_IDS = {name: qid for qid, (name, _) in QTYPES.items()}
QUANTIZATION_QTYPES = {"int8": QTYPE_IDS["Q8_0"], "int4": QTYPE_IDS["Q4_1"]}  # --quantization -> block type
BLOCK = 32


@dataclass
class QuantizedWeight:
    """A weight [rows, cols] kept as GGUF blocks: `data` uint8 [rows, cols / 32 * block_bytes]."""

    data: torch.Tensor
    qtype: int
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        if self.qtype not in QTYPES:
            raise ValueError(f"unsupported block type {self.qtype}; native: {[n for n, _ in QTYPES.values()]}")
        rows, cols = self.shape
        if cols % BLOCK or tuple(self.data.shape) != (rows, cols // BLOCK * QTYPES[self.qtype][1]):
            raise ValueError(f"{QTYPES[self.qtype][0]} data {tuple(self.data.shape)} does not hold {self.shape}")

    @property
    def type_name(self) -> str:
        return QTYPES[self.qtype][0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] float32 @ W.T (+ bias) -> [M, N] float32."""
        return kernels.require().quant_linear(x, self.data, self.qtype, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows W[ids] as float32 [*ids.shape, K]."""
        return kernels.require().embedding(ids, self.data, self.qtype, self.shape[1])

    def dequantize(self) -> torch.Tensor:
        return kernels.require().dequantize(self.data, self.qtype, self.shape[1])

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stack along the output rows (fusing q/k/v or gate/up); every part must have the same block type."""
        if len({p.qtype for p in parts}) != 1 or len({p.shape[1] for p in parts}) != 1:
            raise ValueError("parts differ in block type or input size")
        # numpy's concatenate is a memcpy per part; torch.cat of uint8 rows runs ~50x slower (seconds per model)
        data = torch.from_numpy(np.concatenate([p.data.numpy() for p in parts]))
        return QuantizedWeight(data, parts[0].qtype, (sum(p.shape[0] for p in parts), parts[0].shape[1]))

    @staticmethod
    def quantize(weight: torch.Tensor, qtype: int) -> QuantizedWeight:
        """Quantize a float weight [N, K] (K % 32 == 0) with ggml's reference rounding."""
        w = weight.detach().float().contiguous()
        return QuantizedWeight(kernels.require().quantize(w, qtype), qtype, (w.shape[0], w.shape[1]))


StateDict = Mapping[str, "torch.Tensor | QuantizedWeight"]  # Hugging Face names -> float tensors or GGUF blocks

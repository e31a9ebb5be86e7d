"""Linear layers and embeddings over a float weight or a packed one.

A module starts with a float `weight` (an nn.Parameter, filled by the loader, cast with the model) and runs
F.linear / F.embedding on it. `set_packed(w)` replaces it by a PackedMatrix (model/native_ops.py: GGUF blocks, the
kernels' PackedWeight, oneDNN's reordered copy, the PyTorch path's int8) whose forward / rows the module then calls:
which format a weight has is the loader's business, never the model's. With the native kernels the call goes through
the model's NativeOps (so the whole-stack program can record it). The implementation is bound when the module is
built and again when its weight or its LoRA hook (model/lora.py, with `--enable-lora` only) is set, never chosen per
call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.native_ops import KernelSelection, PackedMatrix, Weight


class _Matrix(nn.Module):
    """A module over one weight matrix [rows, cols]: float until set_packed."""

    def __init__(self, rows: int, cols: int, kernels: KernelSelection) -> None:
        super().__init__()
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(rows, cols))
        self.packed: PackedMatrix | None = None
        self.kernels = kernels
        self._shape = (rows, cols)
        self._impl: Callable[[torch.Tensor], torch.Tensor] = self._bind()

    def set_packed(self, weight: PackedMatrix) -> None:
        """Hold `weight` instead of the float matrix (dropped here; a tied embedding keeps its own reference)."""
        if tuple(weight.shape) != self._shape:
            raise ValueError(f"packed weight {tuple(weight.shape)} does not fit {type(self).__name__} {self._shape}")
        self.packed, self.weight = weight, None
        self._impl = self._bind()

    @property
    def stored(self) -> Weight:
        """The weight as this module reads it."""
        if self.packed is not None:
            return self.packed
        assert self.weight is not None
        return self.weight

    @property
    def stored_bytes(self) -> int:
        """Bytes one pass over the weight reads (as stored: packed formats count their real size)."""
        if self.packed is not None:
            return self.packed.nbytes
        assert self.weight is not None
        return self.weight.numel() * self.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._impl(x)

    def _bind(self) -> Callable[[torch.Tensor], torch.Tensor]:
        if self.kernels.native is not None:
            return self._native
        return self._packed if self.packed is not None else self._dense

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"{self._shape}, {self.packed.type_name if self.packed is not None else 'float'}"


# a LoRA hook: (the bound base product, x) -> y with the step's adapter deltas added (model/lora.py's LoRALinear)
LoRAHook = Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], torch.Tensor]


class Linear(_Matrix):
    """y = x @ W.T (+ bias), W [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, kernels: KernelSelection) -> None:
        self.lora: LoRAHook | None = None
        super().__init__(out_features, in_features, kernels)
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def set_lora(self, hook: LoRAHook) -> None:
        """Run `hook` around the base product from now on (LoRA adapters: `--enable-lora`)."""
        self.lora = hook
        self._impl = self._bind()

    def _bind(self) -> Callable[[torch.Tensor], torch.Tensor]:
        base = super()._bind()
        hook = self.lora
        if hook is None:
            return base
        return lambda x: hook(base, x)

    @property
    def writes_into(self) -> bool:
        """multiply_into is available: the native kernels' own packed weight, no LoRA hook."""
        native = self.kernels.native
        return self.lora is None and native is not None and native.writes_into(self.stored)

    def multiply_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """This module's product of x written into `out` (float32 [rows, out_features]): the same bits, no new
        tensor. Only where writes_into."""
        self.kernels.ops.linear_into(x, self.stored, self.bias, out)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        assert self.packed is not None
        return self.packed.forward(x, self.bias)

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.ops.linear(x, self.stored, self.bias)


class Embedding(_Matrix):
    """Rows of W [num_embeddings, embedding_dim] by token id, times `scale` where given (Gemma: sqrt(hidden), in
    the activations' dtype as Hugging Face rounds it; W itself stays unscaled, a tied lm_head reads it too)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, kernels: KernelSelection,
                 scale: float | None = None) -> None:
        self.scale = scale
        super().__init__(num_embeddings, embedding_dim, kernels)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    @property
    def row_bytes(self) -> int:
        """Bytes of one row as stored (what a step reads per token)."""
        return self.stored_bytes // self.num_embeddings

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None
        return self._scaled(F.embedding(x, self.weight))

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        assert self.packed is not None
        return self._scaled(self.packed.rows(x))

    def _scaled(self, rows: torch.Tensor) -> torch.Tensor:
        return rows if self.scale is None else rows * torch.tensor(self.scale, dtype=rows.dtype)

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.kernels.ops.embedding(x, self.stored)
        if self.scale is not None:
            self.kernels.ops.scale(rows, self.scale)  # in place: rows is this call's own result
        return rows

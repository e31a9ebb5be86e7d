"""Weights packed once at load for the native kernels (csrc/packed_weight.h: PackedWeight).

GGUF files: the loader hands over every matrix whose type `pack_gguf` takes (Q4_0 ... Q8_0, Q2_K ... Q6_K, IQ4_NL,
IQ4_XS) as a `GGUFMatrix`, a view into the file's memory map, and `pack_matrices` packs the parts of one (fused)
projection into the kernels' panels: no float copy is ever made. After packing, the file pages it read are handed
back to the OS (madvise), so a load holds the packed weights plus the pages of the tensor being packed, not the whole
file twice. Parts of one fused projection stored in different types (Q4_K_M files keep some attn_v in Q6_K beside
Q4_K q/k) are packed each in its own type and stacked (`stack_packed`).

Float weights (Hugging Face checkpoints, F16/BF16/F32 GGUF tensors) become `pack_float(w, "bf16" | "f32")` by the
model's dtype (`pack_float_weights`), and `--quantization int8|int4` makes Q8_0 | Q4_1 blocks of them with gguf's
reference rounding (`quantize`), then packs those: one format and one set of kernels for every quantized weight.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import warnings
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from pdserve import kernels
from pdserve.model.layers.linear import Embedding, Linear

QUANTIZATION_TYPES = {"int8": "Q8_0", "int4": "Q4_1"}  # --quantization -> GGUF block type
FLOAT_FORMATS = {torch.float32: "f32", torch.bfloat16: "bf16"}  # model dtype -> pack_float format
_MADV_DONTNEED = 4
_Array = TypeVar("_Array", np.ndarray, torch.Tensor)


def reverse_permute_qk(w: _Array, n_head: int) -> _Array:
    """Undo llama.cpp's `permute(w, n_head)` on q/k rows (weight [n_head*head_dim, in] or bias [n_head*head_dim]).

    llama.cpp: `w.reshape(n_head, 2, hd // 2, *rest).swapaxes(1, 2).reshape(w.shape)`; this is its inverse. A
    permutation of whole rows, so it applies to rows of GGUF blocks as to floats.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class GGUFMatrix:
    """A 2-D GGUF tensor as stored: `data` uint8 [rows, row_bytes] (a view of the file's memory map), its ggml type
    and Hugging Face shape; `qk_heads` > 0 when llama.cpp permuted its rows (undone when packed or dequantized)."""

    data: np.ndarray
    ggml_type: int
    shape: tuple[int, int]
    qk_heads: int = 0

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.ggml_type).name

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def blocks(self) -> np.ndarray:
        """The blocks in Hugging Face row order: the file's view, or a permuted copy."""
        return reverse_permute_qk(self.data, self.qk_heads) if self.qk_heads else self.data

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols] (gguf.quants.dequantize: the values pack_gguf's kernels multiply by)."""
        from gguf import GGMLQuantizationType, quants

        arr = quants.dequantize(self.blocks(), GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(self.shape)

    def release(self) -> None:
        """Let the OS drop the file pages this tensor was read from (they come back from the page cache if read
        again): after packing, the process keeps only the packed copy."""
        _drop_pages(self.data)


StateDict = Mapping[str, "torch.Tensor | GGUFMatrix"]  # Hugging Face names -> float tensors or GGUF matrices


def _drop_pages(a: np.ndarray) -> None:
    if not sys.platform.startswith("linux") or a.nbytes == 0:
        return
    start = a.ctypes.data
    first = start - start % mmap.PAGESIZE
    end = start + a.nbytes
    _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), _MADV_DONTNEED)  # advice: result ignored


_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _LIBC


def _uint8_tensor(a: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only memory map: the kernels only read it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(a))


def pack_matrices(parts: list[GGUFMatrix]) -> Any:
    """One PackedWeight whose rows are the parts' rows in order. Consecutive parts of one type are packed together
    (one panel stream); runs of different types are stacked. The parts' file pages are released once packed."""
    lib = kernels.require()
    runs: list[list[GGUFMatrix]] = []
    for p in parts:
        if runs and runs[-1][0].ggml_type == p.ggml_type:
            runs[-1].append(p)
        else:
            runs.append([p])
    packed = []
    for run in runs:
        data = run[0].blocks() if len(run) == 1 else np.concatenate([p.blocks() for p in run])
        packed.append(lib.pack_gguf(_uint8_tensor(data), run[0].ggml_type, run[0].shape[1]))
        for p in run:
            p.release()
    return packed[0] if len(packed) == 1 else lib.stack_packed(packed)


def quantize(weight: torch.Tensor, method: str) -> Any:
    """A float weight [N, K] (K % 32 == 0) as the PackedWeight of its `method` blocks (int8: Q8_0, int4: Q4_1),
    quantized with gguf's reference rounding (what llama.cpp's quantizer writes)."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[QUANTIZATION_TYPES[method]]
    w = weight.detach().float().contiguous().numpy()
    if w.shape[1] % 32:
        raise ValueError(f"--quantization {method} needs input sizes that are multiples of 32, got {w.shape}")
    blocks = quants.quantize(w, qtype)
    return kernels.require().pack_gguf(torch.from_numpy(blocks), int(qtype), w.shape[1])


def pack_float_weights(model: nn.Module, dtype: torch.dtype) -> None:
    """Give every Linear/Embedding under `model` that still holds a float weight its `pack_float` form in the
    format of `dtype` (bf16 or f32), in place; a tied lm_head gets the embedding's packed weight, not a copy."""
    if dtype not in FLOAT_FORMATS:
        raise ValueError(f"the native kernels store float weights as float32 or bfloat16, not {dtype}")
    lib = kernels.require()
    packed: dict[int, tuple[torch.Tensor, Any]] = {}  # id(weight) -> (weight kept alive, its packed form)
    for m in model.modules():
        if isinstance(m, (Linear, Embedding)) and m.weight is not None:
            w = m.weight
            if id(w) not in packed:
                packed[id(w)] = (w, lib.pack_float(w.detach(), FLOAT_FORMATS[dtype]))
            m.set_packed(packed[id(w)][1])


def weight_formats(model: nn.Module) -> dict[str, int]:
    """Matrices per stored type (each storage once; stacked parts counted each): {"Q4_K": 150, "Q6_K": 31}."""
    seen: dict[int, str] = {}
    for m in model.modules():
        if isinstance(m, (Linear, Embedding)):
            w = m.stored
            if isinstance(w, torch.Tensor):
                seen.setdefault(id(w), str(w.dtype).removeprefix("torch."))
            else:
                seen.setdefault(id(w), w.type_name)
    return dict(Counter(part for name in seen.values() for part in name.split("+")))


_GGUF_FLOAT_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def stored_types(model: nn.Module) -> dict[str, int]:
    """weight_formats with GGUF's names for float storage too (F32, BF16, F16, whichever path reads it): what
    /v1/models reports as a model's `quantization`."""
    out: Counter[str] = Counter()
    for name, count in weight_formats(model).items():
        out[_GGUF_FLOAT_NAMES.get(name, name)] += count
    return dict(out)


def describe_weights(model: nn.Module) -> str:
    """The start-up log's account of the weights: "Q4_K x 150, Q6_K x 31 (pack_gguf, AVX-512 VNNI int8 ...)"."""
    by_path: dict[str, list[str]] = {}
    for name, count in sorted(weight_formats(model).items(), key=lambda kv: -kv[1]):
        path = "PyTorch" if name in ("float32", "bfloat16", "float16") else kernels.gemm_path(name)
        by_path.setdefault(path, []).append(f"{name} x {count}")
    return "; ".join(f"{', '.join(names)} ({path})" for path, names in by_path.items())

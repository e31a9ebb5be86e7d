"""The KV cache's storage formats (`--kv-cache-dtype`), the PyTorch twin of kernels/csrc/kv_quant.h.

float32 / bfloat16 (/ float16 on the torch path): a (token, KV head) row is head_dim values. int8, float8_e4m3fn,
float8_e5m2: a row is head_dim one-byte codes followed by its scale, a bf16 (little endian), so the cache
tensor's last dimension is head_dim + 2 and its dtype names the format (the bytes of an fp8 cache are not fp8 values
throughout: the last two of a row are the scale). Value = scale * code; scale = bf16(absmax / code_max), codes from
the stored scale, rounded to nearest even and saturated. Bit-exact with the native reshape_and_cache (tested).
"""

from __future__ import annotations

import torch

from pdserve.config import KV_SCALE_BYTES, QUANTIZED_KV_DTYPES

_CODE_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def kv_torch_dtype(storage: str) -> torch.dtype:
    """The cache tensor's dtype for a storage name (config.kv_cache_dtype_name)."""
    return getattr(torch, storage)  # type: ignore[no-any-return]


def is_quantized(dtype: torch.dtype) -> bool:
    return str(dtype).removeprefix("torch.") in QUANTIZED_KV_DTYPES


def kv_row_elements(dtype: torch.dtype, head_dim: int) -> int:
    """The cache tensor's last dimension: head_dim, or head_dim codes + the scale's bytes."""
    return head_dim + KV_SCALE_BYTES if is_quantized(dtype) else head_dim


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., d] float -> uint8 [..., d + 2]: the rows as the cache stores them in `dtype` (a quantized one)."""
    name = str(dtype).removeprefix("torch.")
    x = x.float()
    scale = (x.abs().amax(-1, keepdim=True) / _CODE_MAX[name]).to(torch.bfloat16)
    s = scale.float()
    y = torch.where(s > 0, x / torch.where(s > 0, s, 1.0), 0.0).clamp(-_CODE_MAX[name], _CODE_MAX[name])
    codes = y.round().to(torch.int8).view(torch.uint8) if name == "int8" else y.to(dtype).view(torch.uint8)
    return torch.cat([codes, scale.view(torch.uint8)], dim=-1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., d + 2] rows of a cache in `dtype` -> [..., d] in out_dtype (scale * code, computed in float32)."""
    codes, scale = rows[..., :-KV_SCALE_BYTES], rows[..., -KV_SCALE_BYTES:].contiguous().view(torch.bfloat16)
    values = codes.view(torch.int8) if dtype == torch.int8 else codes.contiguous().view(dtype)
    return (values.float() * scale.float()).to(out_dtype)


def kv_bytes(layer_cache: torch.Tensor) -> torch.Tensor:
    """A byte view of a quantized cache (index_copy_ and friends do not take fp8 on cpu); other caches as they
    are."""
    return layer_cache.view(torch.uint8) if is_quantized(layer_cache.dtype) else layer_cache

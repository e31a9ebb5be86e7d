"""pdserve's native CPU kernels (C++, `csrc/`), loaded once per process.

`load()` returns the extension module or None when it is not built (or built from other sources); `require()`
raises instead. `isa()` names the instruction-set level the kernels run (amx | avx512_bf16 | avx512 | avx2 | generic,
csrc/common.h), chosen at run time from the CPU; `PDSERVE_KERNEL_ISA` lowers it (tests run every level the machine
has).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from types import ModuleType
from typing import Any

import torch

from pdserve.kernels.build import MODULE, built_library

log = logging.getLogger("pdserve.kernels")

KERNEL_CHOICES = ("auto", "native", "torch")
ISA_ENV = "PDSERVE_KERNEL_ISA"
REQUIRED_OPS = ("pack_gguf", "pack_float", "stack_packed", "paged_attention", "reshape_and_cache", "rms_norm",
                "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "NativeProgram")
NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # how the native path stores float weights and the KV cache


class KernelsUnavailable(RuntimeError):
    """The native kernels were required but are not built for the current sources."""


_module: ModuleType | None = None
_tried = False


def load() -> ModuleType | None:
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    lib = built_library()  # torch is imported above: libtorch and its OpenMP runtime, shared by the extension
    if lib is None:
        log.warning("native kernels are not built for these sources; run `make install` "
                    "(or `python -m pdserve.kernels`). Using the PyTorch path.")
        return None
    spec = importlib.util.spec_from_file_location(MODULE, lib)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    missing = [op for op in REQUIRED_OPS if not hasattr(mod, op)]
    if missing:
        log.warning("the native kernel library lacks %s; using the PyTorch path", ", ".join(missing))
        return None
    forced = os.environ.get(ISA_ENV)
    if forced:
        mod.set_active_isa(forced)
    _module = mod
    return mod


def require() -> Any:
    mod = load()
    if mod is None:
        raise KernelsUnavailable("native kernels are not built for these sources: run `make install` "
                                 "(or `python -m pdserve.kernels`)")
    return mod


def available() -> bool:
    return load() is not None


def isa() -> str:
    """The ISA path the native kernels run now, or "none" when they are not built."""
    mod = load()
    return mod.active_isa() if mod is not None else "none"


def resolve_kernels(kernels: str, dtype: torch.dtype, device: str = "cpu") -> str:
    """"native" or "torch" for `--kernels auto|native|torch`: auto takes the native kernels wherever they are built
    on the CPU, for float32 and bfloat16 (the dtype says how float weights and the KV cache are stored; activations
    are float32 inside); float16 keeps the PyTorch path. The native kernels are CPU code: on cuda auto is torch and
    native an error."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
    if device != "cpu":
        if kernels == "native":
            raise ValueError(f"--kernels native runs on the CPU only; with --device {device} use auto or torch")
        return "torch"
    if kernels == "torch":
        return "torch"
    if kernels == "native":
        require()
        if dtype not in NATIVE_DTYPES:
            raise ValueError(f"--kernels native stores weights and KV as float32 or bfloat16; got dtype {dtype}")
        return "native"
    return "native" if dtype in NATIVE_DTYPES and available() else "torch"


def kernels_isa(kernels: str) -> tuple[str, str]:
    """(ISA path the model's kernels run, widest ISA of this CPU): ("avx512", "avx512"), or ("none", ...) on torch."""
    mod = load()
    cpu = mod.cpu_isa() if mod is not None else "unknown"
    return (isa() if kernels == "native" else "none"), cpu


def kernels_description(kernels: str) -> str:
    """What ran, for the start-up log and /metrics: "native (avx512)" or "torch"."""
    return f"native ({isa()})" if kernels == "native" else "torch"


# The instructions each packed format's GEMMs use at each ISA level (csrc/qgemm*.cpp, csrc/fgemm*.cpp).
_GEMM_PATHS = {
    "gguf": {"generic": "int8, portable C++", "avx2": "AVX2 int8 (vpmaddubsw)", "avx512": "AVX-512 VNNI int8",
             "avx512_bf16": "AVX-512 VNNI int8", "amx": "AMX-INT8 tiles + AVX-512 VNNI int8"},
    "bf16": {"generic": "portable C++", "avx2": "AVX2 FMA on bf16 widened to fp32",
             "avx512": "AVX-512 FMA on bf16 widened to fp32", "avx512_bf16": "AVX512-BF16 vdpbf16ps",
             "amx": "AMX-BF16 tiles"},
    "f32": {"generic": "portable C++", "avx2": "AVX2 FMA", "avx512": "AVX-512 FMA", "avx512_bf16": "AVX-512 FMA",
            "amx": "AVX-512 FMA"},
}


def gemm_path(type_name: str) -> str:
    """How the native kernels multiply a weight stored as `type_name` (Q4_K, BF16, F32, ...) on this CPU: the
    packing and the instructions, e.g. "pack_gguf, AMX-INT8 tiles + AVX-512 VNNI int8"."""
    level = isa()
    if type_name in ("BF16", "F32"):
        return f"pack_float {type_name.lower()}, {_GEMM_PATHS[type_name.lower()].get(level, level)}"
    return f"pack_gguf, {_GEMM_PATHS['gguf'].get(level, level)} (activations int8 per 32)"


_ATTENTION_KERNELS = {"amx": "AMX-BF16 tiles", "avx512_bf16": "AVX512-BF16 vdpbf16ps",
                      "avx512_bf16_rows": "AVX512-BF16 vdpbf16ps on rows as stored",
                      "avx512_tiles": "AVX-512 FMA in transposed key tiles"}


def attention_path(kv_storage: str, group: int, head_dim: int, softcap: bool = False) -> tuple[str, str]:
    """(prompt rows' kernel, generated rows' kernel) of the native paged attention on this CPU, as
    csrc/attention.cpp picks them (`attention_kernels`), for the start-up log: `group` query heads per KV head,
    `kv_storage` the cache's dtype name."""
    mod = load()
    if mod is None:
        return "none", "none"
    bf16 = kv_storage == "bfloat16"
    threshold = int(mod.effective_attention_bf16_min_group())

    def describe(level: str) -> str:
        if level in _ATTENTION_KERNELS:
            return _ATTENTION_KERNELS[level]
        why = ("soft-capped scores" if softcap else f"{kv_storage} cache" if not bf16
               else f"head_dim {head_dim}" if head_dim not in (64, 128)
               else f"{group} query heads per KV head, below {threshold}" if isa() in _ATTENTION_KERNELS
               else "no bf16 dot products at this level")
        return f"fp32 dot products ({level}): {why}"

    prompt, generated = mod.attention_kernels(head_dim, kv_storage, group, softcap)
    return describe(prompt), describe(generated)

"""`pdserve calc`: roofline (FLOPs, bytes, arithmetic intensity, floor times) and KV budget of a model on a device.

Accounting (the seed's, so its 7B example reproduces exactly; see DESIGN.md section 1):
  * FLOPs per token = 2 x params (every weight is one multiply-add). Prefill of N tokens: 2·P·N. Decode step at batch
    B: 2·P·B. Attention score/value work (QK^T and PV) is not in this rule; it is computed and printed separately.
  * Bytes moved = every weight read once per forward pass + KV read + KV written. Activations are ignored.
    Prefill of N tokens: weights + N tokens of KV written. Decode step at batch B, context L (tokens already cached per
    sequence): weights + B·L tokens of KV read + B tokens of KV written.
  * Intensity = FLOPs / bytes; balance = peak FLOP/s / bandwidth. Intensity above balance -> compute-bound.
  * Floors: compute floor = FLOPs / peak, bandwidth floor = bytes / bandwidth; no pass is faster than the larger one.
  * KV budget = memory x (1 - reserve) - weights; reserve stands for activations, allocator slack and the runtime
    (vLLM's gpu_memory_utilization=0.9 is reserve 0.1).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pdserve.config import ModelArchConfig

# --------------------------------------------------------------------------------------------------------------------
# Devices
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceSpec:
    """Peak dense FLOP/s (bf16 for GPU presets), memory bandwidth in B/s and memory capacity in bytes."""

    name: str
    peak_flops: float
    mem_bandwidth: float
    memory: float
    flops_by_dtype: tuple[tuple[str, float], ...] = ()  # measured devices: peak per dtype tried

    @property
    def balance(self) -> float:
        """FLOP per byte at which compute time equals memory time."""
        return self.peak_flops / self.mem_bandwidth


# Vendor datasheet numbers: bf16 tensor-core peak *dense* (no 2:4 sparsity), HBM/GDDR bandwidth, capacity in decimal
# GB as published (nvidia-smi shows a few % less usable).
DEVICE_PRESETS: dict[str, DeviceSpec] = {
    "a100": DeviceSpec("A100 80GB SXM", 312e12, 2.039e12, 80e9),
    "h100": DeviceSpec("H100 SXM", 989e12, 3.35e12, 80e9),
    "h200": DeviceSpec("H200 SXM", 989e12, 4.8e12, 141e9),
    "l40s": DeviceSpec("L40S", 362e12, 864e9, 48e9),
    "rtx4090": DeviceSpec("RTX 4090", 165.2e12, 1.008e12, 24e9),  # bf16 with fp32 accumulate (Ada whitepaper)
}
_DEVICE_ALIASES = {"a10080gb": "a100", "a100sxm": "a100", "h100sxm": "h100", "h200sxm": "h200", "4090": "rtx4090",
                   "geforcertx4090": "rtx4090"}


def _norm_name(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


def device_preset(name: str) -> DeviceSpec:
    """A preset by name, case- and punctuation-insensitive ("H100", "rtx-4090", "RTX 4090")."""
    key = _norm_name(name)
    key = _DEVICE_ALIASES.get(key, key)
    if key not in DEVICE_PRESETS:
        raise ValueError(f"unknown device {name!r}; presets: {', '.join(d.name for d in DEVICE_PRESETS.values())} "
                         "(or --measure this machine)")
    return DEVICE_PRESETS[key]


def _best_time(fn: Callable[[], Any], repeats: int, budget_s: float) -> float:
    """Fastest of up to `repeats` timed calls after one warm-up call; stops early once `budget_s` is spent."""
    fn()
    best, start = math.inf, time.perf_counter()
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return best


def measure_matmul_flops(dtype: torch.dtype, max_size: int = 2048, repeats: int = 3, min_call_s: float = 0.1,
                         budget_s: float = 1.0) -> float:
    """Best torch.mm FLOP/s (2·n^3 per n x n product) in `dtype` with the current torch thread count. The size doubles
    from 128 until one product takes `min_call_s` or reaches `max_size`, so an emulated dtype (bf16 without AVX-512
    BF16: ~1 GFLOP/s) stays small and quick while a fast one gets a size large enough to approach its peak."""
    n = min(128, max_size)
    while True:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        c = torch.empty(n, n, dtype=dtype)
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        if n * 2 > max_size or time.perf_counter() - t0 >= min_call_s:
            break
        n *= 2
    return 2 * n**3 / _best_time(lambda: torch.mm(a, b, out=c), repeats, budget_s)


def measure_copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5, budget_s: float = 1.0) -> float:
    """Best `dst.copy_(src)` B/s, counting read + write (2 x nbytes, the STREAM "copy" convention; write-allocate
    traffic is not counted). `nbytes` should be well above the last-level cache."""
    src = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best_time(lambda: dst.copy_(src), repeats, budget_s)


def _meminfo_total() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


def measure_device(threads: int | None = None, dtype: torch.dtype | None = None, *, matmul_size: int = 2048,
                   copy_bytes: int = 256 * 2**20, repeats: int = 3, budget_s: float = 1.0) -> DeviceSpec:
    """This machine as a DeviceSpec: peak = best torch.mm FLOP/s in `dtype` (None: float32 and bfloat16, the faster
    wins; both kept in `flops_by_dtype`), bandwidth = best large tensor copy, memory = MemTotal. `threads` (default:
    every core this process may use) is set for the measurement and restored after. A few seconds at default sizes."""
    threads = threads or len(os.sched_getaffinity(0))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dtypes = [dtype] if dtype is not None else [torch.float32, torch.bfloat16]
        by_dtype = tuple((str(d).removeprefix("torch."), measure_matmul_flops(d, matmul_size, repeats,
                                                                              budget_s=budget_s)) for d in dtypes)
        bandwidth = measure_copy_bandwidth(copy_bytes, repeats + 2, budget_s)
    finally:
        torch.set_num_threads(previous)
    return DeviceSpec(f"this machine ({_cpu_name()}, {threads} threads)", max(f for _, f in by_dtype), bandwidth,
                      float(_meminfo_total()), by_dtype)


# --------------------------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelPreset:
    arch: ModelArchConfig
    params: int | None = None  # pins the parameter count (the seed's round 7e9); None: count_params(arch)


def _llama(**kw: Any) -> ModelArchConfig:
    return ModelArchConfig(architecture=kw.pop("architecture", "LlamaForCausalLM"), **kw)


MODEL_PRESETS: dict[str, ModelPreset] = {
    # The seed's 7B example: 7e9 params, 32 layers, 8 KV heads x 128 -> 128 KiB of fp16 KV per token. These dims
    # count 5.93e9 params (Llama-2-7B's MLP with GQA), so the seed's 7e9 is pinned to reproduce its numbers.
    "seed-7b": ModelPreset(_llama(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                  head_dim=128, intermediate_size=11008, vocab_size=32000), params=7_000_000_000),
    "llama-2-7b": ModelPreset(_llama(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                     num_key_value_heads=32, head_dim=128, intermediate_size=11008, vocab_size=32000)),
    "mistral-7b": ModelPreset(_llama(architecture="MistralForCausalLM", hidden_size=4096, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                     intermediate_size=14336, vocab_size=32000, max_position_embeddings=32768)),
    "llama-3-8b": ModelPreset(_llama(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                     num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
                                     rope_theta=500000.0, max_position_embeddings=8192)),
}
_MODEL_ALIASES = {"llama-7b-gqa": "seed-7b", "llama2-7b": "llama-2-7b", "llama3-8b": "llama-3-8b"}


def _model_preset(model: str | None) -> ModelPreset | None:
    if model is None:
        return None
    key = model.strip().lower()
    return MODEL_PRESETS.get(_MODEL_ALIASES.get(key, key))


def model_shape_from(model: str | None) -> ModelArchConfig:
    """Architecture of `model`: a preset name (see MODEL_PRESETS), None / "smollm2-135m" (the default GGUF), a
    config.json file, a Hugging Face directory (only its config.json is read) or a .gguf file (header only)."""
    from pdserve.model.loader import GGUF_ARCHS, GGUFFile, gguf_hf_config, resolve_model_path

    preset = _model_preset(model)
    if preset is not None:
        return preset.arch
    if model is not None:
        path = os.path.abspath(os.path.expanduser(model))
        config_json = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if os.path.isfile(config_json) and config_json.endswith(".json"):
            with open(config_json, encoding="utf-8") as f:
                return ModelArchConfig.from_hf_config(json.load(f))
    path = resolve_model_path(model)  # the default GGUF, a .gguf file or a directory holding one
    meta = GGUFFile(path)  # gguf.GGUFReader: header parsing only, tensor bytes stay on disk
    if meta.arch not in GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {meta.arch!r} in {path}; supported: {sorted(GGUF_ARCHS)}")
    return ModelArchConfig.from_hf_config(gguf_hf_config(meta, None))  # rope scaling is irrelevant here


def count_params(arch: ModelArchConfig) -> int:
    """Parameters of a Llama-family decoder: embeddings, per layer q/k/v/o (+ q/k/v biases for Qwen2, q/k norms for
    Qwen3), gate/up/down MLP and two RMSNorms, the final norm, and lm_head unless tied to the embeddings."""
    h, hd = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * hd, arch.num_key_value_heads * hd
    attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if arch.attention_bias else 0) + (2 * hd if arch.qk_norm else 0)
    layer = attn + 3 * h * arch.intermediate_size + 2 * h
    embeddings = arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2)
    return embeddings + arch.num_hidden_layers * layer + h


def model_params(model: str | None, arch: ModelArchConfig, override: float | None = None) -> int:
    """`override`, else the preset's pinned count, else count_params(arch)."""
    if override is not None:
        return int(override)
    preset = _model_preset(model)
    return preset.params if preset is not None and preset.params is not None else count_params(arch)


_DTYPE_BYTES = {"float32": 4, "fp32": 4, "float": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
                "fp8": 1, "float8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name (float32/bf16/fp16, or fp8/int8 for a quantized KV cache)."""
    key = name.strip().lower().removeprefix("torch.")
    if key not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[key]


def kv_bytes_per_token(arch: ModelArchConfig, kv_dtype_bytes: int) -> int:
    """2 (K and V) x layers x KV heads x head_dim x bytes per element."""
    return 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * kv_dtype_bytes


# --------------------------------------------------------------------------------------------------------------------
# Costs
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cost:
    """One forward pass. `flops` follows the seed's 2·P-per-token rule; `attn_flops` is the QK^T + PV work that rule
    leaves out. `bytes` = weight_bytes + kv_read_bytes + kv_write_bytes (activations ignored)."""

    flops: float
    bytes: float
    attn_flops: float = 0.0
    weight_bytes: float = 0.0
    kv_read_bytes: float = 0.0
    kv_write_bytes: float = 0.0
    tokens: int = 0  # tokens this pass processes: N for a prefill, B for a decode step

    @property
    def intensity(self) -> float:
        """FLOP per byte on the seed's rule (the headline number)."""
        return self.flops / self.bytes

    @property
    def intensity_with_attention(self) -> float:
        return (self.flops + self.attn_flops) / self.bytes

    def compute_floor_s(self, device: DeviceSpec, with_attention: bool = False) -> float:
        return (self.flops + (self.attn_flops if with_attention else 0.0)) / device.peak_flops

    def bandwidth_floor_s(self, device: DeviceSpec) -> float:
        return self.bytes / device.mem_bandwidth

    def floor_s(self, device: DeviceSpec, with_attention: bool = False) -> float:
        """No pass is faster than this: the larger of the compute and the bandwidth floor."""
        return max(self.compute_floor_s(device, with_attention), self.bandwidth_floor_s(device))

    def bound(self, device: DeviceSpec, with_attention: bool = False) -> str:
        """"compute" when the compute floor is the larger one (intensity above the balance point), else "bandwidth"."""
        return "compute" if self.compute_floor_s(device, with_attention) > self.bandwidth_floor_s(device) \
            else "bandwidth"


def prefill_cost(arch: ModelArchConfig, n_tokens: int, weight_bytes: float, kv_dtype_bytes: int,
                 params: int | None = None) -> Cost:
    """Prefill of an `n_tokens` prompt from an empty cache: 2·P·N FLOPs; weights read once + N tokens of KV written.
    Causal attention: query i meets i+1 keys, 4·head_dim FLOPs per (query, key, head), so 2·N·(N+1)·layers·heads·d."""
    p = count_params(arch) if params is None else params
    kv_write = n_tokens * kv_bytes_per_token(arch, kv_dtype_bytes)
    attn = 2 * n_tokens * (n_tokens + 1) * arch.num_hidden_layers * arch.num_attention_heads * arch.head_dim
    return Cost(2 * p * n_tokens, weight_bytes + kv_write, attn, weight_bytes, 0, kv_write, n_tokens)


def decode_cost(arch: ModelArchConfig, batch: int, context: int, weight_bytes: float, kv_dtype_bytes: int,
                params: int | None = None) -> Cost:
    """One decode step of `batch` sequences with `context` tokens cached each: 2·P·B FLOPs; weights read once +
    B·L tokens of KV read + B tokens written. Attention: each new token meets L+1 keys, 4·B·(L+1)·layers·heads·d."""
    p = count_params(arch) if params is None else params
    per_token = kv_bytes_per_token(arch, kv_dtype_bytes)
    kv_read, kv_write = batch * context * per_token, batch * per_token
    attn = 4 * batch * (context + 1) * arch.num_hidden_layers * arch.num_attention_heads * arch.head_dim
    return Cost(2 * p * batch, weight_bytes + kv_read + kv_write, attn, weight_bytes, kv_read, kv_write, batch)


def kv_capacity(arch: ModelArchConfig, device_memory: float, weight_bytes: float, kv_dtype_bytes: int, context: int,
                reserve_fraction: float = 0.1) -> tuple[int, int]:
    """(most KV tokens, most sequences of `context` tokens) in device_memory·(1 - reserve) - weights; (0, 0) when the
    weights alone do not fit. Block rounding of a paged cache is ignored (exact when context % block_size == 0)."""
    free = device_memory * (1 - reserve_fraction) - weight_bytes
    tokens = max(0, math.floor(free / kv_bytes_per_token(arch, kv_dtype_bytes)))
    return tokens, tokens // max(1, context)


def decode_compute_bound_batch(arch: ModelArchConfig, context: int, weight_bytes: float, kv_dtype_bytes: int,
                               device: DeviceSpec, params: int | None = None) -> float | None:
    """Smallest batch at which a decode step at `context` turns compute-bound on the seed's rule, or None when it never
    does: 2·P·B / (W + B·(L+1)·kv) = balance  ->  B = balance·W / (2·P - balance·(L+1)·kv)."""
    p = count_params(arch) if params is None else params
    denom = 2 * p - device.balance * (context + 1) * kv_bytes_per_token(arch, kv_dtype_bytes)
    return device.balance * weight_bytes / denom if denom > 0 else None


# --------------------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CalcResult:
    model: str
    arch: ModelArchConfig
    params: int
    counted_params: int
    dtype: str
    weight_bits: float
    weight_bytes: float
    kv_dtype: str
    kv_bytes_per_token: int
    device: DeviceSpec
    context: int
    reserve_fraction: float
    phases: tuple[tuple[str, Cost], ...]
    max_kv_tokens: int
    max_seqs: int
    compute_bound_batch: float | None


def calc(model: str | None, device: DeviceSpec, prompt_len: int = 4096, batches: Sequence[int] = (1,),
         context: int = 4096, dtype: str = "bf16", kv_dtype: str | None = None, weight_bits: float | None = None,
         params: float | None = None, reserve_fraction: float = 0.1) -> CalcResult:
    """Everything `pdserve calc` prints, for a prefill of `prompt_len` tokens and a decode step per batch size."""
    if prompt_len < 1 or context < 0 or any(b < 1 for b in batches) or not 0 <= reserve_fraction < 1:
        raise ValueError("need --prompt-len >= 1, --context >= 0, every --batch >= 1 and 0 <= --reserve < 1")
    arch = model_shape_from(model)
    p = model_params(model, arch, params)
    bits = weight_bits if weight_bits is not None else 8.0 * dtype_bytes(dtype)
    weight_bytes = p * bits / 8
    kv_dtype = kv_dtype or dtype
    kvb = dtype_bytes(kv_dtype)
    phases = [(f"prefill N={prompt_len}", prefill_cost(arch, prompt_len, weight_bytes, kvb, p))]
    phases += [(f"decode B={b} L={context}", decode_cost(arch, b, context, weight_bytes, kvb, p)) for b in batches]
    tokens, seqs = kv_capacity(arch, device.memory, weight_bytes, kvb, context, reserve_fraction)
    return CalcResult(model or "smollm2-135m", arch, p, count_params(arch), dtype, bits, weight_bytes, kv_dtype,
                      kv_bytes_per_token(arch, kvb), device, context, reserve_fraction, tuple(phases), tokens, seqs,
                      decode_compute_bound_batch(arch, context, weight_bytes, kvb, device, p))


def _si(x: float, unit: str) -> str:
    """4 significant digits with an SI prefix: 57.34 TFLOP, 14.54 GB, 0.9631 FLOP/B."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.4g} {prefix}{unit}"
    return f"{x:.4g} {unit}"


def _count(n: float) -> str:
    return f"{n / 1e9:.4g} B" if n >= 1e9 else f"{n / 1e6:.4g} M"


def _ms(s: float) -> str:
    return f"{s * 1e6:.4g} us" if s < 1e-3 else f"{s * 1e3:.4g} ms" if s < 1 else f"{s:.4g} s"


def _versus(intensity: float, balance: float) -> str:
    r = intensity / balance
    return "≫" if r >= 10 else ">" if r > 1 else "≪" if r <= 0.1 else "<"


def format_report(r: CalcResult) -> str:
    a, d = r.arch, r.device
    tied = "tied" if a.tie_word_embeddings else "untied"
    lines = [
        f"model    {r.model}: {a.architecture}, {a.num_hidden_layers} layers, hidden {a.hidden_size}, "
        f"{a.num_attention_heads} heads ({a.num_key_value_heads} KV) x {a.head_dim}, MLP {a.intermediate_size}, "
        f"vocab {a.vocab_size} ({tied} embeddings)",
        f"params   {_count(r.params)}" + ("" if r.params == r.counted_params else
                                           f" (pinned; the shape itself counts {_count(r.counted_params)})"),
        f"weights  {_si(r.weight_bytes, 'B')} ({r.weight_bits:g} bits/param, "
        + (f"{r.dtype})" if r.weight_bits == 8 * dtype_bytes(r.dtype) else "quantized)"),
        f"KV cache {r.kv_bytes_per_token / 1024:.4g} KiB/token ({r.kv_bytes_per_token:,} B, {r.kv_dtype}) = 2 (K, V) x "
        f"{a.num_hidden_layers} layers x {a.num_key_value_heads} KV heads x {a.head_dim} dims x "
        f"{dtype_bytes(r.kv_dtype)} B",
        f"device   {d.name}: {_si(d.peak_flops, 'FLOP/s')} peak"
        + (" (" + ", ".join(f"{k} {_si(v, 'FLOP/s')}" for k, v in d.flops_by_dtype) + ")" if d.flops_by_dtype else "")
        + f", {_si(d.mem_bandwidth, 'B/s')}, {_si(d.memory, 'B')} -> balance {d.balance:.4g} FLOP/B",
        "",
    ]
    rows: list[tuple[str, Callable[[Cost], str]]] = [
        ("FLOPs (2·P per token)", lambda c: _si(c.flops, "FLOP")),
        ("weights read", lambda c: _si(c.weight_bytes, "B")),
        ("KV read", lambda c: _si(c.kv_read_bytes, "B")),
        ("KV written", lambda c: _si(c.kv_write_bytes, "B")),
        ("bytes moved", lambda c: _si(c.bytes, "B")),
        ("intensity (FLOP/B)", lambda c: f"{c.intensity:.4g}"),
        ("compute floor", lambda c: _ms(c.compute_floor_s(d))),
        ("bandwidth floor", lambda c: _ms(c.bandwidth_floor_s(d))),
        ("floor", lambda c: f"{_ms(c.floor_s(d))} ({c.bound(d)})"),
        ("tokens/s at floor", lambda c: f"{c.tokens / c.floor_s(d):,.0f}"),
        ("attention FLOPs *", lambda c: _si(c.attn_flops, "FLOP")),
        ("intensity incl. attention *", lambda c: f"{c.intensity_with_attention:.4g}"),
        ("floor incl. attention *", lambda c: f"{_ms(c.floor_s(d, True))} ({c.bound(d, True)})"),
    ]
    table = [["", *(name for name, _ in r.phases)]] + [[label, *(f(c) for _, c in r.phases)] for label, f in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines += ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
              .rstrip() for row in table]
    lines += ["* attention FLOPs (QK^T and PV; causal for prefill) are not in the seed's 2·P rule; the headline "
              "intensity, floors and verdicts use that rule.", ""]
    free = d.memory * (1 - r.reserve_fraction) - r.weight_bytes
    if free <= 0:
        lines.append(f"KV budget: weights {_si(r.weight_bytes, 'B')} exceed {(1 - r.reserve_fraction):.0%} of "
                     f"{_si(d.memory, 'B')}: no room for KV")
    else:
        lines.append(f"KV budget: {_si(d.memory, 'B')} x {1 - r.reserve_fraction:.2f} - {_si(r.weight_bytes, 'B')} "
                     f"weights = {_si(free, 'B')} -> {r.max_kv_tokens:,} tokens = {r.max_seqs:,} sequences of "
                     f"{r.context:,} tokens")
    for name, c in r.phases:
        bound = c.bound(d)
        kv_needed = c.kv_read_bytes + c.kv_write_bytes
        fits = "" if kv_needed <= max(free, 0) else f"; does not fit: needs {_si(kv_needed, 'B')} of KV"
        per = "/step" if name.startswith("decode") else ""
        lines.append(f"{name}: {bound}-bound (intensity {c.intensity:.4g} {_versus(c.intensity, d.balance)} balance "
                     f"{d.balance:.4g}); at best {_ms(c.floor_s(d))}{per}, {c.tokens / c.floor_s(d):,.0f} tokens/s"
                     f"{fits}")
    if r.compute_bound_batch is None:
        seq_flops, seq_bytes = 2 * r.params, (r.context + 1) * r.kv_bytes_per_token
        lines.append(f"decode at context {r.context:,} stays bandwidth-bound at any batch: each sequence adds "
                     f"{_si(seq_flops, 'FLOP')} per {_si(seq_bytes, 'B')} of KV ({seq_flops / seq_bytes:.4g} FLOP/B "
                     f"< balance {d.balance:.4g})")
    else:
        lines.append(f"decode at context {r.context:,} turns compute-bound from batch "
                     f"{math.ceil(r.compute_bound_batch):,} (fits: {r.max_seqs:,} sequences)")
    if d.flops_by_dtype and r.dtype in ("bf16", "bfloat16"):
        by = dict(d.flops_by_dtype)
        if by.get("bfloat16", math.inf) < by.get("float32", 0.0):
            lines.append("note: this CPU emulates bf16 matmuls (slower than float32); pdserve runs float32 here "
                         "(--dtype auto), so --dtype fp32 models what it does")
    return "\n".join(lines)


def result_json(r: CalcResult) -> dict[str, Any]:
    d = r.device
    return {
        "model": r.model, "arch": asdict(r.arch), "params": r.params, "counted_params": r.counted_params,
        "dtype": r.dtype, "weight_bits": r.weight_bits, "weight_bytes": r.weight_bytes, "kv_dtype": r.kv_dtype,
        "kv_bytes_per_token": r.kv_bytes_per_token,
        "device": {**asdict(d), "flops_by_dtype": dict(d.flops_by_dtype), "balance": d.balance},
        "phases": [{"phase": name, **asdict(c), "intensity": c.intensity,
                    "intensity_with_attention": c.intensity_with_attention,
                    "compute_floor_s": c.compute_floor_s(d), "bandwidth_floor_s": c.bandwidth_floor_s(d),
                    "floor_s": c.floor_s(d), "bound": c.bound(d), "floor_with_attention_s": c.floor_s(d, True)}
                   for name, c in r.phases],
        "kv_capacity": {"context": r.context, "reserve_fraction": r.reserve_fraction, "max_tokens": r.max_kv_tokens,
                        "max_seqs": r.max_seqs},
        "decode_compute_bound_batch": r.compute_bound_batch,
    }


# --------------------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------------------


def add_calc_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Register `calc` on a subparsers object (from ArgumentParser.add_subparsers())."""
    p = subparsers.add_parser(
        "calc", help="roofline and KV budget of a model on a device",
        description="FLOPs, bytes, arithmetic intensity and floor times of a prefill and of decode steps, KV bytes "
                    "per token and the KV budget left after the weights (the seed's 2·P-per-token accounting).")
    p.add_argument("--model", default=None, help="smollm2-135m (default), a preset (" + ", ".join(MODEL_PRESETS)
                   + "), a config.json, a Hugging Face directory or a .gguf file")
    dev = p.add_mutually_exclusive_group()
    dev.add_argument("--device", default="H100", help="preset: " + ", ".join(d.name for d in DEVICE_PRESETS.values())
                     + " (case-insensitive; default H100)")
    dev.add_argument("--measure", action="store_true", help="benchmark this machine (matmul and copy, seconds)")
    p.add_argument("--threads", type=int, default=None, help="torch threads for --measure (default: all cores)")
    p.add_argument("--prompt-len", type=int, default=4096, help="prefill tokens N")
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="decode batch sizes B (several allowed)")
    p.add_argument("--context", type=int, default=4096, help="tokens already cached per decoding sequence L")
    p.add_argument("--dtype", default="bf16", help="weight dtype: bf16 | fp16 | fp32")
    p.add_argument("--kv-dtype", default=None, help="KV cache dtype (default: --dtype; fp8/int8 allowed)")
    p.add_argument("--weight-bits", type=float, default=None, help="bits per weight for quantized weights (4, 8)")
    p.add_argument("--params", type=float, default=None, help="override the parameter count (e.g. 7e9)")
    p.add_argument("--reserve", type=float, default=0.1, help="fraction of memory kept from weights and KV")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=run_calc)
    return p


def run_calc(args: argparse.Namespace) -> int:
    if args.measure:
        threads = args.threads or len(os.sched_getaffinity(0))
        device = measure_device(threads)
        path = save_measured_device(device, threads)  # the engine's live roofline (--device-peaks auto) uses it
        if not args.json:
            print(f"# measured peaks saved to {path}")
    else:
        device = device_preset(args.device)
    result = calc(args.model, device, args.prompt_len, args.batch, args.context, args.dtype, args.kv_dtype,
                  args.weight_bits, args.params, args.reserve)
    print(json.dumps(result_json(result), indent=2) if args.json else format_report(result))
    return 0


# --------------------------------------------------------------------------------------------------------------------
# Live roofline: what each engine step had to compute and move, against this machine's peaks
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepCostModel:
    """FLOPs and bytes one engine step needs, from the model shape: the work the step asks for, not what the kernels
    happen to do (a gather copy or padding is inefficiency, not work). Per step of T tokens over sequences that had
    `c` tokens cached and compute `n` new ones:

      * FLOPs = 2 · (decoder-layer weights) · T + 2 · (lm_head weights) · S (S = rows sampled; pdserve computes logits
        only for those) + 4 · layers · heads · head_dim · Σ keys each query meets (causal: n·c + n(n+1)/2).
      * Bytes = every decoder-layer weight once + lm_head once if anything is sampled + T embedding rows
        + Σ c tokens of KV read + T tokens of KV written. Activations are ignored (as in `calc`).
    """

    layer_params: int  # matmul weights of all decoder layers
    lm_head_params: int
    layer_weight_bytes: int
    lm_head_bytes: int
    embed_row_bytes: int
    kv_bytes_per_token: int
    attn_flops_per_pair: int  # 4 · layers · heads · head_dim

    @classmethod
    def for_model(cls, arch: ModelArchConfig, layer_params: int, layer_weight_bytes: int, lm_head_params: int,
                  lm_head_bytes: int, embed_row_bytes: int, kv_dtype_bytes: int) -> StepCostModel:
        return cls(layer_params, lm_head_params, layer_weight_bytes, lm_head_bytes, embed_row_bytes,
                   kv_bytes_per_token(arch, kv_dtype_bytes),
                   4 * arch.num_hidden_layers * arch.num_attention_heads * arch.head_dim)

    def cost(self, seqs: Sequence[tuple[int, int]], num_sampled: int) -> tuple[float, float]:
        """(FLOPs, bytes) of a step computing `n` new tokens after `c` cached ones for each (c, n) in `seqs`."""
        tokens = sum(n for _, n in seqs)
        if tokens == 0:
            return 0.0, 0.0
        pairs = sum(n * c + n * (n + 1) // 2 for c, n in seqs)
        context = sum(c for c, _ in seqs)
        flops = (2 * self.layer_params * tokens + 2 * self.lm_head_params * num_sampled
                 + self.attn_flops_per_pair * pairs)
        nbytes = (self.layer_weight_bytes + (self.lm_head_bytes if num_sampled else 0) + tokens * self.embed_row_bytes
                  + (context + tokens) * self.kv_bytes_per_token)
        return float(flops), float(nbytes)


@dataclass
class PhaseTotals:
    steps: int = 0
    seconds: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0


class RooflineMeter:
    """Sums model time, FLOPs and bytes per step kind (prefill | decode | mixed) and turns them into achieved FLOP/s
    and B/s, MFU (FLOP/s over peak) and MBU (B/s over bandwidth). Decode reaching a high MBU while its MFU stays
    low is the signature of a bandwidth-bound phase; prefill the other way round."""

    def __init__(self, device: DeviceSpec | None, compute_dtype: torch.dtype) -> None:
        self.device = device
        self.peak_flops = self.peak_for(device, compute_dtype) if device else 0.0
        self.totals: dict[str, PhaseTotals] = {}

    @staticmethod
    def peak_for(device: DeviceSpec, dtype: torch.dtype) -> float:
        """The measured peak of the dtype the model computes in, when the device says; else its headline peak."""
        name = str(dtype).removeprefix("torch.")
        return dict(device.flops_by_dtype).get(name, device.peak_flops)

    def utilization(self, flops: float, nbytes: float, seconds: float) -> tuple[float, float]:
        """(MFU, MBU) of work done in `seconds`; (0, 0) without peaks."""
        if self.device is None or seconds <= 0:
            return 0.0, 0.0
        return flops / seconds / self.peak_flops, nbytes / seconds / self.device.mem_bandwidth

    def add(self, kind: str, seconds: float, flops: float, nbytes: float) -> None:
        t = self.totals.setdefault(kind, PhaseTotals())
        t.steps += 1
        t.seconds += seconds
        t.flops += flops
        t.bytes += nbytes

    def summary(self) -> dict[str, dict[str, float | int | str]]:
        """Per step kind: steps, seconds, achieved FLOP/s and B/s, MFU, MBU and which roof is nearer."""
        out: dict[str, dict[str, float | int | str]] = {}
        for kind, t in sorted(self.totals.items()):
            if t.seconds <= 0:
                continue
            mfu, mbu = self.utilization(t.flops, t.bytes, t.seconds)
            row: dict[str, float | int | str] = {
                "steps": t.steps, "seconds": round(t.seconds, 4), "flops_per_s": t.flops / t.seconds,
                "bytes_per_s": t.bytes / t.seconds, "intensity": t.flops / t.bytes if t.bytes else 0.0}
            if self.device is not None:
                row.update(mfu=mfu, mbu=mbu, nearer_roof="compute" if mfu >= mbu else "bandwidth")
            out[kind] = row
        return out


def _peaks_cache_file() -> str:
    root = os.environ.get("PDSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "pdserve")
    return os.path.join(root, "device-peaks.json")


def _peaks_key(threads: int) -> str:
    return f"{_cpu_name()}|{threads} threads|torch {torch.__version__}"


def save_measured_device(device: DeviceSpec, threads: int) -> str:
    """Remember a measurement for `resolve_device_peaks("auto")`; returns the file written (atomically)."""
    path = _peaks_cache_file()
    data: dict[str, Any] = {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        pass
    data[_peaks_key(threads)] = asdict(device)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
    return path


def resolve_device_peaks(spec: str, threads: int | None = None) -> DeviceSpec | None:
    """Peaks for the live roofline. "auto": this machine with `threads` torch threads, from the cache that
    `pdserve calc --measure` writes, else measured now (about two seconds, once) and cached; "off": none; a preset
    name; or "FLOPS,BYTES_PER_S" (e.g. "170e9,17e9")."""
    spec = spec.strip()
    if spec.lower() in ("off", "none", ""):
        return None
    if "," in spec:
        flops, bw = (float(x) for x in spec.split(",", 1))
        return DeviceSpec("given peaks", flops, bw, 0.0)
    if spec.lower() != "auto":
        return device_preset(spec)
    threads = threads or torch.get_num_threads()
    try:
        with open(_peaks_cache_file(), encoding="utf-8") as f:
            cached = json.load(f).get(_peaks_key(threads))
        if cached:
            cached["flops_by_dtype"] = tuple(tuple(x) for x in cached.get("flops_by_dtype", ()))
            return DeviceSpec(**cached)
    except (OSError, ValueError, TypeError):
        pass
    device = measure_device(threads, budget_s=0.5)
    try:
        save_measured_device(device, threads)
    except OSError:
        pass
    return device

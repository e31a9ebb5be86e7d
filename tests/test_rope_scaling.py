"""Rope scaling: YaRN (Qwen2.5/Qwen3 long context), llama3 and linear against transformers (its rope tables, then
logits and greedy tokens of tiny random Qwen2/Qwen3 models at positions past original_max_position_embeddings, on
the native and PyTorch paths), YaRN from llama.cpp's GGUF keys, and dynamic NTK refused by name."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
import transformers
from test_loader import BOS, EOS, VOCAB_SIZE, hf_model_from, logits, tiny_model, write_gguf
from test_phi3 import pdserve_logits

from pdserve import SamplingParams, kernels
from pdserve.config import ModelArchConfig
from pdserve.model.layers.rotary import rope_inv_freq
from pdserve.model.loader import load_gguf
from pdserve.model.runner import ModelRunner

from conftest import generate_twice, hf_greedy, loaded_from_hf, make_tiny_hf_model

ORIG = 64  # original_max_position_embeddings of the tiny configs; the prompts run to ~150
NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def yarn(**extra: Any) -> dict[str, Any]:
    return {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG, **extra}


SCALINGS: dict[str, dict[str, Any]] = {
    "yarn": yarn(),
    "yarn_betas": yarn(beta_fast=16.0, beta_slow=2.0, truncate=False),
    "yarn_mscale": yarn(mscale=0.707, mscale_all_dim=1.0),
    "yarn_attention_factor": yarn(attention_factor=1.25),
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIG},
    "linear": {"rope_type": "linear", "factor": 2.0},
}


def make_model(arch: str, scaling: dict[str, Any], **overrides: Any) -> Any:
    return make_tiny_hf_model(arch, max_position_embeddings=4 * ORIG, rope_theta=10000.0, rope_scaling=scaling,
                              **overrides)


def prompt(n: int = 150) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.mark.parametrize("name", list(SCALINGS))
def test_tables_are_transformers(name: str) -> None:
    """Inverse frequencies and the cos/sin factor as transformers' rope init functions compute them."""
    cfg = make_model("qwen3", SCALINGS[name]).config
    ref_freq, ref_factor = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[SCALINGS[name]["rope_type"]](cfg)
    arch = ModelArchConfig.from_hf_config(cfg.to_dict())
    inv_freq, factor = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)
    torch.testing.assert_close(inv_freq, ref_freq, rtol=1e-7, atol=0)
    assert factor == pytest.approx(ref_factor, rel=1e-12)


def test_qwen_config_json_forms() -> None:
    """Qwen2.5's config.json form (`type`, no rope_theta inside) and transformers 5's rope_parameters agree;
    an absent factor is max_position_embeddings / original, an absent original length max_position_embeddings."""
    new = make_model("qwen2", yarn()).config.to_dict()
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old.update(rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": ORIG})
    a, b = ModelArchConfig.from_hf_config(new), ModelArchConfig.from_hf_config(old)
    assert a.rope_scaling is not None and b.rope_scaling is not None
    assert {k: a.rope_scaling[k] for k in b.rope_scaling} == b.rope_scaling
    assert rope_inv_freq(16, 1e4, a.rope_scaling)[0].equal(rope_inv_freq(16, 1e4, b.rope_scaling)[0])
    no_factor = ModelArchConfig.from_hf_config({**old, "rope_scaling": {"type": "yarn", "factor": None,
                                                                        "original_max_position_embeddings": ORIG}})
    no_orig = ModelArchConfig.from_hf_config({**old, "rope_scaling": {"type": "yarn", "factor": 2.0}})
    assert no_factor.rope_scaling is not None and no_factor.rope_scaling["factor"] == 4.0
    assert no_orig.rope_scaling is not None and no_orig.rope_scaling["original_max_position_embeddings"] == 4 * ORIG


def test_reference_depends_on_the_scaling() -> None:
    """transformers' tokens past the original length change with YaRN's factor, beta_slow and attention factor (the
    tests below could fail)."""
    p = prompt()
    ref = hf_greedy(make_model("qwen2", yarn()), p, NEW)
    for other in (yarn(factor=2.0), yarn(beta_slow=4.0), yarn(attention_factor=1.0), None):
        assert hf_greedy(make_model("qwen2", other), p, NEW) != ref, other  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("kernels_choice", ["native", "torch"])
def test_yarn_logits_close(arch: str, kernels_choice: str) -> None:
    if kernels_choice == "native" and not kernels.available():
        pytest.skip("native kernels are not built")
    hf = make_model(arch, yarn())
    lm = loaded_from_hf(hf)
    runner = ModelRunner(lm.arch, lm.state_dict, torch.float32, num_blocks=16, block_size=16, max_model_len=4 * ORIG,
                         kernels=kernels_choice)
    p = prompt()
    torch.testing.assert_close(pdserve_logits(runner, p), logits(hf, p), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch,name", [("qwen2", "yarn"), ("qwen3", "yarn"), ("qwen3", "yarn_mscale"),
                                       ("qwen2", "linear")])
@pytest.mark.parametrize("kernels_choice", ["native", "torch"])
def test_greedy_matches_hf_past_the_original_length(tokenizer: Any, make_llm: Any, arch: str, name: str,
                                                    kernels_choice: str) -> None:
    """An English and a Chinese prompt past the original length and a short one whose generation stays below it,
    prefilled in 32-token chunks beside each other's decodes, then again from the prefix cache."""
    if kernels_choice == "native" and not kernels.available():
        pytest.skip("native kernels are not built")
    hf = make_model(arch, SCALINGS[name])
    ps = [prompt(), tokenizer.encode("你好，世界！请介绍一下杭州的西湖。" * 6), tokenizer.encode("Hello, my name is")]
    assert len(ps[1]) > ORIG
    ref = [hf_greedy(hf, p, NEW) for p in ps]
    llm = make_llm(hf_model=hf, kernels=kernels_choice, attention_backend="sdpa" if kernels_choice == "torch"
                   else "auto", max_num_batched_tokens=32, max_model_len=4 * ORIG, enable_prefix_caching=True)
    assert generate_twice(llm, ps, GREEDY, ref)[0].num_cached_tokens >= ORIG


def test_dynamic_ntk_is_refused_by_name() -> None:
    cfg = make_model("qwen2", None).config.to_dict()
    with pytest.raises(ValueError, match="'dynamic' \\(dynamic NTK\\) is not supported.*yarn"):
        ModelArchConfig.from_hf_config({**cfg, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                                                   "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="unsupported rope scaling type 'ntk-by-parts'"):
        ModelArchConfig.from_hf_config({**cfg, "rope_scaling": {"type": "ntk-by-parts", "factor": 2.0}})


# ---------------------------------------------------------------------------------------------------------------------
# GGUF: llama.cpp's converter writes rope.scaling.{type, factor, original_context_length, yarn_*}
# ---------------------------------------------------------------------------------------------------------------------


def _yarn_keys(beta_fast: float = 16.0, **more: float) -> Any:
    def extra(w: gguf.GGUFWriter) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(ORIG)
        w.add_rope_scaling_yarn_beta_fast(beta_fast)
        w.add_rope_scaling_yarn_beta_slow(1.0)
        w.add_rope_scaling_yarn_attn_factor(1.125)
        for key, value in more.items():
            w.add_float32(f"{w.arch}.rope.scaling.{key}", value)
    return extra


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_gguf_yarn_is_transformers(arch: str, tmp_path: Path) -> None:
    scaling = yarn(beta_fast=16.0, beta_slow=1.0, attention_factor=1.125)
    model = tiny_model(arch, max_position_embeddings=4 * ORIG, rope_scaling=scaling)
    write_gguf(tmp_path / "y.gguf", model, arch, extra=_yarn_keys(yarn_ext_factor=1.0))
    lm = load_gguf(str(tmp_path / "y.gguf"))
    want = ModelArchConfig.from_hf_config(model.config.to_dict())
    assert lm.arch == dataclasses.replace(want, bos_token_id=BOS, eos_token_id=EOS)
    ids = [BOS, *range(3, 3 + 2 * ORIG)]
    torch.testing.assert_close(logits(hf_model_from(lm), ids), logits(model, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("key,value", [("yarn_ext_factor", 0.5), ("yarn_log_multiplier", 0.1)])
def test_gguf_yarn_without_a_transformers_form_is_refused(key: str, value: float, tmp_path: Path) -> None:
    model = tiny_model("qwen2", vocab_size=VOCAB_SIZE)
    write_gguf(tmp_path / "y.gguf", model, "qwen2", extra=_yarn_keys(**{key: value}))
    with pytest.raises(ValueError, match=f"qwen2.rope.scaling.{key} = {value} is not supported"):
        load_gguf(str(tmp_path / "y.gguf"))

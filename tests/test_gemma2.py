"""Gemma 2: transformers' Gemma2ForCausalLM on a tiny random config (GeGLU, (1 + w) sandwich norms, embedding scale,
query_pre_attn_scalar, even layers local with a window shorter than the prompts, attention and final logit
soft-capping that bite) against pdserve's native kernels and the sdpa and flex backends: config, logits, greedy
tokens on English, Chinese and long prompts through chunked, batched and prefix-cached steps; the native program
recorded from the definition; and llama.cpp's `gemma2` GGUF (its keys, names and 1 + w norms) against the HF model."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_loader import BOS, EOS, VOCAB_SIZE, hf_model_from, logits, write_gguf
from test_native_program import assert_program_equals_definition, native_runner
from test_phi3 import pdserve_logits

from pdserve import SamplingParams, kernels
from pdserve.config import ModelArchConfig
from pdserve.model.loader import load_gguf
from pdserve.model.runner import ModelRunner

from conftest import SOFTCAP_ATTN, SOFTCAP_FINAL, generate_twice, hf_greedy, loaded_from_hf, make_tiny_hf_model

NEW = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
WINDOW = 24


def _prompts(tokenizer: Any) -> list[list[int]]:
    rng = random.Random(2)
    return [tokenizer.encode("Hello, my name is"), tokenizer.encode("你好，世界！请介绍一下杭州的西湖。" * 6),
            [rng.randrange(3, 49152) for _ in range(150)]]


def test_config_from_transformers() -> None:
    """transformers 5's config and an older one without layer_types give the same architecture."""
    new = make_tiny_hf_model("gemma2").config.to_dict()
    old = {k: v for k, v in new.items() if k not in ("layer_types", "rope_parameters")}
    old["rope_theta"] = 10000.0
    a, b = ModelArchConfig.from_hf_config(new), ModelArchConfig.from_hf_config(old)
    assert a == b
    assert a.architecture == "Gemma2ForCausalLM" and not a.qk_norm and a.hidden_act == "gelu_pytorch_tanh"
    assert [a.layer_window(i) for i in range(3)] == [WINDOW, 0, WINDOW] and a.rope_local_theta is None
    assert (a.attn_logit_softcapping, a.final_logit_softcapping, a.query_pre_attn_scalar) == \
        (SOFTCAP_ATTN, SOFTCAP_FINAL, 48.0)


def test_reference_depends_on_what_is_tested(tokenizer: Any) -> None:
    """transformers' greedy tokens change with the attention soft-cap, the window and the attention scale, and its
    logits without the final soft-cap pass the cap (a monotone map: it changes the logits, not the argmax), so the
    equality tests below could fail."""
    hf = make_tiny_hf_model("gemma2")
    prompt = _prompts(tokenizer)[2]
    ref = hf_greedy(hf, prompt, NEW)
    for change in ({"attn_logit_softcapping": None}, {"sliding_window": 40}, {"query_pre_attn_scalar": 64}):
        assert hf_greedy(make_tiny_hf_model("gemma2", **change), prompt, NEW) != ref, change
    assert float(logits(make_tiny_hf_model("gemma2", final_logit_softcapping=None), prompt).abs().max()) > \
        SOFTCAP_FINAL


@pytest.mark.parametrize("kernels_choice,attention", [("native", "auto"), ("torch", "sdpa"), ("torch", "flex")])
def test_logits_close(tokenizer: Any, kernels_choice: str, attention: str) -> None:
    if kernels_choice == "native" and not kernels.available():
        pytest.skip("native kernels are not built")
    hf = make_tiny_hf_model("gemma2")
    lm = loaded_from_hf(hf)
    runner = ModelRunner(lm.arch, lm.state_dict, torch.float32, num_blocks=16, block_size=16, max_model_len=256,
                         kernels=kernels_choice, attention_backend=attention)
    for prompt in _prompts(tokenizer):
        want = logits(hf, prompt)
        assert float(want.abs().max()) < SOFTCAP_FINAL  # capped
        torch.testing.assert_close(pdserve_logits(runner, prompt), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernels_choice,attention", [("native", "auto"), ("torch", "sdpa"), ("torch", "flex")])
def test_greedy_matches_hf_batched_chunked_and_cached(tokenizer: Any, make_llm: Any, kernels_choice: str,
                                                      attention: str) -> None:
    """English, Chinese and 150-token prompts (longer than the window), prefilled in 64-token chunks beside each
    other's decodes, then again from the prefix cache."""
    if kernels_choice == "native" and not kernels.available():
        pytest.skip("native kernels are not built")
    hf = make_tiny_hf_model("gemma2")
    prompts = _prompts(tokenizer)
    assert min(len(p) for p in prompts[1:]) > WINDOW
    ref = [hf_greedy(hf, p, NEW) for p in prompts]
    llm = make_llm(hf_model=hf, kernels=kernels_choice, attention_backend=attention, max_num_batched_tokens=64,
                   enable_prefix_caching=True)
    assert generate_twice(llm, prompts, GREEDY, ref)[2].num_cached_tokens > 0


@pytest.mark.skipif(not kernels.available(), reason="native kernels are not built")
def test_native_program_is_the_definition() -> None:
    runner = native_runner(loaded_from_hf(make_tiny_hf_model("gemma2")))
    ops = runner.model.program.ops()
    assert ops[:3] == ["embedding", "scale", "rms_norm"] and ops.count("attention") == 3
    assert_program_equals_definition(runner)


# ---------------------------------------------------------------------------------------------------------------------
# GGUF (llama.cpp's gemma2: the sandwich norms stored as 1 + w, both soft-caps and the window as keys)
# ---------------------------------------------------------------------------------------------------------------------


def write_gemma2_gguf(path: Path, model: Any, qtype: Any = lambda name, w: Q.F32) -> None:
    def extra(w: gguf.GGUFWriter) -> None:  # as llama.cpp's Gemma2Model writes them (the window: write_gguf)
        w.add_attn_logit_softcapping(model.config.attn_logit_softcapping)
        w.add_final_logit_softcapping(model.config.final_logit_softcapping)

    write_gguf(path, model, "gemma2", qtype=qtype, extra=extra)


@pytest.fixture(scope="module")
def gemma2_model() -> Any:
    # 4 layers: local, global, local, global, as llama.cpp fixes them; query_pre_attn_scalar = head_dim, as it does
    return make_tiny_hf_model("gemma2", vocab_size=VOCAB_SIZE, num_hidden_layers=4, query_pre_attn_scalar=64,
                              bos_token_id=BOS, eos_token_id=EOS, seed=3)


def test_gguf_config_and_weights_are_transformers(gemma2_model: Any, tmp_path: Path) -> None:
    write_gemma2_gguf(tmp_path / "f32.gguf", gemma2_model)
    lm = load_gguf(str(tmp_path / "f32.gguf"))
    ref = gemma2_model.state_dict()
    assert set(lm.state_dict) == set(ref)
    for name, w in lm.state_dict.items():  # norms: stored 1 + w, loaded as w
        torch.testing.assert_close(w, ref[name], rtol=0, atol=2e-7, msg=name)
    assert lm.hf_config["model_type"] == "gemma2"
    want = ModelArchConfig.from_hf_config(gemma2_model.config.to_dict())
    assert lm.arch == dataclasses.replace(want, max_position_embeddings=lm.arch.max_position_embeddings)
    ids = [BOS, *range(3, 3 + 2 * WINDOW)]  # past the window
    torch.testing.assert_close(logits(hf_model_from(lm), ids), logits(gemma2_model, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels_choice", ["native", "torch"])
def test_gguf_served_output_is_the_hf_models(gemma2_model: Any, tmp_path: Path, kernels_choice: str) -> None:
    """pdserve on the GGUF file: logits close to the HF model's and the same greedy tokens."""
    if kernels_choice == "native" and not kernels.available():
        pytest.skip("native kernels are not built")
    write_gemma2_gguf(tmp_path / "f32.gguf", gemma2_model)
    lm = load_gguf(str(tmp_path / "f32.gguf"), keep_quantized=kernels_choice == "native")
    runner = ModelRunner(lm.arch, lm.state_dict, torch.float32, num_blocks=16, block_size=16, max_model_len=256,
                         kernels=kernels_choice)
    prompt = [BOS, *random.Random(4).choices(range(3, VOCAB_SIZE), k=60)]
    got, want = pdserve_logits(runner, prompt), logits(gemma2_model, prompt)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()

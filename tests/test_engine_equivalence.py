"""Greedy tokens equal Hugging Face transformers' on the same weights (fp32), whatever the batch around them, on
both kernel paths (pdserve's native kernels and the PyTorch reference)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from pdserve import SamplingParams

from conftest import TEST_DEVICE, hf_greedy, loaded_from_hf, make_tiny_hf_model

NEW = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def _prompts(tokenizer: Any) -> list[list[int]]:
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         tokenize=False, add_generation_prompt=True)
    long_text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7} stones." for i in
                         range(120))
    texts = ["Hello", "Hello, my name is", "你好，世界！请介绍一下杭州的西湖。", "Emoji 🙂👍🏽 and 中文 mixed",
             long_text]
    ids = [tokenizer.encode(t) for t in texts]
    ids.insert(3, tokenizer.encode(chat, add_special_tokens=False))
    assert len(ids[-1]) > 1000
    return ids


@pytest.fixture(params=["native", "torch", "flex"])
def make_llm(request: pytest.FixtureRequest, make_llm: Any) -> Any:
    """conftest's factory, once per kernel path (a bf16 model keeps the PyTorch path under `auto`), on
    TEST_DEVICE (passed explicitly). `flex`: the torch path with FlexAttention on the cache in place and decode
    steps through the DecodeGraphRunner (CUDA graphs on cuda, its eager twin on cpu)."""
    choice = request.param
    if choice == "native" and TEST_DEVICE != "cpu":
        pytest.skip("the native kernels are CPU code")

    def factory(hf_model: Any = None, **options: Any) -> Any:
        options.setdefault("device", TEST_DEVICE)
        if choice == "flex":
            options.setdefault("attention_backend", "flex")
            options.setdefault("kernels", "torch")
            llm = make_llm(hf_model, **options)
            if llm.engine.runner.decode_graphs is None:
                llm.engine.runner.enable_decode_graphs()
            return llm
        native_ok = options.get("dtype", "float32") == "float32"
        options.setdefault("kernels", choice if native_ok or choice == "torch" else "auto")
        return make_llm(hf_model, **options)

    return factory


@pytest.fixture(scope="module")
def reference(tiny_hf_model: Any, tokenizer: Any) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): hf_greedy(tiny_hf_model, p, NEW) for p in _prompts(tokenizer)}


def _run(llm: Any, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    graphs = llm.engine.runner.decode_graphs
    before = graphs.replays if graphs is not None else 0
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.block_manager.check_integrity()
    assert llm.engine.block_manager.is_at_baseline()
    assert graphs is None or graphs.replays > before  # the decode steps did go through the graph runner
    return [o.outputs[0].token_ids for o in outs]


def test_alone_matches_hf(make_llm: Any, reference: dict) -> None:
    llm = make_llm()
    for prompt, ref in reference.items():
        assert _run(llm, [list(prompt)]) == [ref]


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_mixed_batch_matches_hf(make_llm: Any, reference: dict, tokenizer: Any, chunked: bool,
                                prefix_caching: bool) -> None:
    rng = random.Random(0)
    fillers = [[rng.randrange(3, 49152) for _ in range(rng.randrange(1, 300))] for _ in range(12)]
    prompts = [list(p) for p in reference] + fillers  # 18 requests of mixed lengths
    llm = make_llm(enable_chunked_prefill=chunked, enable_prefix_caching=prefix_caching,
                   max_num_batched_tokens=256 if chunked else 2048, num_kv_blocks=512)
    outs = _run(llm, prompts)
    assert outs[:len(reference)] == list(reference.values())


def test_prefix_cache_hit_matches_hf(make_llm: Any, tiny_hf_model: Any, tokenizer: Any) -> None:
    base = tokenizer.encode("Shared system prompt. " * 40)
    a, b = base + tokenizer.encode(" Question A?"), base + tokenizer.encode(" Question B, longer one?")
    llm = make_llm(enable_prefix_caching=True, max_num_batched_tokens=64)
    assert _run(llm, [a]) == [hf_greedy(tiny_hf_model, a, NEW)]
    out = llm.generate({"prompt_token_ids": b}, GREEDY)[0]
    assert out.num_cached_tokens >= (len(base) // 16 - 1) * 16 > 0
    assert out.outputs[0].token_ids == hf_greedy(tiny_hf_model, b, NEW)
    # the same prompt again hits everything but its last token's block
    again = llm.generate({"prompt_token_ids": b}, GREEDY)[0]
    assert again.num_cached_tokens == (len(b) - 1) // 16 * 16
    assert again.outputs[0].token_ids == out.outputs[0].token_ids


def test_preemption_matches_hf(make_llm: Any, reference: dict) -> None:
    prompts = [list(p) for p in reference if len(p) < 200] * 3  # 15 requests
    # 20 blocks of 16 tokens: room for ~4 requests at once, so the scheduler must preempt and recompute
    llm = make_llm(num_kv_blocks=20, max_num_batched_tokens=64)
    outs = _run(llm, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    assert outs == [reference[tuple(p)] for p in prompts]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_other_architectures_match_hf(arch: str, tokenizer: Any, make_llm: Any) -> None:
    hf = make_tiny_hf_model(arch)
    prompts = [tokenizer.encode("Hello, my name is"), tokenizer.encode("你好，世界！" * 30)]
    llm = make_llm(hf_model=hf, max_num_batched_tokens=64)
    assert _run(llm, prompts) == [hf_greedy(hf, p, NEW) for p in prompts]


def test_llama3_rope_scaling_matches_hf(tokenizer: Any, make_llm: Any) -> None:
    hf = make_tiny_hf_model(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256})
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 40)
    assert _run(make_llm(hf_model=hf), [prompt]) == [hf_greedy(hf, prompt, NEW)]


def test_bfloat16_runs_and_mostly_agrees(make_llm: Any, reference: dict) -> None:
    llm = make_llm(dtype="bfloat16")
    prompt, ref = next(iter(reference.items()))
    out = _run(llm, [list(prompt)])[0]
    assert len(out) == NEW and out[:4] == ref[:4]


def test_untied_embeddings(tokenizer: Any, make_llm: Any) -> None:
    hf = make_tiny_hf_model(tie_word_embeddings=False, seed=3)
    prompt = tokenizer.encode("Untied heads work too")
    assert _run(make_llm(hf_model=hf), [prompt]) == [hf_greedy(hf, prompt, NEW)]


def test_loaded_from_hf_roundtrip(tiny_hf_model: Any) -> None:
    lm = loaded_from_hf(tiny_hf_model)
    assert lm.arch.num_key_value_heads == 2 and lm.arch.tie_word_embeddings

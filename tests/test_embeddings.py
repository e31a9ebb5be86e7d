"""Embeddings through the engine: pooling requests prefill (chunked, batched with generation, preemptible) and
finish without sampling; the vector is the mean over the prompt's tokens of the final hidden state (after the final
norm), L2-normalised, compared here with transformers' LlamaModel on the tiny model. The KV pool returns to
baseline."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pdserve import SamplingParams
from pdserve import kernels as native_kernels

KERNELS = ["torch", pytest.param("native", marks=pytest.mark.skipif(not native_kernels.available(),
                                                                    reason="native kernels not built"))]


def direct_embedding(hf_model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        h = hf_model.model(torch.tensor([ids])).last_hidden_state[0].float()
    return torch.nn.functional.normalize(h.mean(0), dim=0)


def run(engine: Any) -> dict[str, Any]:
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            if out.finished:
                finals[out.request_id] = out
    engine.block_manager.check_integrity()
    assert engine.block_manager.is_at_baseline()
    return finals


@pytest.mark.parametrize("kernels", KERNELS)
def test_embeddings_match_transformers_and_leave_generation_unchanged(make_llm: Any, tiny_hf_model: Any,
                                                                      tokenizer: Any, kernels: str) -> None:
    llm = make_llm(kernels=kernels, max_num_batched_tokens=16)
    eng = llm.engine
    texts = ["The quick brown fox jumps over the lazy dog, again and again and again.", "你好，世界！嵌入向量。", "x"]
    gen_prompt = {"prompt_token_ids": tokenizer.encode("Once upon a time")}
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(gen_prompt, greedy)[0].outputs[0].token_ids
    embs = eng.make_embedding_requests(texts, "e")
    gen = eng.make_request(gen_prompt, greedy, "g")
    eng.add_request(gen)
    for r in embs:
        eng.add_request(r)
    finals = run(eng)
    assert finals["g"].outputs[0].token_ids == alone
    for text, r in zip(texts, embs):
        out = finals[r.request_id]
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids == []
        vec = torch.tensor(out.embedding)
        assert vec.shape == (64,) and float(vec.norm()) == pytest.approx(1.0, abs=1e-5)
        ref = direct_embedding(tiny_hf_model, tokenizer.encode(text))
        assert torch.allclose(vec, ref, atol=1e-4), float((vec - ref).abs().max())
        assert r.num_output_tokens == 0


def test_embeddings_take_no_prefix_hits_and_survive_preemption(make_llm: Any, tiny_hf_model: Any) -> None:
    # 4 blocks of 16: a generation (16 + 20 tokens) and a 40-token embedding prompt cannot both be resident; the
    # embedding request (the later arrival) is preempted mid-prefill and pools each position once when it recomputes
    llm = make_llm(num_kv_blocks=4, block_size=16, max_num_batched_tokens=16)
    eng = llm.engine
    prompt = [300 + 11 * j for j in range(40)]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    gen_prompt = {"prompt_token_ids": list(range(500, 516))}
    alone = llm.generate(gen_prompt, greedy)[0].outputs[0].token_ids
    eng.add_request(eng.make_request(gen_prompt, greedy, "g"))
    [emb] = eng.make_embedding_requests([{"prompt_token_ids": prompt}], "a")
    eng.add_request(emb)
    finals: dict[str, Any] = {}
    while eng.has_unfinished_requests():
        finals.update({o.request_id: o for o in eng.step().outputs if o.finished})
    assert emb.times.preemptions and eng.block_manager.is_at_baseline()
    assert finals["g"].outputs[0].token_ids == alone
    vec = torch.tensor(finals["a-0-0"].embedding)
    assert torch.allclose(vec, direct_embedding(tiny_hf_model, prompt), atol=1e-4)
    # the same prompt again: its blocks are cached, but a pooling request computes every position
    [again] = eng.make_embedding_requests([{"prompt_token_ids": prompt}], "b")
    eng.add_request(again)
    out = run(eng)["b-0-0"]
    assert out.num_cached_tokens == 0 and out.embedding == pytest.approx(finals["a-0-0"].embedding, abs=1e-5)

"""prompt_logprobs (vLLM's extension): each prompt token after the first scored under the model's raw distribution
at the position before it, with the top k there. Checked against transformers' log_softmax on the tiny model, with
chunked prefill, prefix-cache hits, preemption (no token scored twice) and both kernel paths; greedy outputs do not
change and the KV pool returns to baseline."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pdserve import SamplingParams
from pdserve import kernels as native_kernels
from pdserve.errors import RequestRejected

KERNELS = ["torch", pytest.param("native", marks=pytest.mark.skipif(not native_kernels.available(),
                                                                    reason="native kernels not built"))]


def reference(hf_model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def check(plp: list[Any], prompt: list[int], ref: torch.Tensor, k: int) -> None:
    assert len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        lp = plp[i]
        assert lp.token_id == prompt[i]
        assert lp.logprob == pytest.approx(float(ref[i - 1, prompt[i]]), abs=2e-3)
        v = float(ref[i - 1, prompt[i]])  # the rank, up to tokens within float noise of the target's logprob
        assert int((ref[i - 1] > v + 2e-3).sum()) + 1 <= lp.rank <= int((ref[i - 1] > v - 2e-3).sum()) + 1
        top_vals, top_ids = ref[i - 1].topk(k)
        assert len(lp.top) == k
        assert [v for _, v in lp.top] == pytest.approx(top_vals.tolist(), abs=2e-3)
        assert k == 0 or lp.top[0][0] == int(top_ids[0]) or top_vals[0] - top_vals[1] < 1e-3


def kv_idle(llm: Any) -> None:
    llm.engine.block_manager.check_integrity()
    assert llm.engine.block_manager.is_at_baseline() and not llm.engine.scheduler.requests


@pytest.mark.parametrize("kernels", KERNELS)
def test_matches_transformers_with_chunked_prefill(make_llm: Any, tiny_hf_model: Any, tokenizer: Any,
                                                   kernels: str) -> None:
    llm = make_llm(kernels=kernels, max_num_batched_tokens=16)  # a 45-token prompt in 3 chunks
    prompts = [tokenizer.encode("The quick brown fox jumps over the lazy dog. 中文的句子也要评分，一二三四五。"),
               tokenizer.encode("hi")]
    prompts[0] = (prompts[0] * 3)[:45]
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    scored = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=3)
    base = llm.generate([{"prompt_token_ids": p} for p in prompts], plain)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts] * 2, [scored, scored, plain, plain])
    for p, out in zip(prompts, outs):
        check(out.prompt_logprobs, p, reference(tiny_hf_model, p), 3)
    assert outs[2].prompt_logprobs is None
    # greedy outputs unchanged by scoring the prompt
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base] * 2
    kv_idle(llm)


def test_prefix_cache_hits_do_not_skip_scoring(make_llm: Any, tiny_hf_model: Any) -> None:
    llm = make_llm(block_size=16)
    prompt = [100 + (i * 37) % 3000 for i in range(70)]
    first = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=2))[0]
    again = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert again.num_cached_tokens == 64  # the blocks are cached ...
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0  # ... but a scoring request computes every position
    check(out.prompt_logprobs, prompt, reference(tiny_hf_model, prompt), 0)
    assert out.outputs[0].token_ids == first.outputs[0].token_ids
    kv_idle(llm)


def test_preempted_request_scores_each_token_once(make_llm: Any, tiny_hf_model: Any) -> None:
    llm = make_llm(num_kv_blocks=6, block_size=16)
    prompts = [[200 + 7 * i + j for j in range(16)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, prompt_logprobs=2)
    steps: list[Any] = []
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, on_step=steps.append)
    assert sum(s.num_preempted for s in steps) > 0
    for p, out in zip(prompts, outs):
        check(out.prompt_logprobs, p, reference(tiny_hf_model, p), 2)
    kv_idle(llm)


def test_bounds() -> None:
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(RequestRejected) as e:
            SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]
        assert e.value.param == "prompt_logprobs"


def test_serving_layer_format_and_errors(tiny_hf_model: Any, tokenizer: Any) -> None:
    import asyncio
    import time

    from pdserve.api.errors import APIError
    from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest
    from pdserve.config import EngineConfig
    from pdserve.engine.client import EngineClient
    from pdserve.engine.engine import LLMEngine
    from pdserve.server.serving import RequestContext
    from pdserve.server.serving_chat import OpenAIServingChat
    from pdserve.server.serving_completion import OpenAIServingCompletion

    from conftest import loaded_from_hf

    engine = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=64, max_model_len=256, device_peaks="off"),
                       model=loaded_from_hf(tiny_hf_model), tokenizer=tokenizer)
    ae = EngineClient(engine)
    ae.start()
    comp, chat = OpenAIServingCompletion(ae, "tiny"), OpenAIServingChat(ae, "tiny")
    prompt = "评分 this prompt, please"
    ids = tokenizer.encode(prompt)
    ref = reference(tiny_hf_model, ids)

    async def run() -> None:
        out = await comp.create_completion(CompletionRequest(prompt=[prompt, "x y"], max_tokens=2, temperature=0,
                                                             prompt_logprobs=2), RequestContext())
        assert isinstance(out, dict)
        plp = out["choices"][0]["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        for i in range(1, len(ids)):
            entry = plp[i]
            mine = entry[str(ids[i])]
            assert mine["logprob"] == pytest.approx(float(ref[i - 1, ids[i]]), abs=2e-3)
            assert mine["decoded_token"] == tokenizer.decode([ids[i]])
            assert 2 <= len(entry) <= 3 and all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
        assert len(out["choices"][1]["prompt_logprobs"]) == len(tokenizer.encode("x y"))
        plain = await comp.create_completion(CompletionRequest(prompt=prompt, max_tokens=2), RequestContext())
        assert isinstance(plain, dict) and "prompt_logprobs" not in plain["choices"][0]
        resp = await chat.create_chat_completion(ChatCompletionRequest(
            messages=[{"role": "user", "content": "你好"}], max_tokens=2, prompt_logprobs=1), RequestContext())
        assert isinstance(resp, dict)
        assert resp["prompt_logprobs"][0] is None and len(resp["prompt_logprobs"]) == resp["usage"]["prompt_tokens"]
        for body in (CompletionRequest(prompt="a", stream=True, prompt_logprobs=1),
                     CompletionRequest(prompt="a", prompt_logprobs=21)):
            with pytest.raises(APIError) as e:
                await comp.create_completion(body, RequestContext())
            assert e.value.status == 400 and e.value.param == "prompt_logprobs"
        with pytest.raises(APIError) as e:
            await chat.create_chat_completion(ChatCompletionRequest(
                messages=[{"role": "user", "content": "a"}], stream=True, prompt_logprobs=0), RequestContext())
        assert e.value.status == 400 and e.value.param == "prompt_logprobs"

    try:
        asyncio.run(run())
        deadline = time.monotonic() + 5
        while (ae.num_unfinished or not engine.block_manager.is_at_baseline()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.block_manager.is_at_baseline()
    finally:
        ae.shutdown()

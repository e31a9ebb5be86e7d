"""Speculative decoding with a draft model (`draft_model`): config and vocabulary checks, and the engine end to end.

Drafts are only proposals, so greedy output with a draft model equals greedy output without one token for token
(mixed batches, chunked prefill, prefix caching, preemption, stop strings, n > 1, logprobs; both kernel paths), and
with temperature > 0 the output keeps the target distribution. What a draft model changes is the acceptance rate,
which checks the draft's own paged KV bookkeeping: a draft that is the target itself must have every draft accepted
(any stale or misplaced draft K/V would show as rejections), a perturbed copy only some. The draft's KV pool
follows its requests (blocks cover exactly what the draft computed; rolled back on rejection) and returns to
baseline after finish, abort and preemption. A real server reports per-request drafted/accepted tokens. The real
default model's Q4 GGUF drafts for its own fp32 and int8 weights (slow)."""

from __future__ import annotations

import copy
import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import test_spec_decode
import torch
from test_spec_decode import GREEDY, _chi2_ok, _repetitive, _run, _texts

from pdserve import SamplingParams
from pdserve.config import EngineConfig, SpeculativeConfig
from pdserve.launch import ServerProc, start_server
from pdserve.model.spec.draft_model import DraftKVPool, DraftModelProposer

# the same target model, LLM factory and kernel paths as test_spec_decode (its fixtures, not copies)
alphabet_model = test_spec_decode.alphabet_model
make_llm = test_spec_decode.make_llm
kernels = test_spec_decode.kernels


def _save(model: Any, tokenizer: Any, path: Path) -> str:
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any, alphabet_model: Any) -> dict[str, str]:
    """Draft model directories: the target itself, and a copy with noise on its matrices (partial acceptance)."""
    root = tmp_path_factory.mktemp("drafts")
    perturbed = copy.deepcopy(alphabet_model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in perturbed.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * 0.12)
    return {"same": _save(alphabet_model, tokenizer, root / "same"),
            "perturbed": _save(perturbed, tokenizer, root / "perturbed")}


# Tests of the draft mechanics pass policy="always" (draft every step): the `auto` policy (its own tests) turns drafts
# off where it measures them slower, by wall time, so on a busy or fast machine a test could see no drafts at all.
def _spec(path: str, k: int = 4, **extra: Any) -> dict[str, Any]:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k, **extra}


def _drafter(llm: Any) -> DraftModelProposer:
    drafter: DraftModelProposer = llm.engine.runner.drafter  # the target runner's drafter
    return drafter


def _at_baseline(llm: Any) -> bool:
    pool = _drafter(llm).pool
    pool.check_integrity()
    return pool.is_at_baseline() and not _drafter(llm).seqs


# ---- config --------------------------------------------------------------------------------------------------------
def test_config_parses_draft_model() -> None:
    import argparse

    from pdserve.cli import add_engine_args, engine_config_from_args

    value = _spec("/m", 3, quantization="int8")
    want = SpeculativeConfig("draft_model", 3, model="/m", quantization="int8")
    assert EngineConfig(speculative_config=value).speculative == want
    assert SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 3}) == \
        SpeculativeConfig("draft_model", 3, model="/m")  # vLLM: a `model` alone means a draft model
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", json.dumps(value)])
    assert engine_config_from_args(args).speculative == want


@pytest.mark.parametrize("value, message", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs `model`"),
    ({"method": "draft_model", "model": "", "num_speculative_tokens": 2}, "needs `model`"),
    ({**_spec("/m"), "quantization": "fp8"}, "int8, int4 or unset"),
    ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "int8"}, "for the draft_model method"),
])
def test_config_rejects(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value)


def test_draft_must_share_the_vocabulary(make_llm: Any, tokenizer: Any, tmp_path: Path) -> None:
    from conftest import make_tiny_hf_model

    other = _save(make_tiny_hf_model(vocab_size=1000), tokenizer, tmp_path / "v1000")
    with pytest.raises(ValueError, match="vocab size 1000, the target 49152"):
        make_llm(speculative_config=_spec(other))
    with pytest.raises(FileNotFoundError, match="not found"):
        make_llm(speculative_config=_spec(str(tmp_path / "missing")))


# ---- engine --------------------------------------------------------------------------------------------------------
def test_draft_equal_to_target_accepts_everything(make_llm: Any, tokenizer: Any, drafts: dict[str, str],
                                                  kernels: str) -> None:
    """Mixed batches with chunked prefill (96-token budget): the output is the plain greedy output, and a draft
    identical to the target has every draft accepted."""
    base = make_llm(kernels=kernels, max_num_batched_tokens=96)
    prompts = _texts(tokenizer) + [_repetitive(base, tokenizer)]
    want = _run(base, prompts, GREEDY)
    spec = make_llm(kernels=kernels, max_num_batched_tokens=96,
                    speculative_config=_spec(drafts["same"], policy="always"))
    assert _run(spec, prompts, GREEDY) == want
    stats = spec.engine.spec.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert _drafter(spec).num_fallbacks == 0
    assert _at_baseline(spec)


def test_perturbed_draft_with_stops_max_tokens_n_logprobs(make_llm: Any, tokenizer: Any, drafts: dict[str, str],
                                                          kernels: str) -> None:
    base = make_llm(kernels=kernels)
    rep = _repetitive(base, tokenizer)
    full = base.generate([{"prompt_token_ids": rep}], GREEDY)[0].outputs[0]
    params = [GREEDY,
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                             stop=[tokenizer.decode(full.token_ids[9:11])]),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[full.token_ids[12]]),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=3, logprobs=2),
              SamplingParams(temperature=0, max_tokens=30, min_tokens=20, presence_penalty=0.5,
                             repetition_penalty=1.2)]
    prompts = [rep, rep, rep, rep, tokenizer.encode("你好，世界！请继续写下去。"), rep]
    want = base.generate([{"prompt_token_ids": p} for p in prompts], params)
    spec = make_llm(kernels=kernels, speculative_config=_spec(drafts["perturbed"], 3, policy="always"))
    got = spec.generate([{"prompt_token_ids": p} for p in prompts], params)
    for w, g in zip(want, got):
        for cw, cg in zip(w.outputs, g.outputs, strict=True):
            assert (cg.token_ids, cg.text, cg.finish_reason, cg.stop_reason) == \
                (cw.token_ids, cw.text, cw.finish_reason, cw.stop_reason)
            if cw.logprobs is not None:
                assert cg.logprobs is not None and len(cg.logprobs) == len(cw.logprobs)
                for a, b in zip(cw.logprobs, cg.logprobs):
                    assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-3)
    stats = spec.engine.spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # partial acceptance
    assert spec.engine.block_manager.is_at_baseline() and _at_baseline(spec)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_equal_under_preemption(make_llm: Any, tokenizer: Any, drafts: dict[str, str],
                                       prefix_caching: bool) -> None:
    opts = dict(num_kv_blocks=24, max_num_batched_tokens=64, enable_prefix_caching=prefix_caching)
    base = make_llm(**opts)
    rep = _repetitive(base, tokenizer)
    prompts = [rep, rep[:30], rep + rep[:10], *_texts(tokenizer)[:3]]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = _run(base, prompts, params)
    spec = make_llm(**opts, speculative_config=_spec(drafts["perturbed"], policy="always"))
    assert _run(spec, prompts, params) == want
    assert spec.engine.scheduler.num_preemptions > 0 and spec.engine.spec.stats.num_accepted_tokens > 0
    assert _at_baseline(spec)


def test_draft_pool_follows_its_requests(make_llm: Any, tokenizer: Any, drafts: dict[str, str]) -> None:
    """After every step each request's draft blocks cover exactly the tokens the draft computed (rejected drafts'
    blocks freed): the request's tokens less its newest, or, with proposals pending for its next step, all its
    tokens and all but the last of those drafts; abort frees everything."""
    llm = make_llm(speculative_config=_spec(drafts["perturbed"], policy="always"), num_kv_blocks=64)
    eng, pool = llm.engine, _drafter(llm).pool
    rep = _repetitive(make_llm(), tokenizer)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    reqs = [eng.add_request({"prompt_token_ids": rep[:40 + 7 * i]}, params, f"r{i}") for i in range(3)]
    rejected = 0
    for _ in range(15):
        result = eng.step()
        rejected += result.stats.num_draft_tokens - result.stats.num_accepted_tokens
        pool.check_integrity()
        for r in reqs:
            seq = _drafter(llm).seqs.get(r.request_id)
            if seq is not None:
                # pending proposals: the draft computed the newest token and fed back all but its last draft
                assert seq.num_computed <= r.num_tokens - 1 + seq.num_drafted
                assert len(pool.get_block_ids(r.request_id)) == pool.blocks_needed(seq.num_computed)
    assert rejected > 0 and pool.num_used_blocks > 0
    eng.abort_request([r.request_id for r in reqs])
    assert _at_baseline(llm) and eng.block_manager.is_at_baseline()


def test_catch_up_is_chunked_under_the_token_budget(make_llm: Any, tokenizer: Any, drafts: dict[str, str]) -> None:
    """A prompt longer than the step's token budget: the draft catches up on it in chunks of what the budget leaves,
    drafting only once caught up; no step makes the draft compute more than the budget; output unchanged."""
    budget = 32
    base = make_llm(max_num_batched_tokens=budget)
    rep = _repetitive(base, tokenizer)
    prompt = (rep * 3)[:150]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = _run(base, [prompt], params)
    spec = make_llm(max_num_batched_tokens=budget, speculative_config=_spec(drafts["same"], policy="always"))
    runner = _drafter(spec).runner
    per_step: list[int] = []
    greedy_step = runner.greedy_step

    def counting(sched: Any) -> Any:
        per_step[-1] += sum(r.num_scheduled_tokens for r in sched.scheduled_reqs)
        return greedy_step(sched)
    runner.greedy_step = counting  # type: ignore[method-assign]
    drafted_steps = []
    eng = spec.engine
    eng.add_request({"prompt_token_ids": prompt}, params, "r")
    while eng.has_unfinished_requests():
        per_step.append(0)
        drafted_steps.append(eng.step().stats.num_draft_tokens > 0)
    assert max(per_step) <= budget, per_step
    first = drafted_steps.index(True)
    catch_up_steps = [n for n, d in zip(per_step[:first], drafted_steps[:first]) if n]
    assert len(catch_up_steps) >= len(prompt) // budget, per_step  # chunks, not one long step
    assert spec.engine.spec.stats.num_accepted_tokens == spec.engine.spec.stats.num_draft_tokens > 0
    assert _at_baseline(spec) and eng.block_manager.is_at_baseline()
    assert _run(spec, [prompt], params) == want  # again, the target's prefix cache hit: the draft still catches up


def test_full_draft_pool_falls_back_without_changing_output(make_llm: Any, tokenizer: Any,
                                                            drafts: dict[str, str]) -> None:
    """A draft pool too small for every request: those it cannot hold get filler drafts, verified as any draft."""
    base = make_llm()
    rep = _repetitive(base, tokenizer)
    prompts = [rep, rep[5:], rep[9:]]
    want = _run(base, prompts, GREEDY)
    spec = make_llm(speculative_config=_spec(drafts["same"], policy="always"))
    _drafter(spec).pool = DraftKVPool(8, spec.engine.block_size)
    assert _run(spec, prompts, GREEDY) == want
    assert _drafter(spec).num_fallbacks > 0 and spec.engine.spec.stats.num_accepted_tokens > 0
    assert _at_baseline(spec)


def test_temperature_keeps_the_distribution(make_llm: Any, tokenizer: Any, drafts: dict[str, str]) -> None:
    """Greedy drafts are deterministic proposals: rejection sampling keeps the target distribution exactly."""
    opts = dict(max_num_seqs=256, max_num_batched_tokens=2048, num_kv_blocks=2048)
    base = make_llm(**opts)
    base_prompt = tokenizer.encode("Once upon a time, in a land far away")
    rep = base_prompt + list(base.generate([{"prompt_token_ids": base_prompt}], GREEDY)[0].outputs[0].token_ids)
    n = 600
    samples = {}
    spec = make_llm(**opts, speculative_config=_spec(drafts["perturbed"], policy="always"))
    for name, llm in (("base", base), ("spec", spec)):
        first_seed = 0 if name == "base" else n  # independent samples
        params = [SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, seed=first_seed + s)
                  for s in range(n)]
        outs = llm.generate([{"prompt_token_ids": rep}] * n, params)
        samples[name] = [o.outputs[0].token_ids for o in outs]
    stats = llm.engine.spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert _at_baseline(llm)
    for pos in range(1, 6):
        a = Counter(s[pos] for s in samples["base"])
        b = Counter(s[pos] for s in samples["spec"])
        assert _chi2_ok(a, b), (pos, a.most_common(5), b.most_common(5))


# ---- server --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[ServerProc]:
    srv = start_server(tmp_path_factory.mktemp("spec-draft"), "--model", str(tiny_dir), "--dtype", "float32",
                       "--num-kv-blocks", "256", "--max-model-len", "2048", "--num-threads", "1",
                       "--speculative-config", json.dumps(_spec(str(tiny_dir), policy="always")),
                       "--device-peaks", "off")
    yield srv
    srv.stop()


def test_server_reports_drafted_and_accepted(server: ServerProc) -> None:
    """Per-request drafted/accepted in `pdserve_timings`, the counters in /metrics, the draft in the start-up log."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="你好，世界！The quick brown fox", max_tokens=24, temperature=0,
                                    extra_body={"ignore_eos": True, "return_timings": True})
    assert out.model_extra is not None
    timings = out.model_extra["pdserve_timings"][0]
    assert timings["spec_draft_tokens"] > 0 and timings["spec_accepted_tokens"] == timings["spec_draft_tokens"]
    assert len(out.choices[0].text) > 0
    metrics = httpx.get(server.base_url + "/metrics").text
    drafted = [ln for ln in metrics.splitlines()
               if "spec_decode_num_draft_tokens_total{" in ln and not ln.startswith("#")]
    assert drafted and float(drafted[0].split()[-1]) >= timings["spec_draft_tokens"]
    assert "draft model ready" in server.log()
    for _ in range(50):  # the request log line (pdserve.requests) is written as the request finishes
        records = [json.loads(ln[ln.index('{"request_id"'):]) for ln in server.log().splitlines()
                   if '{"request_id"' in ln]
        if records:
            break
        time.sleep(0.1)
    assert records and records[-1]["spec_draft_tokens"] == timings["spec_draft_tokens"]
    assert records[-1]["spec_accepted_tokens"] == timings["spec_accepted_tokens"]


# ---- the real default model ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp32_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The default model's weights as a float32 Hugging Face directory (`pdserve convert`)."""
    from pdserve.model.convert import convert_gguf_to_hf
    from pdserve.model.loader import resolve_model_path

    out = str(tmp_path_factory.mktemp("smollm2-fp32"))
    convert_gguf_to_hf(resolve_model_path(None), out, dtype=torch.float32)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_real_model_q4_gguf_drafts_for_its_fp32_and_int8_weights(fp32_dir: str, quantization: str | None) -> None:
    """The shipped Q4_1 GGUF drafts for the same model's fp32 weights (and those quantized to int8): the greedy output
    is the non-speculative one, and most drafts are accepted."""
    from pdserve.llm import LLM
    from pdserve.model.loader import resolve_model_path

    opts: dict[str, Any] = dict(model=fp32_dir, dtype="float32", kv_cache_memory="128MiB", quantization=quantization,
                                device_peaks="off")
    chats = ["Write the Python function `add(a, b)` with a docstring, then repeat it with type hints.",
             "用三句话介绍一下长城。"]
    base = LLM(**opts)
    tok = base.engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
               for c in chats]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    spec = LLM(**opts, speculative_config=_spec(resolve_model_path(None), 4, policy="always"))
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert got == want
    stats = spec.engine.spec.stats
    rate = stats.num_accepted_tokens / stats.num_draft_tokens
    print(f"target fp32{'+' + quantization if quantization else ''}, Q4_1 draft: acceptance {rate:.3f}, "
          f"mean acceptance length {stats.mean_acceptance_length:.2f}")
    assert rate > 0.5
    assert _at_baseline(spec) and spec.engine.block_manager.is_at_baseline()


# ---- the default path: default model, default options --------------------------------------------------------------
DEFAULT_PATH_PROMPTS = ["The history of the printing press begins", "用中文写一首关于秋天的短诗，然后解释它。",
                        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                        "List the planets of the solar system in order, with one fact about each:"]


@pytest.fixture(scope="module")
def default_path_greedy() -> list[list[int]]:
    """Greedy outputs (64 tokens) of `LLM()` with no options: the default model on the default kernels and dtype."""
    from pdserve.llm import LLM

    base = LLM(device_peaks="off", kv_cache_memory="128MiB")
    outs = base.generate(DEFAULT_PATH_PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_default_path_speculation_is_exact(default_path_greedy: list[list[int]], method: str) -> None:
    """On the default path (whatever kernels and dtype `auto` picks on this CPU) greedy output with speculation is
    the output without, token for token, over 64 tokens of four prompts (Chinese among them): verification rows of
    several tokens compute what one-token decode rows compute (batch-invariant kernels). The draft model is the
    target itself, so every draft must also be accepted."""
    from pdserve.llm import LLM
    from pdserve.model.loader import resolve_model_path

    config: dict[str, Any] = ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                               "prompt_lookup_min": 1, "policy": "always"} if method == "ngram"
                              else _spec(resolve_model_path(None), 4, policy="always"))
    spec = LLM(device_peaks="off", kv_cache_memory="128MiB", speculative_config=config)
    outs = spec.generate(DEFAULT_PATH_PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == default_path_greedy
    stats = spec.engine.spec.stats
    assert stats.num_draft_tokens > 0
    if method == "draft_model":
        assert stats.num_accepted_tokens == stats.num_draft_tokens

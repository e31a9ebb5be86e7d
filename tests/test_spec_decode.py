"""Speculative decoding (n-gram prompt lookup): the proposer, config validation, draft verification, and the engine
end to end: greedy output with speculation equals greedy output without it token for token (mixed batches, chunked
prefill, prefix caching, preemption, stop strings, max_tokens, n > 1, logprobs; both kernel paths), drafts are
accepted on repetitive text, the KV pool returns to baseline, and with temperature > 0 the output keeps the target
distribution."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest
import torch

from pdserve import SamplingParams
from pdserve.config import EngineConfig, SpeculativeConfig
from pdserve.engine.spec_decode import SpecDecodeStats
from pdserve.model.input_batch import InputBatch
from pdserve.model.inputs import NewRequestData
from pdserve.model.sampler import Sampler
from pdserve.model.sampling_metadata import SamplingMetadata
from pdserve.model.spec.ngram import NgramIndex, propose_ngram
from pdserve.model.spec.rejection_sampler import RejectionSampler

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# engine tests: every proposer, drafting whatever it finds (the auto policy's choices depend on measured step times;
# test_greedy_equal_in_mixed_batches runs it too, and test_spec_policy.py tests it on a synthetic cost model)
METHODS = {"ngram": {**NGRAM, "policy": "always"},
           "suffix": {"method": "suffix", "num_speculative_tokens": 4, "policy": "always"}}
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


# ---- proposer ------------------------------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_most_recent_match() -> None:
    assert propose_ngram([1, 2, 3, 4, 1, 2], 3, 2, 4) == [3, 4, 1]
    assert propose_ngram([5, 1, 2, 9, 1, 2, 7, 1, 2], 2, 2, 4) == [7, 1]  # most recent, not first
    assert propose_ngram([1, 2, 3], 2, 2, 4) == []  # nothing to find
    assert propose_ngram([1, 2, 3, 1, 2], 0, 2, 4) == []


def test_ngram_prefers_the_longest_match() -> None:
    # suffix (8, 1, 2): the 3-gram matches at 0..3 (-> 5); the 2-gram (1, 2) alone last occurs at 5..7 (-> 6)
    tokens = [8, 1, 2, 5, 0, 1, 2, 6, 8, 1, 2]
    assert propose_ngram(tokens, 1, 2, 3) == [5]
    assert propose_ngram(tokens, 1, 2, 2) == [6]


def test_ngram_continues_a_period_past_the_end() -> None:
    assert propose_ngram([1, 2, 1, 2], 5, 2, 2) == [1, 2, 1, 2, 1]
    assert propose_ngram([7, 7, 7], 3, 2, 2) == [7, 7, 7]


def test_ngram_index_is_incremental() -> None:
    rng = random.Random(0)
    tokens: list[int] = []
    index = NgramIndex(2, 4)
    for _ in range(300):
        tokens.append(rng.randrange(6))
        assert index.propose(tokens, 4) == propose_ngram(tokens, 4, 2, 4)


# ---- config --------------------------------------------------------------------------------------------------------
def test_config_parses_json_and_dict() -> None:
    import json

    for value in (NGRAM, json.dumps(NGRAM)):
        spec = EngineConfig(speculative_config=value).speculative
        assert spec == SpeculativeConfig("ngram", 4, 4, 2)
    assert EngineConfig().speculative is None
    only_max = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert only_max is not None and only_max.prompt_lookup_min == 3


@pytest.mark.parametrize("value, message", [
    ({"method": "medusa2", "num_speculative_tokens": 2}, "unknown method"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "not implemented yet"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs `model`"),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "for the draft_model method"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, ">= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "<="),
    ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "unknown keys"),
    ("{not json", "not valid JSON"),
    ("[1]", "JSON object"),
])
def test_config_rejects(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value)


def test_cli_flag() -> None:
    import argparse
    import json

    from pdserve.cli import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", json.dumps(NGRAM)])
    assert engine_config_from_args(args).speculative == SpeculativeConfig("ngram", 4, 4, 2)


# ---- verification on synthetic logits ------------------------------------------------------------------------------
def _md(n: int, drafts: list[int] | list[list[int]], temperature: float, seeds: list[int | None] | None = None,
        outputs: list[list[int]] | None = None, **kw: Any) -> SamplingMetadata:
    """n requests' rows as the runner gathers them (drafts: the same for each, or one list per request)."""
    batch = InputBatch()
    per = drafts if drafts and isinstance(drafts[0], list) else [list(drafts)] * n
    for i in range(n):
        params = SamplingParams(temperature=temperature, seed=(seeds or [None] * n)[i], **kw)
        batch.add(NewRequestData(f"r{i}", [0], params, frozenset({2}),
                                 output_token_ids=(outputs or [[]] * n)[i]))
    return batch.sampling_metadata([f"r{i}" for i in range(n)], per)  # type: ignore[arg-type]


def test_greedy_verification() -> None:
    logits = torch.tensor([[0, 5, 0, 0], [0, 0, 5, 0], [5, 0, 0, 0], [0, 0, 0, 5.0]])
    # argmax per position: 1, 2, 0, 3; drafts 1, 2, 3 -> accept two, then the correction 0
    out = RejectionSampler()(logits, _md(1, [1, 2, 3], 0.0, logprobs=1))
    assert [out.token_ids[0], *out.extra_token_ids[0]] == [1, 2, 0]
    assert len(out.extra_logprobs[0]) == 2 and out.extra_logprobs[0][1].token_id == 0  # type: ignore[union-attr]
    out = RejectionSampler()(logits, _md(1, [1, 2, 0], 0.0))
    assert [out.token_ids[0], *out.extra_token_ids[0]] == [1, 2, 0, 3]  # all accepted + bonus
    out = RejectionSampler()(logits, _md(1, [3, 2, 0], 0.0))
    assert [out.token_ids[0], *out.extra_token_ids[0]] == [1]


def test_draft_rows_see_drafts_as_output() -> None:
    md = _md(1, [7, 8], 1.0, outputs=[[5]], min_tokens=2, presence_penalty=0.5)
    assert md.spec is not None and md.spec.starts == [0] and md.num_rows == 3
    assert md.penalties is not None and md.penalties.output_token_ids == [[5], [5, 7], [5, 7, 8]]
    assert md.banned == [(0, [2])]  # min_tokens reached after the first position: EOS free from row 1 on


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Each emitted position is distributed as the target p_j, whatever the draft (p_j(d) high, low or zero)."""
    torch.manual_seed(0)
    n = 6000
    p0 = torch.tensor([0.5, 0.2, 0.2, 0.1, 0.0])
    p1 = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.6])
    p2 = torch.tensor([0.25, 0.25, 0.25, 0.25, 0.0])
    logits = torch.stack([p0, p1, p2]).clamp_min(1e-30).log().repeat(n, 1)
    out = RejectionSampler()(logits, _md(n, [0, 3], 1.0))
    first = Counter(out.token_ids)
    second = Counter(e[0] for t, e in zip(out.token_ids, out.extra_token_ids) if t == 0)
    third = Counter(e[1] for t, e in zip(out.token_ids, out.extra_token_ids) if t == 0 and e[0] == 3)
    for counts, p in ((first, p0), (second, p1), (third, p2)):
        total = sum(counts.values())
        for tok in range(5):
            expect = float(p[tok])
            sd = math.sqrt(expect * (1 - expect) / total) + 1e-9
            assert abs(counts[tok] / total - expect) < 5 * sd + 0.01, (tok, counts, p)
    assert all(len(e) <= 2 for e in out.extra_token_ids)


def test_rows_without_drafts_sample_as_plain_rows() -> None:
    """A seeded row without drafts in a batch with speculating rows draws exactly what it draws alone."""
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    md = _md(2, [[], [3, 4]], 0.8, seeds=[7, None])
    plain = _md(1, [], 0.8, seeds=[7])
    mixed = RejectionSampler()(logits, md)
    alone = Sampler()(logits[:1], plain)
    assert mixed.token_ids[0] == alone.token_ids[0] and mixed.extra_token_ids[0] == []


def test_row_whose_verification_raises_fails_alone() -> None:
    """The per-row fallback slices each row's 1 + k logits rows: a failing row fails alone, the speculating rows
    around it keep what they verify alone."""
    logits = torch.tensor([[0, 5, 0, 0], [0, 0, 5, 0], [0, 0, 0, 5.0], [5, 0, 0, 0], [0, 5, 0, 0], [0, 0, 5, 0]])
    # rows 0, 1: accept 1, bonus argmax(row 1) = 2; row 2: a banned id outside the vocabulary; rows 3..5: argmax
    # 0 != 1, correction 0
    md = _md(3, [[1], [], [1, 0]], 0.0)
    md.banned = [(2, [99])]
    out = RejectionSampler()(logits, md)
    assert out.errors[0] is None and out.errors[1] and out.errors[2] is None
    assert (out.token_ids, out.extra_token_ids) == ([1, -1, 0], [[2], [], []])


# ---- engine --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def alphabet_model() -> Any:
    """conftest's tiny random Llama with 16 tokens (1000..1015) whose tied embeddings are 4x longer: its outputs
    mostly stay in that small alphabet, so they repeat and n-gram drafts are often (not always) accepted, while
    attention over the whole context still decides which of them comes next."""
    from conftest import make_tiny_hf_model

    model = make_tiny_hf_model()
    with torch.no_grad():
        model.model.embed_tokens.weight[1000:1016] *= 4.0
    return model


@pytest.fixture
def make_llm(make_llm: Any, alphabet_model: Any) -> Any:
    def factory(**options: Any) -> Any:
        return make_llm(alphabet_model, **options)

    return factory


@pytest.fixture(params=["native", "torch"])
def kernels(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=sorted(METHODS))
def spec(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The speculative config of each proposer."""
    return METHODS[str(request.param)]


def _texts(tokenizer: Any) -> list[list[int]]:
    rng = random.Random(0)
    code = "def add(a, b):\n    return a + b\n\n" * 6
    quote = "The quick brown fox jumps over the lazy dog. " * 8
    prompts = [tokenizer.encode(code), tokenizer.encode(quote), tokenizer.encode("Hello, my name is")]
    prompts += [[rng.randrange(3, 49152) for _ in range(rng.randrange(5, 200))] for _ in range(5)]
    return prompts


def _repetitive(llm: Any, tokenizer: Any) -> list[int]:
    """A prompt whose greedy continuation repeats text already in it: P + greedy(P) + P, on the tiny model."""
    base = tokenizer.encode("Once upon a time, in a land far away")
    out = llm.generate([{"prompt_token_ids": base}], GREEDY)[0].outputs[0].token_ids
    return base + list(out) + base


def _run(llm: Any, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Any]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    bm = llm.engine.block_manager
    bm.check_integrity()
    assert bm.is_at_baseline()
    assert not bm.req_num_hashed
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def plain_runs() -> dict[tuple[Any, ...], Any]:
    """The plain (no speculation) engine's outputs, computed once per test and engine options and compared with
    every proposer and policy: they depend on neither (each test below checks its plain run on first use)."""
    return {}


@pytest.mark.parametrize("policy", ["always", "auto"])
def test_greedy_equal_in_mixed_batches(make_llm: Any, tokenizer: Any, kernels: str, spec: dict[str, Any],
                                       policy: str, plain_runs: dict[tuple[Any, ...], Any]) -> None:
    key = ("mixed", kernels)
    if key not in plain_runs:
        base = make_llm(kernels=kernels, max_num_batched_tokens=96)
        prompts = _texts(tokenizer) + [_repetitive(base, tokenizer)]
        plain_runs[key] = prompts, _run(base, prompts, GREEDY)
    prompts, want = plain_runs[key]
    llm = make_llm(kernels=kernels, max_num_batched_tokens=96, speculative_config={**spec, "policy": policy})
    assert _run(llm, prompts, GREEDY) == want
    stats = llm.engine.spec.stats
    if policy == "always":
        assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    else:  # auto drafts only where its wall-time guard measures drafting faster: it decided, one way or the other
        assert stats.num_drafts > 0 or sum(stats.disabled_steps.values()) > 0


def test_greedy_equal_with_stops_max_tokens_n_logprobs(make_llm: Any, tokenizer: Any, kernels: str,
                                                       spec: dict[str, Any]) -> None:
    base = make_llm(kernels=kernels)
    rep = _repetitive(base, tokenizer)
    full = base.generate([{"prompt_token_ids": rep}], GREEDY)[0].outputs[0]
    stop_str = tokenizer.decode(full.token_ids[9:11])
    params = [GREEDY,
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop_str]),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[full.token_ids[12]]),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=3, logprobs=2),
              SamplingParams(temperature=0, max_tokens=30, min_tokens=20, presence_penalty=0.5,
                             repetition_penalty=1.2)]
    prompts = [rep] * len(params)
    want = base.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm = make_llm(kernels=kernels, speculative_config=spec)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.block_manager.is_at_baseline()
    for w, g in zip(want, got):
        for cw, cg in zip(w.outputs, g.outputs, strict=True):
            assert (cg.token_ids, cg.text, cg.finish_reason, cg.stop_reason) == \
                (cw.token_ids, cw.text, cw.finish_reason, cw.stop_reason)
            if cw.logprobs is not None:
                assert cg.logprobs is not None and len(cg.logprobs) == len(cw.logprobs)
                for a, b in zip(cw.logprobs, cg.logprobs):
                    assert a.token_id == b.token_id and a.rank == b.rank
                    assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
    assert want[1].outputs[0].finish_reason == "stop" and len(want[1].outputs[0].token_ids) < 40
    assert llm.engine.spec.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_equal_under_preemption(make_llm: Any, tokenizer: Any, kernels: str, prefix_caching: bool,
                                      spec: dict[str, Any], plain_runs: dict[tuple[Any, ...], Any]) -> None:
    opts = dict(kernels=kernels, num_kv_blocks=24, max_num_batched_tokens=64, enable_prefix_caching=prefix_caching)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    key = ("preemption", kernels, prefix_caching)
    if key not in plain_runs:
        base = make_llm(**opts)
        rep = _repetitive(base, tokenizer)
        prompts = [rep, rep[:30], rep + rep[:10], *_texts(tokenizer)[:3]]
        plain_runs[key] = prompts, _run(base, prompts, params)
    prompts, want = plain_runs[key]
    llm = make_llm(**opts, speculative_config=spec)
    assert _run(llm, prompts, params) == want
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.spec.stats.num_accepted_tokens > 0


def test_drafts_accepted_fewer_steps(make_llm: Any, tokenizer: Any) -> None:
    base = make_llm()
    rep = _repetitive(base, tokenizer)
    steps: dict[str, int] = {}
    outs = {}
    for name, llm in (("base", base), ("spec", make_llm(speculative_config=METHODS["ngram"]))):
        count = [0]
        outs[name] = llm.generate([{"prompt_token_ids": rep}], GREEDY,
                                  on_step=lambda s, c=count: c.__setitem__(0, c[0] + 1))[0].outputs[0].token_ids
        steps[name] = count[0]
        if name == "spec":
            stats = llm.engine.spec.stats
    assert outs["spec"] == outs["base"]
    assert stats.num_accepted_tokens > 0 and stats.mean_acceptance_length > 1
    assert steps["spec"] < steps["base"]
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    assert stats.accepted_per_pos == sorted(stats.accepted_per_pos, reverse=True)  # position i needs 0..i-1


def test_drafts_take_only_the_budget_prefill_chunks_leave(make_llm: Any, tokenizer: Any) -> None:
    """A prompt arriving while a request speculates gets its full chunk (budget minus the decode's token) in every
    step; the decode drafts again once the prompt is computed, and both outputs equal the non-speculative ones."""
    budget = 32
    base = make_llm(max_num_batched_tokens=budget)
    rep = _repetitive(base, tokenizer)
    long_prompt = [1000 + (i * 7) % 16 for i in range(150)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in base.generate([{"prompt_token_ids": p} for p in (rep, long_prompt)],
                                                          params)]
    eng = make_llm(max_num_batched_tokens=budget, speculative_config={**METHODS["ngram"], "policy": "always"}).engine
    a = eng.add_request({"prompt_token_ids": rep}, params, "a")
    while a.num_output_tokens < 4:
        eng.step()
    b = eng.add_request({"prompt_token_ids": long_prompt}, params, "b")
    drafts_after = 0
    while eng.has_unfinished_requests():
        remaining = len(long_prompt) - b.num_computed_tokens
        stats = eng.step().stats
        if remaining > 0:  # a decodes (one token) beside b's chunk; its drafts get only what the chunk left
            assert stats.num_prefill_tokens == min(budget - 1, remaining)
            assert stats.num_draft_tokens <= budget - 1 - stats.num_prefill_tokens
        else:
            drafts_after += stats.num_draft_tokens
    assert drafts_after > 0
    assert [list(a.output_token_ids), list(b.output_token_ids)] == [list(w) for w in want]
    assert eng.block_manager.is_at_baseline()


def test_kv_pool_at_baseline_after_abort(make_llm: Any, tokenizer: Any) -> None:
    llm = make_llm(speculative_config=METHODS["ngram"], num_kv_blocks=64)
    eng = llm.engine
    rep = _repetitive(make_llm(), tokenizer)
    reqs = [eng.add_request({"prompt_token_ids": rep}, SamplingParams(temperature=0, max_tokens=200,
                                                                     ignore_eos=True), f"r{i}") for i in range(3)]
    drafted = 0
    for _ in range(12):
        result = eng.step()
        drafted += result.stats.num_draft_tokens
        eng.block_manager.check_integrity()
        for r in reqs:  # blocks cover the computed tokens (drafts' blocks freed) and nothing more
            held = len(eng.block_manager.get_block_ids(r.request_id))
            if r.num_computed_tokens and held:
                assert held == eng.block_manager.blocks_needed(r.num_computed_tokens)
    assert drafted > 0
    eng.abort_request([r.request_id for r in reqs])
    assert eng.block_manager.is_at_baseline() and not eng.block_manager.req_num_hashed


def test_batch_size_switch(make_llm: Any, tokenizer: Any) -> None:
    llm = make_llm(speculative_config={**METHODS["ngram"], "disable_by_batch_size": 1})
    rep = _repetitive(make_llm(), tokenizer)
    llm.generate([{"prompt_token_ids": rep}] * 2, GREEDY)
    assert llm.engine.spec.stats.num_drafts == 0  # two decodes each step: off
    assert llm.engine.spec.stats.disabled_steps["batch_size"] > 0
    llm.generate([{"prompt_token_ids": rep}], GREEDY)
    assert llm.engine.spec.stats.num_drafts > 0


def _chi2_ok(a: Counter[int], b: Counter[int]) -> bool:
    """Chi-square homogeneity of two samples over categories with enough counts (the rest pooled); generous
    bound: Wilson-Hilferty z < 4.5 (p ~ 3e-6)."""
    na, nb = sum(a.values()), sum(b.values())
    cats = [t for t in set(a) | set(b) if a[t] + b[t] >= 20]
    rows = [(a[t], b[t]) for t in cats]
    rows.append((na - sum(x for x, _ in rows), nb - sum(y for _, y in rows)))
    rows = [r for r in rows if sum(r)]
    stat = 0.0
    for x, y in rows:
        tot = x + y
        for obs, n in ((x, na), (y, nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    k = max(len(rows) - 1, 1)
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return z < 4.5


def test_temperature_keeps_the_distribution(make_llm: Any, tokenizer: Any) -> None:
    """Empirical distribution of output tokens 1..5 over many seeds: with speculation as without."""
    base = make_llm(max_num_seqs=256, max_num_batched_tokens=2048, num_kv_blocks=2048)
    base_prompt = tokenizer.encode("Once upon a time, in a land far away")
    rep = base_prompt + list(base.generate([{"prompt_token_ids": base_prompt}], GREEDY)[0].outputs[0].token_ids)
    n = 800
    samples = {}
    for name, llm in (("base", base), ("spec", make_llm(max_num_seqs=256, max_num_batched_tokens=2048,
                                                         num_kv_blocks=2048, speculative_config=METHODS["ngram"]))):
        first_seed = 0 if name == "base" else n  # independent samples
        params = [SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, seed=first_seed + s)
                  for s in range(n)]
        outs = llm.generate([{"prompt_token_ids": rep}] * n, params)
        samples[name] = [o.outputs[0].token_ids for o in outs]
        if name == "spec":
            stats = llm.engine.spec.stats
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    for pos in range(1, 6):
        a = Counter(s[pos] for s in samples["base"])
        b = Counter(s[pos] for s in samples["spec"])
        assert _chi2_ok(a, b), (pos, a.most_common(5), b.most_common(5))


def test_metrics_counters() -> None:
    from prometheus_client import generate_latest

    from pdserve.server.metrics import Metrics

    m = Metrics("tiny")
    stats = SpecDecodeStats(accepted_per_pos=[0, 0, 0])
    stats.observe(3, 2)
    stats.observe(3, 0)
    m.observe_spec(stats)
    stats.observe(2, 1)
    m.observe_spec(stats)
    text = generate_latest(m.registry).decode()
    assert 'pdserve:spec_decode_num_drafts_total{model_name="tiny"} 3.0' in text
    assert 'pdserve:spec_decode_num_draft_tokens_total{model_name="tiny"} 8.0' in text
    assert 'pdserve:spec_decode_num_accepted_tokens_total{model_name="tiny"} 3.0' in text
    assert 'pdserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"} 2.0' in text
    assert 'pdserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="1"} 1.0' in text
    assert stats.mean_acceptance_length == pytest.approx(1 + 3 / 3)


def test_bench_reports_mean_acceptance_length() -> None:
    from pdserve.bench.report import server_summary
    from pdserve.bench.server_metrics import parse_metrics, server_deltas

    text = ('vllm:spec_decode_num_drafts_total{{model_name="m"}} {d}\n'
            'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {a}\n')
    st = server_deltas(parse_metrics(text.format(d=10, a=5)), parse_metrics(text.format(d=30, a=45)))
    assert st is not None and st.spec_mean_acceptance_length == pytest.approx(3.0)
    assert server_summary(st)["server_spec_mean_acceptance_length"] == pytest.approx(3.0)
    none = server_deltas(parse_metrics(text.format(d=1, a=1)), parse_metrics(text.format(d=1, a=1)))
    assert none is not None and none.spec_mean_acceptance_length is None


def test_structured_output_is_not_speculated(make_llm: Any, tokenizer: Any) -> None:
    """A constrained request in a speculating batch decodes without drafts and keeps its grammar; its neighbours
    speculate."""
    import re

    base = make_llm()
    rep = _repetitive(base, tokenizer)
    regex = SamplingParams(temperature=0, max_tokens=30, structured_outputs={"regex": r"\d{3}-[a-z]{2,4}"})
    params = [regex, GREEDY]
    want = base.generate([{"prompt_token_ids": rep}] * 2, params)
    llm = make_llm(speculative_config=METHODS["ngram"])
    eng = llm.engine
    reqs = [eng.add_request({"prompt_token_ids": rep}, p, f"s{i}") for i, p in enumerate(params)]
    finals = {}
    while eng.has_unfinished_requests():
        finals.update({o.request_id: o for o in eng.step().outputs if o.finished})
    assert reqs[0].num_draft_tokens == 0 and reqs[1].num_draft_tokens > 0
    assert reqs[0].output_token_ids == want[0].outputs[0].token_ids
    assert reqs[1].output_token_ids == want[1].outputs[0].token_ids
    assert re.fullmatch(r"\d{3}-[a-z]{2,4}", finals["s0"].outputs[0].text)
    assert eng.block_manager.is_at_baseline()

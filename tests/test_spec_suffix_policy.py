"""Suffix decoding's trie and proposer, and the `auto` speculation policy on a synthetic step cost model (on at
batch 1 with high acceptance, off at high batch (compute_bound) and at low acceptance, k chosen per request), with
the exactness of greedy output under `auto` on the tiny model (tests/test_spec_decode.py runs the engine equality
tests over every proposer)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from pdserve import SamplingParams
from pdserve.config import EngineConfig, SpeculativeConfig
from pdserve.engine.request import Request
from pdserve.engine.spec_decode import SpecDecoder
from pdserve.engine.spec_decode.guard import EPOCH_STEPS, MAX_INTERVAL, SpecGuard, _Bucket
from pdserve.engine.spec_decode.overhead import DraftOverhead
from pdserve.engine.spec_decode.policy import PROBE_ALONE, PROBE_EVERY, AcceptanceRate, SpecPolicy
from pdserve.model.spec.proposer import DraftRequest
from pdserve.model.spec.suffix import SuffixProposer, SuffixTrie


def _req(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=100), set(), 100)


# ---- the trie ------------------------------------------------------------------------------------------------------
def _counts(seqs: Sequence[Sequence[int]], depth: int) -> dict[tuple[int, ...], int]:
    """Occurrences of every substring of at most `depth` tokens, by brute force."""
    out: dict[tuple[int, ...], int] = {}
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                out[tuple(s[i:j])] = out.get(tuple(s[i:j]), 0) + 1
    return out


def _dump(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}
    stack: list[tuple[Any, tuple[int, ...]]] = [(trie.root, ())]
    while stack:
        node, path = stack.pop()
        for tok, child in node.children.items():
            out[path + (tok,)] = child.count
            stack.append((child, path + (tok,)))
    return out


def test_trie_counts_every_bounded_substring_and_removes_exactly() -> None:
    rng = random.Random(0)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 60))] for _ in range(8)]
    trie = SuffixTrie(5)
    for s in seqs:
        trie.add(s)
    assert _dump(trie) == _counts(seqs, 5)
    trie.remove(seqs[3])
    trie.remove(seqs[0])
    assert _dump(trie) == _counts(seqs[1:3] + seqs[4:], 5)
    for s in seqs[1:3] + seqs[4:]:
        trie.remove(s)
    assert trie.root.children == {}


def test_trie_incremental_append_equals_add() -> None:
    rng = random.Random(1)
    tokens = [rng.randrange(5) for _ in range(200)]
    a, b = SuffixTrie(7), SuffixTrie(7)
    a.add(tokens)
    active = b.start()
    for t in tokens:
        active = b.append(active, t)
        assert len(active) <= 6
    assert _dump(a) == _dump(b)


def test_speculate_longest_match_most_frequent_adaptive_length() -> None:
    trie = SuffixTrie(8)
    # (1 2) is followed by 3 twice and by 9 once; (7 1 2) only by 9
    trie.add([1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 7, 1, 2, 9, 9])
    draft, score = trie.speculate([5, 1, 2], 4, 1.0, 0.1)
    assert draft == [3, 4]  # match length 2 x max_spec_factor 1.0: at most 2 tokens
    assert score == pytest.approx(2 / 3 + 2 / 3)
    assert trie.speculate([5, 1, 2], 4, 2.0, 0.1)[0] == [3, 4, 0, 1]
    assert trie.speculate([7, 1, 2], 4, 2.0, 0.1)[0] == [9, 9]  # the longer match wins; the sequence ends there
    assert trie.speculate([5, 1, 2], 4, 1.0, 0.7)[0] == []  # 2/3 < min_token_prob
    assert trie.speculate([6, 6], 4, 1.0, 0.1) == ([], 0.0)  # nothing matches


def test_proposer_uses_the_request_and_the_global_trie() -> None:
    proposer = SuffixProposer(max_tree_depth=16, max_cached_requests=2, max_spec_factor=2.0, min_token_prob=0.1)

    def propose(rid: str, tokens: list[int], k: int) -> list[int]:
        return proposer.propose([DraftRequest(rid, tokens, 0, k)], 0).get(rid, [])

    first = [1, 2, 3, 40, 41, 42, 43, 44]  # prompt [1, 2, 3], then its output
    assert propose("a", first, 4) == []  # no repetition yet, nothing cached
    proposer.on_finished("a", first, 3)
    assert propose("b", [7, 40, 41], 4) == [42, 43, 44]  # the prompt ends like the first output began
    own = [5, 6, 8, 9, 5, 6]
    assert propose("c", own, 4) == [8, 9, 5, 6]
    own += [8, 9]  # incremental: the request's trie follows its new tokens
    assert propose("c", own, 2) == [5, 6]
    for rid in ("d", "e"):  # LRU: two more finished requests evict the first one's output
        proposer.on_finished(rid, [0, int(rid == "d")], 1)
    assert list(proposer.cached) == ["d", "e"]
    assert propose("f", [7, 40, 41], 4) == []


def test_suffix_config() -> None:
    spec = EngineConfig(speculative_config={"method": "suffix"}).speculative
    assert spec is not None and spec.num_speculative_tokens == spec.suffix_decoding_max_tree_depth == 24
    assert spec.policy == "auto"
    spec = SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 3, "policy": "always",
                                    "suffix_decoding_max_spec_factor": 2, "suffix_decoding_min_token_prob": 0.2})
    assert spec is not None and (spec.num_speculative_tokens, spec.policy) == (3, "always")
    assert (spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob) == (2, 0.2)


@pytest.mark.parametrize("value, message", [
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 1}, "max_tree_depth must be an integer >= 2"),
    ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, "max_cached_requests must be"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, "max_spec_factor must be a number > 0"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, r"min_token_prob must be a number in \[0, 1\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 8}, "for the suffix method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "policy": "sometimes"}, "policy must be one of"),
])
def test_suffix_config_rejects(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value)


# ---- the policy ----------------------------------------------------------------------------------------------------
def synthetic(weights_s: float, per_token_s: float) -> Any:
    """A step time model as the fitted one: weights read once per step plus compute per query token."""
    def predict(seqs: Sequence[tuple[int, int]], num_sampled: int) -> float:
        return weights_s + per_token_s * sum(n for _, n in seqs)
    return predict


def _reqs(n: int) -> list[Request]:
    reqs = []
    for i in range(n):
        r = _req(f"r{i}", list(range(100)))
        r.num_computed_tokens = 99
        reqs.append(r)
    return reqs


def _train(policy: SpecPolicy, req: Request, accept: float, times: int = 30) -> None:
    """Verifications of 4 drafts where each is accepted with probability `accept` (deterministic runs)."""
    rng = random.Random(0)
    for _ in range(times):
        n = 0
        while n < 4 and rng.random() < accept:
            n += 1
        policy.observe(req, 4, n)


def test_acceptance_rate_estimates_the_per_token_probability() -> None:
    rate = AcceptanceRate(0.5, 0.98)
    rng = random.Random(0)
    for _ in range(2000):
        n = 0
        while n < 5 and rng.random() < 0.7:
            n += 1
        rate.observe(5, n)
    assert rate.rate == pytest.approx(0.7, abs=0.05)


def test_policy_on_at_batch_1_with_high_acceptance() -> None:
    policy = SpecPolicy(4, True, synthetic(10e-3, 0.5e-3))
    [req] = _reqs(1)
    _train(policy, req, 0.9)
    assert policy.plan([req]) and policy.k_for[req.request_id] == 4
    assert policy.state == "on"


def test_policy_off_at_low_acceptance() -> None:
    policy = SpecPolicy(4, True, synthetic(10e-3, 0.5e-3))
    [req] = _reqs(1)
    _train(policy, req, 0.0)
    assert not policy.plan([req])
    assert policy.disabled_steps == {"low_acceptance": 1} and policy.state == "low_acceptance"
    for _ in range(PROBE_ALONE - 2):
        assert not policy.plan([req])
    assert policy.plan([req]) and policy.k_for[req.request_id] == 1  # alone in its step: a probe after PROBE_ALONE


def test_probes_ride_in_steps_that_draft_anyway() -> None:
    policy = SpecPolicy(4, True, synthetic(10e-3, 0.5e-3))
    good, poor = _reqs(2)
    _train(policy, good, 0.95)
    _train(policy, poor, 0.0)
    probes = 0
    for _ in range(2 * PROBE_EVERY):
        assert policy.plan([good, poor]) and policy.k_for[good.request_id] > 0
        probes += policy.k_for[poor.request_id]
    assert probes == 2  # one draft every PROBE_EVERY steps


def test_draft_overhead_fit() -> None:
    """Residuals b + e0 + e1 n (with the odd slow step) give back b, e0 and e1; one draft count seen: all of it
    per step; more drafts costing less: all of it per step too."""
    rng = random.Random(0)
    oh = DraftOverhead()
    for i in range(200):
        n = i % 5
        slow = 0.05 if i % 37 == 0 else 0.0
        oh.observe(n, 0.001 + (0.003 + 0.002 * n if n else 0.0) + rng.gauss(0, 2e-4) + slow)
    assert oh.fitted
    assert (oh.bias, oh.fixed, oh.per_draft) == pytest.approx((0.001, 0.003, 0.002), abs=3e-4)
    one = DraftOverhead()
    for i in range(40):
        one.observe(i % 2, 0.001 + 0.004 * (i % 2))
    assert (one.fixed, one.per_draft) == pytest.approx((0.004, 0.0), abs=1e-9)
    odd = DraftOverhead()
    for i in range(60):
        n = i % 3
        odd.observe(n, {0: 0.0, 1: 0.006, 2: 0.004}[n])
    assert odd.per_draft == 0.0 and odd.fixed == pytest.approx(0.005)


def test_policy_weighs_the_measured_overhead_of_drafting() -> None:
    """Drafts the roofline calls cheap (0.5 ms) at acceptance 0.25: worth it until the steps that carry drafts are
    measured 6 ms slower; then off, reason low_acceptance."""
    policy = SpecPolicy(4, True, synthetic(10e-3, 0.5e-3))
    [req] = _reqs(1)
    _train(policy, req, 0.25)
    assert policy.plan([req])
    for i in range(32):
        policy.observe_step(i % 2, 0.006 * (i % 2))
    assert policy.overhead.fixed == pytest.approx(0.006)
    assert not policy.plan([req]) and policy.disabled_steps == {"low_acceptance": 1}


def test_policy_off_when_compute_bound() -> None:
    """Per-token compute 2 ms, weights 10 ms: 1 decode is bandwidth-bound, 16 are compute-bound."""
    policy = SpecPolicy(4, True, synthetic(10e-3, 2e-3))
    reqs = _reqs(16)
    for r in reqs:
        _train(policy, r, 0.95)
    assert policy.plan(reqs[:1]) and policy.k_for["r0"] > 0
    assert not policy.plan(reqs)
    assert policy.disabled_steps == {"compute_bound": 1} and policy.state == "compute_bound"


def test_policy_chooses_k_per_request() -> None:
    """A predictable request gets more drafts than an unpredictable one in the same step; the plan maximises the
    step's expected tokens per second."""
    predict = synthetic(10e-3, 1e-3)
    policy = SpecPolicy(6, True, predict)
    good, poor = _reqs(2)
    _train(policy, good, 0.95)
    _train(policy, poor, 0.3)
    assert policy.plan([good, poor])
    kg, kp = policy.k_for[good.request_id], policy.k_for[poor.request_id]
    assert kg > kp

    def rate(k: dict[Request, int]) -> float:
        tokens = sum(sum(policy.rate(r) ** j for j in range(k[r] + 1)) for r in k)
        return tokens / predict([(99, 1 + n) for n in k.values()], 0)
    best = max(rate({good: a, poor: b}) for a in range(7) for b in range(7))
    assert rate({good: kg, poor: kp}) == pytest.approx(best)


def test_policy_weighs_the_prompts_drafts_delay() -> None:
    """A draft's time also delays the requests still prefilling: fewer drafts while prompts wait, none when many do
    (counted as prefill_pending), all of them again once every request decodes."""
    policy = SpecPolicy(4, True, synthetic(10e-3, 0.5e-3))
    [req] = _reqs(1)
    _train(policy, req, 0.9)
    ks = []
    for waiting in (0, 3, 9, 40, 0):
        assert policy.plan([req], num_prefilling=waiting) == (waiting < 40)
        ks.append(policy.k_for.get(req.request_id, 0))
    assert ks[0] == ks[1] == ks[4] == 4 and 0 < ks[2] < 4 and ks[3] == 0, ks
    assert policy.disabled_steps == {"prefill_pending": 1}


def _run_guard(guard: SpecGuard, rate: dict[bool, float], epochs: int, num_decodes: int = 4) -> list[bool]:
    """Feed the guard steps whose rate depends on its mode; the modes of each epoch."""
    modes = []
    for _ in range(epochs):
        on = guard.allow(num_decodes)
        modes.append(on)
        for _ in range(EPOCH_STEPS):
            guard.observe(num_decodes, num_decodes, num_decodes / rate[on])
    return modes


def test_guard_keeps_speculation_that_pays_and_stops_what_loses() -> None:
    """Measured faster with drafts: on, with rare trials of off. Measured 40 % slower: off after the first two
    epochs, trials of on ever rarer (at most 1 in MAX_INTERVAL + 1 epochs once settled). Buckets are separate."""
    wins = SpecGuard()
    modes = _run_guard(wins, {True: 150.0, False: 100.0}, 60)
    assert modes[:2] == [True, False] and sum(modes) >= 53 and wins.state() == {2: "on"}
    loses = SpecGuard()
    modes = _run_guard(loses, {True: 60.0, False: 100.0}, 60)
    assert modes[:2] == [True, False] and loses.state() == {2: "off"}
    trials = [i for i, on in enumerate(modes) if on][1:]
    assert len(trials) <= 6 and all(b - a >= 2 for a, b in zip(trials, trials[1:]))
    assert trials[-1] - trials[-2] == MAX_INTERVAL + 1
    assert loses.allow(1) and loses.allow(16)  # other batch sizes are measured on their own
    within = SpecGuard()  # within MARGIN of each other: speculation stays on
    _run_guard(within, {True: 99.0, False: 100.0}, 10)
    assert within.state() == {2: "on"}


def test_guard_follows_a_change() -> None:
    """Off while drafts lose; when they start to win, the next trial turns the bucket back on."""
    guard = SpecGuard()
    _run_guard(guard, {True: 60.0, False: 100.0}, 20)
    assert guard.state() == {2: "off"}
    modes = _run_guard(guard, {True: 200.0, False: 100.0}, 40)
    assert guard.state() == {2: "on"} and sum(modes[-10:]) >= 8


def test_spec_decoder_off_where_the_guard_measured_slower() -> None:
    spec = SpecDecoder(SpeculativeConfig("ngram", 2, 2, 2), predict=synthetic(10e-3, 0.5e-3))
    assert spec.guard is not None
    reqs = _reqs(4)
    spec.guard.buckets[2] = _Bucket(mode="off", best="off")  # 4 decodes: measured faster without drafts
    assert not spec.begin_step(reqs) and spec.stats.disabled_steps == {"measured_slower": 1}
    always = SpecDecoder(SpeculativeConfig("ngram", 2, 2, 2, policy="always"), predict=synthetic(10e-3, 0.5e-3))
    assert always.guard is None and always.begin_step(reqs)


def test_policy_always_and_unfitted_model_draft_k() -> None:
    reqs = _reqs(3)
    always = SpecPolicy(3, False, synthetic(1e-3, 1.0))
    assert always.plan(reqs) and set(always.k_for.values()) == {3}
    unfitted = SpecPolicy(3, True, lambda seqs, n: None)
    assert unfitted.plan(reqs) and set(unfitted.k_for.values()) == {3}


def test_spec_decoder_counts_batch_size_switch() -> None:
    config = SpeculativeConfig("ngram", 2, 2, 2, disable_by_batch_size=1, policy="always")
    spec = SpecDecoder(config)
    reqs = _reqs(2)
    assert not spec.begin_step(reqs) and spec.stats.disabled_steps == {"batch_size": 1}
    assert spec.begin_step(reqs[:1])


# ---- the engine under auto -----------------------------------------------------------------------------------------
def test_auto_policy_turns_off_on_random_tokens_output_equal(make_llm: Any, tokenizer: Any) -> None:
    """Random prompts on the tiny model with a synthetic compute-bound cost model: no drafts, reason counted, and
    the output equals plain decoding; on a bandwidth-bound one the repetitive prompt speculates."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(60)] for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in make_llm().generate([{"prompt_token_ids": p} for p in prompts], params)]
    llm = make_llm(speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    spec = llm.engine.spec
    spec.policy.predict = synthetic(1e-3, 1e-3)  # 4 decodes: 4 ms of compute against 1 ms of weights
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == want
    assert spec.stats.num_draft_tokens == 0 and spec.stats.disabled_steps.get("compute_bound", 0) > 0
    assert llm.engine.block_manager.is_at_baseline()


def test_disabled_steps_metric() -> None:
    from prometheus_client import generate_latest

    from pdserve.server.metrics import Metrics

    m = Metrics("tiny")
    spec = SpecDecoder(SpeculativeConfig("ngram", 2, 2, 2, disable_by_batch_size=1, policy="auto"),
                       predict=synthetic(1e-3, 1e-3))
    reqs = _reqs(2)
    spec.begin_step(reqs)  # two decodes: batch_size
    m.observe_spec(spec.stats)
    spec.begin_step(reqs[:1])  # one decode, 1 ms of compute against 1 ms of weights: compute_bound
    spec.begin_step(reqs[:1])
    m.observe_spec(spec.stats)
    text = generate_latest(m.registry).decode()
    assert 'pdserve:spec_decode_disabled_steps_total{model_name="tiny",reason="batch_size"} 1.0' in text
    assert 'pdserve:spec_decode_disabled_steps_total{model_name="tiny",reason="compute_bound"} 2.0' in text


# ---- the real default model ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_model_greedy_equal_every_method() -> None:
    """SmolLM2-135M: chat-templated "edit this code" and free prompts, greedy output with speculation (ngram and
    suffix, policy always and auto, a mixed batch) equals plain decoding; the edit prompt's drafts are accepted."""
    from pdserve.llm import LLM

    code = "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n"
    edit = f"Rename `xs` to `values`, keep the rest unchanged:\n```python\n{code}```"
    prompts = [[{"role": "user", "content": edit}],
               [{"role": "user", "content": "写一首关于秋天的短诗。"}],
               [{"role": "user", "content": "Why is the sky blue?"}]]
    params = SamplingParams(temperature=0, max_tokens=48)
    opts: dict[str, Any] = {"dtype": "float32", "kv_cache_memory": "256MiB", "max_num_batched_tokens": 128,
                            "num_threads": 1}
    base = LLM(**opts)
    want = [o.outputs[0].text for o in base.chat(prompts, params)]
    del base
    for spec in ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
                  "policy": "always"},
                 {"method": "suffix", "num_speculative_tokens": 8, "policy": "always"},
                 {"method": "suffix", "num_speculative_tokens": 8}):
        llm = LLM(**opts, speculative_config=spec)
        assert [o.outputs[0].text for o in llm.chat(prompts, params)] == want, spec
        assert llm.engine.block_manager.is_at_baseline()
        if spec.get("policy") == "always":
            assert llm.engine.spec.stats.num_accepted_tokens > 0, spec
        del llm

"""Sampling: seeds reproduce whatever the batch, top_k=1 is greedy, stop strings cut exactly, penalties, logprobs."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest
import torch

from pdserve import SamplingParams
from pdserve.model.input_batch import InputBatch
from pdserve.model.inputs import NewRequestData
from pdserve.model.sampler import Sampler, apply_penalties, apply_top_k_top_p_min_p
from pdserve.model.sampling_metadata import SamplingMetadata

PROMPT = "Once upon a time, in a land far away,"


def _text(llm: Any, prompt: Any, **kw: Any) -> Any:
    return llm.generate(prompt, SamplingParams(**kw))[0].outputs[0]


def test_seeded_sampling_reproduces_alone_and_in_batch(make_llm: Any) -> None:
    llm = make_llm()
    kw = dict(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = _text(llm, PROMPT, **kw).token_ids
    assert _text(llm, PROMPT, **kw).token_ids == alone
    rng = random.Random(1)
    others = [{"prompt_token_ids": [rng.randrange(3, 49152) for _ in range(rng.randrange(5, 90))]} for _ in range(9)]
    params = [SamplingParams(temperature=0.8, max_tokens=rng.randrange(4, 30), ignore_eos=True) for _ in others]
    outs = llm.generate(others[:5] + [PROMPT] + others[5:], params[:5] + [SamplingParams(**kw)] + params[5:])
    assert outs[5].outputs[0].token_ids == alone
    assert _text(llm, PROMPT, **{**kw, "seed": 99}).token_ids != alone


def test_top_k_1_equals_greedy(make_llm: Any) -> None:
    llm = make_llm()
    greedy = _text(llm, PROMPT, temperature=0, max_tokens=24, ignore_eos=True).token_ids
    assert _text(llm, PROMPT, temperature=1.3, top_k=1, max_tokens=24, ignore_eos=True).token_ids == greedy


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_text_exactly(make_llm: Any, include: bool) -> None:
    llm = make_llm()
    full = _text(llm, PROMPT, temperature=0, max_tokens=40, ignore_eos=True).text
    stop = full[15:19]
    cut = full.find(stop)
    out = _text(llm, PROMPT, temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "\x00never"],
                include_stop_str_in_output=include)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == (full[:cut + len(stop)] if include else full[:cut])
    assert llm.engine.block_manager.is_at_baseline()


def test_stop_token_ids_and_max_tokens(make_llm: Any) -> None:
    llm = make_llm()
    greedy = _text(llm, PROMPT, temperature=0, max_tokens=20, ignore_eos=True)
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 20
    tok = greedy.token_ids[5]
    first = greedy.token_ids.index(tok)
    out = _text(llm, PROMPT, temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[tok])
    assert out.finish_reason == "stop" and out.stop_reason == tok and out.token_ids == greedy.token_ids[:first + 1]
    # min_tokens bans the stop token until enough tokens exist
    out = _text(llm, PROMPT, temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[tok],
                min_tokens=first + 2)
    assert len(out.token_ids) >= first + 2


def test_n_outputs_and_seeds(make_llm: Any) -> None:
    llm = make_llm()
    out = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_logprobs_match_model_distribution(make_llm: Any, tiny_hf_model: Any, tokenizer: Any) -> None:
    llm = make_llm()
    ids = tokenizer.encode(PROMPT)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=3, logprobs=5,
                                                                 ignore_eos=True))[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 3
    with torch.no_grad():
        ref = tiny_hf_model(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0] and first.rank == 1
    assert len(first.top) == 5 and first.top[0][0] == first.token_id
    vals, idx = ref.topk(5)
    assert [t for t, _ in first.top] == idx.tolist()
    assert all(math.isclose(a, b, abs_tol=1e-4) for (_, a), b in zip(first.top, vals.tolist()))
    assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs))


def _req(output: list[int], prompt: list[int] | None = None, **kw: Any) -> NewRequestData:
    return NewRequestData("x", prompt or [0], SamplingParams(**kw), frozenset({2}), output_token_ids=output)


def _md(reqs: list[NewRequestData]) -> SamplingMetadata:
    """The rows of these requests as the runner gathers them (a fresh batch: seeded generators start anew)."""
    batch = InputBatch()
    for i, r in enumerate(reqs):
        batch.add(dataclasses.replace(r, req_id=f"r{i}"))
    return batch.sampling_metadata([f"r{i}" for i in range(len(reqs))])


def _penalties(reqs: list[NewRequestData]) -> Any:
    pen = _md(reqs).penalties
    assert pen is not None
    return pen


def test_penalties_formulae() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    apply_penalties(logits, _penalties([_req([0, 0, 1], prompt=[2], repetition_penalty=2.0)]))
    assert logits.tolist() == [[1.0, -4.0, 0.5, 0.5]]  # seen (prompt or output): positive / 2, negative * 2
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    apply_penalties(logits, _penalties([_req([0, 0, 1], frequency_penalty=0.5, presence_penalty=0.25)]))
    assert logits.tolist() == [[2.0 - 1.0 - 0.25, -2.0 - 0.5 - 0.25, 1.0, 0.5]]


def test_top_k_top_p_min_p_masks() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = lambda x: torch.isfinite(x)[0].tolist()  # noqa: E731
    one, half, zero = torch.tensor([1.0]), torch.tensor([0.45]), torch.tensor([0.0])
    assert kept(apply_top_k_top_p_min_p(logits, torch.tensor([2]), one, zero)) == [True, True, False, False]
    assert kept(apply_top_k_top_p_min_p(logits, torch.tensor([0]), torch.tensor([0.7]), zero)) == [True, True,
                                                                                                    False, False]
    assert kept(apply_top_k_top_p_min_p(logits, torch.tensor([0]), torch.tensor([0.85]), zero)) == [True, True,
                                                                                                     True, False]
    assert kept(apply_top_k_top_p_min_p(logits, torch.tensor([0]), one, torch.tensor([0.25]))) == [True, True,
                                                                                                    True, False]
    assert kept(apply_top_k_top_p_min_p(logits, torch.tensor([0]), half, zero)) == [True, False, False, False]


def test_min_tokens_bans_eos_and_seeded_distribution() -> None:
    sampler = Sampler()
    logits = torch.tensor([[0.0, 0.0, 10.0, 1.0]])  # EOS (id 2) dominates
    assert sampler(logits.clone(), _md([_req([], temperature=0)])).token_ids == [2]
    assert sampler(logits.clone(), _md([_req([], temperature=0, min_tokens=1)])).token_ids == [3]
    # the exponential race samples from softmax(logits / T): check frequencies with a seeded generator
    logits = torch.tensor([[0.0, math.log(3.0)]])
    req = _req([], temperature=1.0, seed=0)
    md = _md([req])  # the generator is the request's (in the runner's batch): draws continue its stream
    draws = [sampler(logits.clone(), md).token_ids[0] for _ in range(4000)]
    assert abs(sum(draws) / 4000 - 0.75) < 0.03


def test_mixed_batch_rows_keep_their_own_mode() -> None:
    """Greedy, unseeded and seeded rows in one batch: each row is drawn from its own distribution."""
    sampler = Sampler()
    row = [0.0, math.log(3.0), -1e9]
    logits = torch.tensor([row, [5.0, 0.0, 0.0], row, row])
    reqs = [_req([], temperature=1.0), _req([], temperature=0), _req([], temperature=1.0, seed=1),
            _req([], temperature=0.5, top_k=1)]
    md = _md(reqs)
    counts = [0, 0, 0, 0]
    for _ in range(3000):
        toks = sampler(logits.clone(), md).token_ids
        assert toks[1] == 0 and toks[3] == 1 and 2 not in toks
        counts = [c + t for c, t in zip(counts, toks)]
    assert abs(counts[0] / 3000 - 0.75) < 0.035 and abs(counts[2] / 3000 - 0.75) < 0.035


def test_invalid_sampling_params() -> None:
    for kw in [dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(max_tokens=0), dict(n=0),
               dict(min_tokens=5, max_tokens=2), dict(logprobs=50), dict(presence_penalty=3)]:
        with pytest.raises(ValueError):
            SamplingParams(**kw)


# ---------------------------------------------------------------- abuse: validation, isolation, logit_bias


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=float("inf")), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=float("nan")), "top_p"), (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(top_k=2**63), "top_k"), (dict(top_k=1.5), "top_k"), (dict(seed=2**70), "seed"),
    (dict(seed=-(2**63) - 1), "seed"), (dict(seed=2**63 - 1, n=2), "seed"), (dict(stop=["x"] * 65), "stop"),
    (dict(stop=["长" * 1025]), "stop"), (dict(stop_token_ids=list(range(1025))), "stop_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(logit_bias={5: 101}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"), (dict(logit_bias={-1: 1}), "logit_bias"),
    (dict(logit_bias={"x": 1}), "logit_bias"), (dict(logit_bias={i: 1 for i in range(1025)}), "logit_bias"),
])
def test_sampling_params_bounds_name_the_field(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_sampling_params_limits_accepted() -> None:
    p = SamplingParams(stop=["停" * 1024] * 64, seed=2**63 - 1, top_k=2**31 - 1, logit_bias={"7": -100, 8: 100.0})
    assert p.logit_bias == {7: -100.0, 8: 100.0}  # JSON object keys arrive as strings


def test_engine_rejects_token_ids_outside_vocab(make_llm: Any) -> None:
    from pdserve.errors import ErrorCode, RequestRejected

    engine = make_llm().engine
    vocab = engine.arch.vocab_size
    for kw, param in [(dict(min_tokens=1, stop_token_ids=[vocab + 5]), "stop_token_ids"),
                      (dict(stop_token_ids=[vocab]), "stop_token_ids"), (dict(logit_bias={vocab: 5}), "logit_bias")]:
        with pytest.raises(RequestRejected) as e:
            engine.make_request(PROMPT, SamplingParams(**kw))
        assert e.value.param == param and e.value.code == ErrorCode.INVALID_PARAMETER and str(vocab) in str(e.value)


def test_row_whose_sampling_raises_fails_alone() -> None:
    """Fault injection below validation: rows the sampler cannot handle (a logit_bias id or a banned id outside
    the vocabulary) fail alone; the other rows get the tokens they get without them, seeded draws included."""
    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 3
    good = [_req([], temperature=0), _req([], temperature=0.8, seed=3), _req([], temperature=0.7, top_k=5, seed=4)]
    bad_bias = _req([], temperature=1.0)
    bad_bias.sampling_params.logit_bias = {10**6: 1.0}  # what validation refuses: an id outside the vocabulary
    bad_banned = _req([], temperature=0, min_tokens=1, stop_token_ids=[55])
    alone = Sampler()(logits[[0, 2, 4]].clone(), _md(good)).token_ids
    before = logits.clone()
    out = Sampler()(logits, _md([good[0], bad_bias, good[1], bad_banned, good[2]]))  # fresh generators again
    assert torch.equal(logits, before)  # never modified: the per-row fallback samples the original logits
    assert [out.token_ids[i] for i in (0, 2, 4)] == alone
    assert out.errors[0] is None and out.errors[2] is None and out.errors[4] is None
    assert out.errors[1] and out.errors[3] and out.token_ids[1] == out.token_ids[3] == -1


def test_engine_fails_only_the_row_whose_sampling_raises(make_llm: Any) -> None:
    from pdserve.errors import ErrorCode

    llm = make_llm()
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [PROMPT, "你好，世界！请介绍一下你自己。", "The quick brown fox"]
    alone = [_text(llm, p, temperature=0, max_tokens=6, ignore_eos=True).token_ids for p in prompts]
    engine = llm.engine
    vocab = engine.arch.vocab_size
    bad = engine.make_request("poison", SamplingParams(max_tokens=6, min_tokens=2), request_id="bad")
    bad.sampling_params.stop_token_ids = [vocab + 5]  # bypasses the validation the server relies on
    reqs = [engine.add_request(p, greedy, request_id=f"good-{i}") for i, p in enumerate(prompts)]
    engine.add_request(bad)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            if out.finished:
                finals[out.request_id] = out
    assert finals["bad"].error_code == ErrorCode.SAMPLING_FAILED and "sampling failed" in (finals["bad"].error or "")
    assert [finals[r.request_id].outputs[0].token_ids for r in reqs] == alone
    assert engine.block_manager.is_at_baseline()


def test_logit_bias_steers_greedy_and_sampling(make_llm: Any) -> None:
    llm = make_llm()
    kw: dict[str, Any] = dict(max_tokens=8, ignore_eos=True)
    greedy = _text(llm, PROMPT, temperature=0, **kw).token_ids
    target = 12345
    assert target not in greedy
    assert _text(llm, PROMPT, temperature=0, logit_bias={target: 100}, **kw).token_ids == [target] * 8
    assert _text(llm, PROMPT, temperature=1.0, seed=1, logit_bias={str(target): 100}, **kw).token_ids == [target] * 8
    banned = {t: -100.0 for t in set(greedy)}
    out = _text(llm, PROMPT, temperature=0, logit_bias=banned, **kw).token_ids
    assert not set(out) & set(greedy)
    sampled = _text(llm, PROMPT, temperature=1.0, seed=2, logit_bias={greedy[0]: -100}, max_tokens=1).token_ids
    assert sampled != greedy[:1]
    assert llm.engine.block_manager.is_at_baseline()


def test_logit_bias_applies_before_penalties_and_min_tokens() -> None:
    logits = torch.tensor([[0.0, 0.0, 10.0, 1.0]])
    md = _md([_req([], temperature=0, min_tokens=1, logit_bias={2: 50, 0: 20})])
    assert Sampler()(logits, md).token_ids == [0]  # EOS (2) still banned below min_tokens; 0 now wins
    md = _md([_req([0], temperature=0, frequency_penalty=2, logit_bias={0: 3, 3: 1})])
    assert Sampler()(torch.tensor([[0.0, 0.0, -5.0, 0.5]]), md).token_ids == [3]  # 0+3-2 = 1 < 0.5+1


def _sorted_reference(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The masks by their definition: sort the whole row, keep the first k, then the smallest prefix whose mass
    (renormalised over the kept k) reaches top_p; top_p = 1 keeps every token (no float cumsum decides)."""
    out = torch.full_like(logits, float("-inf"))
    for r in range(logits.shape[0]):
        vals, order = logits[r].sort(descending=True)
        k = int(top_k[r]) if int(top_k[r]) > 0 else logits.shape[1]
        vals, order = vals[:k], order[:k]
        probs = vals.softmax(-1)
        keep = (probs.cumsum(-1) - probs) < float(top_p[r])
        if float(top_p[r]) >= 1:
            keep[:] = True
        out[r, order[keep]] = vals[keep]
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_top_k_top_p_candidates_equal_the_whole_sort(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows masked from their best candidates and rows that need the whole sort (a flat distribution whose nucleus
    is larger than the candidates, or a k larger than them) give the masks of the definition; unfiltered rows stay."""
    from pdserve.model import sampler

    monkeypatch.setattr(sampler, "NUCLEUS_CANDIDATES", (16, 64))
    g = torch.Generator().manual_seed(seed)
    v = 1000
    peaked = torch.randn(6, v, generator=g) * 6
    flat = torch.randn(4, v, generator=g) * 0.1
    logits = torch.cat([peaked, flat])
    top_k = torch.tensor([0, 5, 64, 0, 200, 0, 0, 7, 300, 0])
    top_p = torch.tensor([0.9, 1.0, 0.8, 0.5, 0.95, 1.0, 0.9, 0.99, 1.0, 1.0])
    got = apply_top_k_top_p_min_p(logits, top_k, top_p, torch.zeros(10))
    ref = _sorted_reference(logits, top_k, top_p)
    assert torch.equal(got.isinf(), ref.isinf())  # the same tokens kept in every row ...
    assert torch.equal(got[~got.isinf()], logits[~got.isinf()])  # ... with their logits unchanged
    assert torch.equal(got[5], logits[5]) and torch.equal(got[9], logits[9])  # no filter: the row as it was
    kept = (~got.isinf()).sum(-1)
    assert kept[6] > 64 and kept[8] == 300  # these rows needed the whole sort


def test_top_p_flat_row_alone_and_p1_rows_keep_their_sets() -> None:
    """The PyTorch path: a flat row whose best candidates hold under a quarter of its top_p is masked by the
    whole-row pass even when no other row needs the larger candidate sets (it kept nothing before), and a row without
    top-p beside rows with it keeps its whole tail (float cumulative sums reach 1 before the end)."""
    g = torch.Generator().manual_seed(3)
    flat = torch.randn(1, 49152, generator=g) * 0.3
    got = apply_top_k_top_p_min_p(flat, torch.tensor([0]), torch.tensor([0.5]), torch.zeros(1))
    kept = int((got > float("-inf")).sum())
    probs = flat[0].double().softmax(-1).sort(descending=True).values
    assert kept == int(((probs.cumsum(0) - probs) < 0.5).sum())
    peaked = torch.randn(2, 1000, generator=g) * 40
    got = apply_top_k_top_p_min_p(peaked, torch.tensor([0, 30]), torch.tensor([0.9, 1.0]), torch.zeros(2))
    assert int((got[1] > float("-inf")).sum()) == 30

"""Step budget: the step-time model fitted to (FLOPs, bytes) and the prefill cap it puts on steps with decodes."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve import SamplingParams
from pdserve.engine.step_budget import MIN_OBSERVATIONS, StepBudget, StepTimeModel, token_budget
from pdserve.roofline import StepCostModel


def cost_model() -> StepCostModel:
    return StepCostModel(layer_params=100_000_000, lm_head_params=28_000_000, layer_weight_bytes=66_000_000,
                         lm_head_bytes=30_000_000, embed_row_bytes=2304, kv_bytes_per_token=23040,
                         attn_flops_per_pair=4 * 30 * 9 * 64)


def true_time(flops: float, nbytes: float) -> float:
    return 0.002 + nbytes / 10e9 + flops / 100e9  # a 10 GB/s, 100 GFLOP/s machine with 2 ms of fixed cost


def fitted_budget(max_step_ms: float | None = None) -> StepBudget:
    budget = StepBudget(cost_model(), max_step_ms)
    for batch, prefill in [(b, p) for b in (1, 4, 16, 32) for p in (0, 16, 64, 256, 512)]:
        seqs = [(200, 1)] * batch + ([(0, prefill)] if prefill else [])
        flops, nbytes = budget.cost.cost(seqs, batch + bool(prefill))
        budget.observe(flops, nbytes, true_time(flops, nbytes))
    return budget


def test_time_model_recovers_a_linear_machine() -> None:
    model = StepTimeModel()
    assert model.predict(1e9, 1e8) is None
    for i in range(MIN_OBSERVATIONS + 4):
        flops, nbytes = 1e9 * (1 + i % 5) ** 2, 1e8 * (1 + i % 3)
        model.observe(flops, nbytes, true_time(flops, nbytes))
    for flops, nbytes in [(3e9, 2e8), (5e10, 1e8)]:
        assert model.predict(flops, nbytes) == pytest.approx(true_time(flops, nbytes), rel=1e-6)


def test_time_model_coefficients_are_never_negative() -> None:
    model = StepTimeModel()
    for i in range(40):  # time falls as FLOPs rise: noise a plain fit would turn into a negative FLOP cost
        model.observe(1e9 * (i + 1), 1e8, 0.05 - 0.0001 * i)
    assert model.coef is not None and (model.coef >= 0).all()


def test_cap_keeps_mixed_step_within_ratio_of_decodes_alone() -> None:
    budget = fitted_budget()
    decodes = [(200, 1)] * 16
    cap = budget.prefill_cap(decodes, 512, formed=16, backlog=1 << 20)  # a backlog that needs the upper bound
    assert cap is not None and budget.min_chunk <= cap < 512
    alone = true_time(*budget.cost.cost(decodes, 16))
    assert true_time(*budget.cost.cost([*decodes, (0, cap)], 17)) <= 3 * alone * 1.001
    assert true_time(*budget.cost.cost([*decodes, (0, cap + 1)], 17)) > 3 * alone * 0.999


def test_bound_grows_with_the_backlog_between_the_formed_batch_and_the_ratio() -> None:
    budget = fitted_budget()
    budget.tail_ratio = 2.0  # this synthetic machine's prefill tokens are dear: a bound above one min_chunk
    t = lambda seqs: true_time(*budget.cost.cost(seqs, len(seqs)))  # noqa: E731

    def fits(decodes: list[tuple[int, int]], cap: int | None, limit: float) -> bool:  # the largest chunk within
        return cap is not None and t([*decodes, (0, cap)]) <= limit * 1.001 < t([*decodes, (0, cap + 1)]) * 1.002

    decodes = [(200, 1)] * 16
    loose = budget.prefill_cap(decodes, 512, formed=16, backlog=1 << 20)
    tight = budget.prefill_cap(decodes, 512, formed=16, backlog=0)
    assert loose is not None and tight is not None and budget.min_chunk <= tight < loose
    assert fits(decodes, tight, budget.tail_ratio * t(decodes)) and fits(decodes, loose, budget.ratio * t(decodes))
    # a backlog whose prefill, spread over `horizon` steps, needs more than the tail bound: the bound follows it
    backlog = 768
    drain = t([(0, 512)]) * backlog / 512
    assert budget.tail_ratio * t(decodes) < t(decodes) + drain / budget.horizon < budget.ratio * t(decodes)
    assert fits(decodes, budget.prefill_cap(decodes, 512, formed=16, backlog=backlog),
                t(decodes) + drain / budget.horizon)
    # few decodes while many wait: the tail bound is the full batch's step, not a multiple of the few's
    few = [(200, 1)] * 2
    limit = min(budget.ratio * t(few), budget.tail_ratio * t([(200, 1)] * 32))
    assert fits(few, budget.prefill_cap(few, 512, formed=32, backlog=0), limit)


def test_cap_absolute_and_off_and_without_decodes() -> None:
    budget = fitted_budget(max_step_ms=100)
    decodes = [(200, 1)] * 4
    cap = budget.prefill_cap(decodes, 512)
    assert cap is not None
    assert budget.min_chunk < cap and true_time(*budget.cost.cost([*decodes, (0, cap)], 5)) <= 0.100 * 1.001
    assert budget.prefill_cap([], 512) is None  # no decodes: prefill is never capped (TTFT)
    assert fitted_budget(max_step_ms=0).prefill_cap(decodes, 512) is None
    assert fitted_budget(max_step_ms=1).prefill_cap(decodes, 512) == budget.min_chunk  # always some progress
    assert budget.prefill_cap(decodes, 512, formed=32, backlog=10) == cap  # an absolute bound is the bound
    assert StepBudget(cost_model(), None).prefill_cap(decodes, 512) is None  # not fitted yet


def test_a_burst_is_not_capped_unless_the_bound_is_absolute() -> None:
    """At least half as many requests waiting for their prompt as decoding: the step takes the prompts whole;
    fewer: the default bound; an absolute --max-step-ms bound holds for bursts too."""
    budget = fitted_budget()
    decodes = [(200, 1)] * 8
    capped = budget.prefill_cap(decodes, 512, formed=16, backlog=4096, pending=3)
    assert capped is not None and capped < 512
    assert budget.prefill_cap(decodes, 512, formed=16, backlog=4096, pending=4) is None
    assert budget.prefill_cap([(200, 1)], 512, formed=32, backlog=4096, pending=31) is None
    assert fitted_budget(max_step_ms=20).prefill_cap(decodes, 512, formed=16, backlog=4096, pending=8) is not None


def test_the_default_token_budget_follows_the_model_width(make_llm: Any) -> None:
    """2048 tokens a step unless that holds over 32 MiB of activations: SmolLM2-135M and Gemma 3 270M 2048,
    Qwen2.5-0.5B 1024, the 1.7B and 7B Llama shapes 512 (never below); the engine resolves the default from its model
    and keeps an explicit budget."""
    assert token_budget(576, 960) == 2048
    assert token_budget(640, 1536) == 2048
    assert token_budget(896, 1152) == 1024
    assert token_budget(2048, 6144) == 512
    assert token_budget(4096, 12288) == 512
    assert token_budget(8192, 10240) == 512
    eng = make_llm().engine
    a = eng.arch
    expected = token_budget(a.hidden_size, (a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim)
    assert eng.scheduler.max_num_batched_tokens == eng.config.max_num_batched_tokens == expected
    assert make_llm(max_num_batched_tokens=96).engine.scheduler.max_num_batched_tokens == 96


class FixedCap:
    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.seen: list[int] = []
        self.pending: list[int] = []

    def prefill_cap(self, decodes: Any, max_tokens: int, formed: int = 0, backlog: int = 0, pending: int = 0) -> int:
        self.seen.append(len(decodes))
        self.pending.append(pending)
        return self.cap


def test_scheduler_applies_the_cap_to_new_and_running_prefills(make_llm: Any) -> None:
    eng = make_llm(max_num_batched_tokens=256).engine
    a = eng.add_request({"prompt_token_ids": list(range(100, 110))}, SamplingParams(max_tokens=30, ignore_eos=True))
    eng.step()
    eng.scheduler.step_budget = FixedCap(24)
    b = eng.add_request({"prompt_token_ids": list(range(200, 300))}, SamplingParams(max_tokens=2, ignore_eos=True))
    chunks = []
    while b.num_output_tokens == 0:
        sched_tokens = b.num_computed_tokens
        eng.step()
        chunks.append(b.num_computed_tokens - sched_tokens)
    assert chunks == [24, 24, 24, 24, 4] and a.num_output_tokens == 6  # a decoded in every step
    assert eng.scheduler.step_budget.seen[0] == 1
    assert eng.scheduler.step_budget.pending == [1] * 5  # b, waiting, then part-way through its prompt
    eng.abort_request([a.request_id, b.request_id])
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.block_manager.is_at_baseline()

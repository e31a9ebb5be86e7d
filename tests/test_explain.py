"""Per-request explanations: the engine's StepLog and RequestExplainer name the cause of each inter-token stall."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.engine.explain import ExplanationHistory, RequestExplainer, StallThreshold
from pdserve.engine.request import Request
from pdserve.engine.step_log import StepLog
from pdserve.sampling_params import SamplingParams


def test_threshold_parse() -> None:
    assert StallThreshold.parse("3x") == StallThreshold(factor=3.0)
    assert StallThreshold.parse("50ms") == StallThreshold(seconds=0.05)
    assert StallThreshold.parse("0.2") == StallThreshold(seconds=0.2)
    assert StallThreshold.parse("2x").of([0.01, 0.01, 0.03]) == pytest.approx(0.02)
    for bad in ("", "x", "-1", "0x", "fast"):
        with pytest.raises(ValueError):
            StallThreshold.parse(bad)


def _decoding_request(token_times: list[float]) -> Request:
    req = Request("A", [1, 2, 3], SamplingParams(max_tokens=len(token_times)), {2}, len(token_times),
                  arrival_time=0.0)
    req.times.first_scheduled = 0.001
    req.times.prefill_chunks.append((token_times[0], 3))
    req.times.first_token = token_times[0]
    req.times.token_times = list(token_times)
    req.times.finished = token_times[-1]
    return req


def test_each_cause_from_a_constructed_step_log() -> None:
    """Tokens every 10 ms; gap 3 is a step carrying B's 256-token chunk, gap 5 one where A was preempted and
    recomputed, gap 7 two steps without A, gap 9 a grammar-heavy step. Relative default threshold (2x median)."""
    log = StepLog(size=64)
    times = [0.01 * i for i in range(1, 13)]
    times[3:] = [t + 0.03 for t in times[3:]]  # gap before token 3: 40 ms
    times[5:] = [t + 0.03 for t in times[5:]]
    times[7:] = [t + 0.03 for t in times[7:]]
    times[9:] = [t + 0.03 for t in times[9:]]
    req = _decoding_request(times)
    req.times.preemptions.append(times[4] + 0.005)
    for k, end in enumerate(times):
        chunks: tuple[tuple[str, int], ...] = ()
        grammar = 0.0
        if k == 3:
            chunks = (("B", 256), ("A-sibling", 8))
        elif k == 5:
            chunks = (("A", 5),)
        elif k == 7:
            log.append(end - 0.03, end - 0.015, "decode", 3, (), (), 0.0, 0.0, 0.01)  # A not in these two
            log.append(end - 0.015, end - 0.01, "decode", 3, (), (), 0.0, 0.0, 0.005)
        elif k == 9:
            grammar = 0.03
        log.append(end - 0.01, end, "mixed" if chunks else "decode", 1, chunks, (), grammar, 0.0, 0.008)
    ex = RequestExplainer(log).explain(req.request_id, req.times, "length")
    assert ex["itl_median_s"] == pytest.approx(0.01)
    stalls = {s["token_index"]: s for s in ex["stalls"]}
    assert sorted(stalls) == [3, 5, 7, 9]
    chunk_causes = [c for c in stalls[3]["causes"] if c["cause"] == "prefill_chunk"]
    assert chunk_causes[0] == {"cause": "prefill_chunk", "request_id": "B", "tokens": 256, "step": 3}
    assert stalls[3]["gap_s"] == pytest.approx(0.04)
    assert stalls[5]["causes"] == [{"cause": "preempted", "recomputed_tokens": 5}]
    assert stalls[7]["causes"] == [{"cause": "not_scheduled", "steps": 2}]
    assert stalls[9]["causes"] == [{"cause": "grammar", "seconds": 0.03}]
    events = [e["event"] for e in ex["timeline"]]
    assert events[0] == "queued" and "preempted" in events and events[-1] == "finished"
    assert "steps_dropped" not in ex


def test_a_ring_that_no_longer_reaches_the_request_says_so() -> None:
    log = StepLog(size=2)
    for i in range(5):
        log.append(i, i + 1.0, "decode", 1, (), (), 0.0, 0.0, 0.5)
    req = _decoding_request([1.0, 2.0, 3.0, 5.0])
    ex = RequestExplainer(log, StallThreshold(seconds=0.5)).explain(req.request_id, req.times)
    assert ex["steps_dropped"] is True
    assert [s["token_index"] for s in ex["stalls"]] == [1, 2, 3]


def test_history_is_bounded_and_finds_children() -> None:
    h = ExplanationHistory(size=3)
    for i in range(5):
        h.add(f"cmpl-{i}-0-0", {"i": i})
    assert h.get("cmpl-0-0-0") == [] and h.get("cmpl-4-0-0") == [{"i": 4}]
    assert h.get("cmpl-3") == [{"i": 3}]
    h.add("x-0-0", {"a": 1})
    h.add("x-0-1", {"a": 2})
    assert h.get("x") == [{"a": 1}, {"a": 2}]


def test_another_requests_prefill_chunk_in_a_decode_step_is_named(make_llm: Any) -> None:
    """The engine records real steps: A decodes, B's long prompt arrives, its chunks land in A's steps; A's
    explanation names B and the chunk's tokens (absolute threshold 0: every gap is explained)."""
    llm = make_llm(max_num_batched_tokens=64, enable_prefix_caching=False)
    eng = llm.engine
    a = eng.add_request(list(range(100, 110)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), "A")
    while a.num_output_tokens < 2:
        eng.step()
    b = eng.add_request(list(range(200, 350)), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), "B")
    chunk_steps = []
    while eng.has_unfinished_requests():
        before, a_running = b.num_computed_tokens, not a.is_finished
        eng.step()
        if a_running and before < b.num_prompt_tokens:
            chunk_steps.append(b.num_computed_tokens - before)
    assert chunk_steps == [63, 63, 24]  # a 64-token budget less A's decode
    ex = RequestExplainer(eng.step_log, StallThreshold(seconds=1e-9)).explain(a.request_id, a.times)
    named = [(c["request_id"], c["tokens"]) for s in ex["stalls"] for c in s["causes"]
             if c["cause"] == "prefill_chunk"]
    assert ("B", chunk_steps[0]) in named
    assert {n for _, n in named if _ == "B"} <= set(chunk_steps)
    assert all(c["cause"] == "slow_step" for s in ex["stalls"] for c in s["causes"] if c["cause"] != "prefill_chunk")
    assert len(ex["stalls"]) == a.num_output_tokens - 1
    assert eng.block_manager.num_used_blocks == 0

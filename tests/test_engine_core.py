"""The engine's seams: the scheduler as the one writer of request state (a stop string the output processor finds
finishes the request there, its blocks freed before the next step; a stop string at the max_tokens token wins, as
before), and the runner's persistent per-request sampling state (InputBatch: slots reused and grown, rare options
counted, rows gathered in step order)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pdserve import SamplingParams
from pdserve.model.input_batch import InputBatch
from pdserve.model.inputs import NewRequestData

PROMPT = {"prompt_token_ids": [300 + 7 * i for i in range(12)]}


def _greedy_tokens(llm: Any, n: int) -> list[int]:
    return list(llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
                .outputs[0].token_ids)


def _clean_stop(tokenizer: Any, tokens: list[int]) -> tuple[int, str]:
    """An output length n and a stop string that the n-th token completes (absent from the text before it)."""
    for n in range(4, len(tokens)):
        before, text = tokenizer.decode(tokens[:n - 1]), tokenizer.decode(tokens[:n])
        if "\ufffd" in text or not text.startswith(before) or len(text) == len(before) or not before:
            continue
        stop = text[len(before) - 1:]
        if stop.strip() and stop not in before:
            return n, stop
    pytest.skip("no token of this output completes a clean stop string")


def test_stop_string_finishes_the_request_in_the_scheduler(make_llm: Any, tokenizer: Any) -> None:
    llm = make_llm()
    tokens = _greedy_tokens(llm, 30)
    n, stop = _clean_stop(tokenizer, tokens)
    eng = llm.engine
    req = eng.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]), "s")
    final = None
    while final is None:
        final = next((o for o in eng.step().outputs if o.finished), None)
        # the step that found the stop string already freed the request: nothing of it is left for the next step
        if final is not None:
            assert "s" not in eng.scheduler.requests and not eng.block_manager.get_block_ids("s")
    comp = final.outputs[0]
    assert (comp.finish_reason, comp.stop_reason) == ("stop", stop)
    assert comp.token_ids == tokens[:n] and req.output_token_ids == tokens[:n]  # the scheduler dropped the rest
    assert req.status.finish_reason == "stop" and len(req.times.token_times) == n
    assert eng.block_manager.is_at_baseline()


def test_stop_string_at_the_max_tokens_token_wins(make_llm: Any, tokenizer: Any) -> None:
    llm = make_llm()
    tokens = _greedy_tokens(llm, 30)
    n, stop = _clean_stop(tokenizer, tokens)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, stop=[stop]))[0]
    comp = out.outputs[0]
    assert (comp.finish_reason, comp.stop_reason, comp.token_ids) == ("stop", stop, tokens[:n])
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=n - 1, ignore_eos=True, stop=[stop]))[0]
    assert plain.outputs[0].finish_reason == "length"  # one token earlier the string is not there yet


def _new(rid: str, **kw: Any) -> NewRequestData:
    return NewRequestData(rid, [1, 2, 3], SamplingParams(**kw), frozenset({2}))


def test_input_batch_slots_grow_and_are_reused() -> None:
    batch = InputBatch(capacity=2)
    for i in range(5):  # past the capacity: the matrices grow
        batch.add(_new(f"r{i}", temperature=0.5 + i, seed=i if i % 2 else None, logprobs=1 if i == 3 else None))
    assert len(batch) == 5 and batch.num_flagged[2] == 2 and batch.num_random == 5  # seeded: r1, r3
    md = batch.sampling_metadata(["r3", "r0", "r4"])  # any order: the step's
    assert md.temperature.tolist() == [3.5, 0.5, 4.5] and md.num_logprobs.tolist() == [1, -1, -1]
    assert md.generators[0] is not None and md.generators[1] is None and md.any_logprobs and not md.all_greedy
    freed = {batch.slots["r3"], batch.slots["r1"]}
    batch.remove("r3")
    batch.remove("r1")
    assert batch.num_flagged[2] == 0 and not batch.sampling_metadata(["r0"]).any_logprobs
    batch.add(_new("r5", temperature=0))
    assert batch.slots["r5"] in freed and len(batch) == 4  # a freed slot, reused
    assert batch.sampling_metadata(["r5"]).all_greedy and batch.sampling_metadata(["r5"]).generators == [None]


def test_input_batch_tracks_tokens_for_min_tokens_and_drafters() -> None:
    batch = InputBatch()
    batch.add(_new("a", temperature=0, min_tokens=2, stop_token_ids=[9], presence_penalty=0.5))
    assert batch.sampling_metadata(["a"]).banned == [(0, [9, 2])]
    batch.append("a", [7])
    md = batch.sampling_metadata(["a"], [[8, 6]])  # one sampled token: the ban holds for the first position only
    assert md.banned == [(0, [9, 2])] and md.spec is not None and md.num_rows == 3
    assert md.penalties is not None and md.penalties.output_token_ids == [[7], [7, 8], [7, 8, 6]]
    batch.append("a", [8])
    assert batch.all_token_ids("a") == [1, 2, 3, 7, 8] and batch.num_prompt_tokens("a") == 3
    assert batch.sampling_metadata(["a"]).banned == [] and np.array_equal(
        batch.sampling_metadata(["a"]).greedy, [True])

"""Request priority (vLLM's `priority`, lower first) under `scheduling_policy="priority"`: waiting order, preemption
victims, aging (the starvation bound), and the 400 for a non-zero priority under fcfs. The KV pool returns to
baseline after every run."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

from pdserve import SamplingParams
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.config import EngineConfig
from pdserve.engine.client import EngineClient
from pdserve.engine.engine import LLMEngine
from pdserve.errors import ErrorCode, RequestRejected
from pdserve.server.serving import RequestContext
from pdserve.server.serving_chat import OpenAIServingChat
from pdserve.server.serving_completion import OpenAIServingCompletion

from conftest import loaded_from_hf


def ids(n: int, start: int = 100) -> dict[str, list[int]]:
    return {"prompt_token_ids": [start + i for i in range(n)]}


def drain(engine: Any) -> None:
    while engine.has_unfinished_requests():
        engine.step()
    engine.block_manager.check_integrity()
    assert engine.block_manager.is_at_baseline()


def add(engine: Any, name: str, priority: int, arrival: float, n: int = 8, max_tokens: int = 2) -> Any:
    req = engine.make_request(ids(n, 100 + 10 * len(name)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                              name, arrival_time=arrival, priority=priority)
    return engine.add_request(req)


def first_scheduled_order(reqs: list[Any]) -> list[str]:
    return [r.request_id for r in sorted(reqs, key=lambda r: r.times.first_scheduled)]


def test_strict_priority_orders_the_waiting_queue(make_llm: Any) -> None:
    eng = make_llm(scheduling_policy="priority", priority_aging_s=0, max_num_seqs=1).engine
    t0 = time.perf_counter()
    reqs = [add(eng, "a", 5, t0), add(eng, "b", 0, t0 + 1), add(eng, "c", 1, t0 + 2), add(eng, "d", 0, t0 + 3),
            add(eng, "e", -3, t0 + 4)]
    for r in reqs:  # one step at a time: each runs alone to completion before the next is taken
        assert r.times.first_scheduled is None
    drain(eng)
    assert first_scheduled_order(reqs) == ["e", "b", "d", "c", "a"]


def test_fcfs_keeps_arrival_order_and_rejects_nonzero_priority(make_llm: Any) -> None:
    eng = make_llm(max_num_seqs=1).engine
    t0 = time.perf_counter()
    reqs = [add(eng, "a", 0, t0), add(eng, "b", 0, t0 + 1)]
    with pytest.raises(RequestRejected) as e:
        add(eng, "c", 1, t0 + 2)
    assert e.value.param == "priority" and e.value.code == ErrorCode.INVALID_PARAMETER
    drain(eng)
    assert first_scheduled_order(reqs) == ["a", "b"]


def test_preemption_takes_the_worst_priority_not_the_latest_arrival(make_llm: Any) -> None:
    # 6 blocks of 16 tokens: three 16-token prompts each need a 2nd block at their first decode and a 3rd later
    eng = make_llm(scheduling_policy="priority", priority_aging_s=0, num_kv_blocks=6, block_size=16).engine
    t0 = time.perf_counter()
    a, b, c = (add(eng, name, prio, t0 + i, n=16, max_tokens=30) for i, (name, prio) in
               enumerate([("a", 0), ("b", 2), ("c", 1)]))
    while not any(r.times.preemptions for r in (a, b, c)):
        eng.step()
    assert b.times.preemptions and not a.times.preemptions and not c.times.preemptions
    drain(eng)
    assert all(r.num_output_tokens == 30 for r in (a, b, c))


def test_aging_bounds_starvation(make_llm: Any) -> None:
    aging = 1.0
    eng = make_llm(scheduling_policy="priority", priority_aging_s=aging, max_num_seqs=1).engine
    t0 = time.perf_counter()
    # a (priority 5) has waited 5 levels' worth when b (priority 0) arrives 6 s later: a goes first; c (priority 0)
    # arriving 4 s after a is within a's 5-level handicap, so it overtakes a
    reqs = [add(eng, "a", 5, t0), add(eng, "b", 0, t0 + 6), add(eng, "c", 0, t0 + 4)]
    drain(eng)
    assert first_scheduled_order(reqs) == ["c", "a", "b"]
    # the bound itself: a request of priority p arriving at t is never behind one that arrives after
    # t + (p - q) * aging with priority q
    sched = eng.scheduler
    rng = random.Random(0)
    for _ in range(2000):
        p, q = rng.randint(-5, 5), rng.randint(-5, 5)
        old = type("R", (), {"priority": p, "times": type("T", (), {"arrival": 0.0})()})()
        later = (p - q) * aging + rng.uniform(1e-3, 10)
        new = type("R", (), {"priority": q, "times": type("T", (), {"arrival": later})()})()
        assert sched.order_key(old) < sched.order_key(new)  # type: ignore[arg-type]


def test_engine_config_validates_policy() -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="priority_aging_s"):
        EngineConfig(priority_aging_s=-1)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_priority_field_through_the_serving_layer(tiny_hf_model: Any, tokenizer: Any, policy: str) -> None:
    engine = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=64, max_model_len=256, device_peaks="off",
                                    scheduling_policy=policy), model=loaded_from_hf(tiny_hf_model),
                       tokenizer=tokenizer)
    ae = EngineClient(engine)
    ae.start()
    try:
        comp, chat = OpenAIServingCompletion(ae, "tiny"), OpenAIServingChat(ae, "tiny")

        async def run() -> None:
            body = CompletionRequest(prompt="hello", max_tokens=3, priority=2)
            chat_body = ChatCompletionRequest(messages=[{"role": "user", "content": "你好"}], max_tokens=3, priority=-1)
            if policy == "fcfs":
                for b in (body, chat_body):
                    with pytest.raises(RequestRejected) as e:  # answered by the app as a 400
                        if isinstance(b, CompletionRequest):
                            await comp.create_completion(b, RequestContext())
                        else:
                            await chat.create_chat_completion(b, RequestContext())
                    assert e.value.param == "priority" and e.value.code == ErrorCode.INVALID_PARAMETER
                body.priority = 0
            out = await comp.create_completion(body, RequestContext())
            assert isinstance(out, dict) and out["usage"]["completion_tokens"] == 3
            if policy == "priority":
                out = await chat.create_chat_completion(chat_body, RequestContext())
                assert isinstance(out, dict) and out["choices"][0]["finish_reason"] in ("stop", "length")

        asyncio.run(run())
        deadline = time.monotonic() + 5
        while (ae.num_unfinished or not engine.block_manager.is_at_baseline()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.block_manager.is_at_baseline()
    finally:
        ae.shutdown()


def test_priority_takes_the_whole_int32_range(make_llm: Any) -> None:
    """-2**31 and 2**31 - 1 are valid (README: an int32) and order first and last; one beyond either is a 400."""
    eng = make_llm(scheduling_policy="priority", priority_aging_s=0, max_num_seqs=1).engine
    t0 = time.perf_counter()
    reqs = [add(eng, "lo", 2**31 - 1, t0), add(eng, "hi", -(2**31), t0 + 1), add(eng, "mid", 0, t0 + 2)]
    for bad in (-(2**31) - 1, 2**31):
        with pytest.raises(RequestRejected) as e:
            add(eng, "x", bad, t0 + 3)
        assert e.value.param == "priority" and e.value.code == ErrorCode.INVALID_PARAMETER
    drain(eng)
    assert first_scheduled_order(reqs) == ["hi", "mid", "lo"]

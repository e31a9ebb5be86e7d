"""Scheduler and request life cycle: chunking, ordering, limits, rejection, abort, failure, phase timestamps.
After every request ends (finished, stopped, aborted, rejected, failed) the KV pool is back at baseline."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve import SamplingParams
from pdserve.errors import RequestRejected


def ids(n: int, start: int = 100) -> dict[str, list[int]]:
    return {"prompt_token_ids": [start + i % 5000 for i in range(n)]}


def drain(engine: Any) -> list[Any]:
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step().outputs)
    engine.block_manager.check_integrity()
    assert engine.block_manager.is_at_baseline()
    return outs


def test_chunked_prefill_advances_over_steps(make_llm: Any) -> None:
    eng = make_llm(max_num_batched_tokens=64).engine
    req = eng.add_request(ids(300), SamplingParams(max_tokens=3, ignore_eos=True))
    computed = []
    while req.num_output_tokens == 0:
        eng.step()
        computed.append(req.num_computed_tokens)
    assert computed == [64, 128, 192, 256, 300]
    assert [n for _, n in req.times.prefill_chunks] == [64, 64, 64, 64, 44]
    drain(eng)
    assert req.num_output_tokens == 3


def test_no_chunked_prefill_runs_prompt_in_one_step(make_llm: Any) -> None:
    eng = make_llm(max_num_batched_tokens=512, enable_chunked_prefill=False).engine
    req = eng.add_request(ids(300), SamplingParams(max_tokens=2, ignore_eos=True))
    eng.step()
    assert req.num_computed_tokens == 300 and req.num_output_tokens == 1
    drain(eng)
    with pytest.raises(RequestRejected, match="chunked prefill off"):
        eng.add_request(ids(600), SamplingParams(max_tokens=2))
    assert eng.block_manager.is_at_baseline()


def test_decodes_scheduled_before_prefills_and_step_kinds(make_llm: Any) -> None:
    eng = make_llm(max_num_batched_tokens=32).engine
    a = eng.add_request(ids(10), SamplingParams(max_tokens=20, ignore_eos=True))
    assert eng.step().stats.kind == "prefill" and a.num_output_tokens == 1
    b = eng.add_request(ids(100, 300), SamplingParams(max_tokens=2, ignore_eos=True))
    sched = eng.scheduler.schedule()
    assert [d.req_id for d in sched.scheduled_reqs] == [a.request_id, b.request_id]
    assert sched.num_decodes == 1 and sched.num_prefill_tokens == 31 and sched.kind == "mixed"
    eng.abort_request([a.request_id, b.request_id])
    drain(eng)


def test_max_num_seqs_limits_running(make_llm: Any) -> None:
    eng = make_llm(max_num_seqs=3).engine
    for i in range(5):
        eng.add_request(ids(5, 100 + i), SamplingParams(max_tokens=4, ignore_eos=True))
    eng.step()
    assert eng.scheduler.num_running == 3 and eng.scheduler.num_waiting == 2
    drain(eng)


def test_rejections_are_clear_and_leak_nothing(make_llm: Any) -> None:
    eng = make_llm(max_model_len=256, num_kv_blocks=8).engine
    with pytest.raises(RequestRejected, match="200 tokens and max_tokens is 100: 300 .* 256"):
        eng.add_request(ids(200), SamplingParams(max_tokens=100))
    with pytest.raises(RequestRejected, match="256"):
        eng.add_request(ids(256), SamplingParams(max_tokens=1))
    with pytest.raises(RequestRejected, match="needs 9 KV blocks .* has 8"):
        eng.add_request(ids(100), SamplingParams(max_tokens=40))
    with pytest.raises(RequestRejected, match="empty"):
        eng.add_request({"prompt_token_ids": []})
    with pytest.raises(RequestRejected, match="token ids"):
        eng.add_request({"prompt_token_ids": [1, 10**9]})
    assert not eng.has_unfinished_requests() and eng.block_manager.is_at_baseline()


def test_abort_frees_blocks_at_once(make_llm: Any) -> None:
    eng = make_llm().engine
    a = eng.add_request(ids(40), SamplingParams(max_tokens=50, ignore_eos=True))
    b = eng.add_request(ids(40, 900), SamplingParams(max_tokens=5, ignore_eos=True))
    for _ in range(3):
        eng.step()
    used = eng.block_manager.num_used_blocks
    outs = eng.abort_request(a.request_id)
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    assert eng.block_manager.num_used_blocks < used
    eng.block_manager.check_integrity()
    drain(eng)
    assert b.status.finish_reason == "length"
    eng.abort_request("no-such-request")  # harmless


def test_waiting_request_can_be_aborted(make_llm: Any) -> None:
    eng = make_llm(max_num_seqs=1).engine
    eng.add_request(ids(5), SamplingParams(max_tokens=3, ignore_eos=True))
    w = eng.add_request(ids(5, 700), SamplingParams(max_tokens=3, ignore_eos=True))
    eng.step()
    eng.abort_request(w.request_id)
    assert w.status.finish_reason == "abort" and w.times.first_scheduled is None
    drain(eng)


def test_failure_in_one_request_fails_only_it(make_llm: Any) -> None:
    eng = make_llm().engine
    good = eng.add_request(ids(8), SamplingParams(max_tokens=4, ignore_eos=True))
    bad = eng.add_request(ids(8, 500), SamplingParams(max_tokens=4, ignore_eos=True))

    def boom(_: Any, finished_by_engine: bool = False) -> None:
        raise RuntimeError("detokenizer exploded")

    eng.output_processor.states[bad.request_id].detokenizer.update = boom  # type: ignore[method-assign]
    outs = drain(eng)
    failed = [o for o in outs if o.request_id == bad.request_id]
    assert failed[-1].outputs[0].finish_reason == "error" and "exploded" in failed[-1].error
    assert good.status.finish_reason == "length" and good.num_output_tokens == 4


def test_phase_timestamps(make_llm: Any) -> None:
    eng = make_llm(max_num_batched_tokens=32, num_kv_blocks=12).engine
    reqs = [eng.add_request(ids(60, 100 + 97 * i), SamplingParams(max_tokens=30, ignore_eos=True)) for i in range(4)]
    drain(eng)
    assert eng.scheduler.num_preemptions > 0
    assert any(r.times.preemptions for r in reqs)
    for r in reqs:
        t = r.times
        assert t.arrival <= t.first_scheduled <= t.first_token <= t.finished
        assert len(t.token_times) == r.num_output_tokens == 30
        assert t.token_times == sorted(t.token_times) and t.token_times[0] == t.first_token
        assert sum(n for _, n in t.prefill_chunks) >= 60 and len(t.prefill_chunks) >= 2
        assert t.ttft == pytest.approx(t.queue_time + t.prefill_time)
        assert t.e2e == pytest.approx(t.ttft + t.decode_time)
        assert len(t.itls) == 29 and t.tpot == pytest.approx(sum(t.itls) / 29)


def test_eos_stops_unless_ignored(make_llm: Any, tiny_hf_model: Any) -> None:
    llm = make_llm()
    greedy = llm.generate(ids(12), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    eos = greedy.outputs[0].token_ids[3]
    llm.engine.eos_token_ids.add(eos)  # pretend the 4th greedy token is EOS
    for r in [llm.engine]:
        r.eos_token_ids = llm.engine.eos_token_ids
    out = llm.generate(ids(12), SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos and out.stop_reason is None
    out = llm.generate(ids(12), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 10


def test_cache_salt_isolates_prefix_hits_end_to_end(make_llm: Any) -> None:
    """make_requests(cache_salt=...): a prompt cached under one salt is a miss under another salt or none, a hit
    under the same salt, and the salted output equals the unsalted one (the salt changes sharing, not results)."""
    eng = make_llm().engine
    prompt = ids(100)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    def run(salt: str | None, tag: str) -> Any:
        for r in eng.make_requests([prompt], params, tag, cache_salt=salt):
            eng.add_request(r)
        return [o for o in drain(eng) if o.finished][0]

    first = run("tenant-a", "a1")
    assert first.num_cached_tokens == 0
    assert run("tenant-b", "b1").num_cached_tokens == 0
    assert run(None, "n1").num_cached_tokens == 0
    again = run("tenant-a", "a2")
    assert again.num_cached_tokens >= 96 and again.outputs[0].token_ids == first.outputs[0].token_ids
    for bad in ("", 5):
        with pytest.raises(RequestRejected) as e:
            eng.make_requests([prompt], params, "x", cache_salt=bad)  # type: ignore[arg-type]
        assert e.value.param == "cache_salt"


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_waiting_request_reuses_a_prefix_in_flight(make_llm: Any, prefix_caching: bool) -> None:
    """Two requests with one long prompt arrive together: the second waits while the first computes the shared
    blocks, then hits them and computes only the last partial block (not the prompt a second time), with the same
    greedy output; requests with other prompts are not held. Its lookup counts once however long it waited."""
    eng = make_llm(max_num_batched_tokens=512, enable_prefix_caching=prefix_caching).engine
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = ids(300)
    a = eng.add_request(prompt, params)
    b = eng.add_request(prompt, params)
    other = eng.add_request(ids(40, 2000), params)
    eng.step()
    # held, b leaves its share of the step's budget to `other`; not held, it takes it (computing a's blocks again)
    assert [n for _, n in other.times.prefill_chunks] == ([40] if prefix_caching else [])
    assert b.num_computed_tokens == (0 if prefix_caching else 212)
    outs = {o.request_id: o for o in drain(eng) if o.finished}
    assert outs[a.request_id].outputs[0].token_ids == outs[b.request_id].outputs[0].token_ids
    computed_b = sum(n for _, n in b.times.prefill_chunks)
    if prefix_caching:
        assert b.num_cached_tokens == 288 and computed_b == 12 and eng.scheduler.num_prefix_waits == 1
        assert eng.block_manager.stats.queries == 640 and eng.block_manager.stats.hits == 288
    else:
        assert computed_b == 300 and eng.scheduler.num_prefix_waits == 0
    assert not eng.block_manager.writing


def test_a_held_prefix_writer_that_aborts_releases_its_waiters() -> None:
    """The writer is aborted before its step ran: the request waiting on its block is admitted next and computes
    the prompt itself (the aborted writer's blocks were never hashed)."""
    from pdserve.engine.block_manager import BlockManager
    from pdserve.engine.request import Request, RequestStatus
    from pdserve.engine.scheduler import Scheduler

    sched = Scheduler(BlockManager(64, 16), max_num_seqs=4, max_num_batched_tokens=512)
    a, b = (Request(r, ids(300)["prompt_token_ids"], SamplingParams(), eos_token_ids={2}, max_tokens=4)
            for r in ("a", "b"))
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert [d.req_id for d in out.scheduled_reqs] == ["a"] and sched.num_prefix_waits == 1
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert not sched.block_manager.writing
    out = sched.schedule()
    assert [(d.req_id, len(d.token_ids)) for d in out.scheduled_reqs] == [("b", 300)] and b.num_cached_tokens == 0
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert sched.block_manager.is_at_baseline() and not sched.block_manager.writing

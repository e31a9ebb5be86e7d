"""KV hand-off between two in-process engines (tiny model): a prefill engine pins, a decode engine pulls over the
connector (ZeroMQ, and NIXL where it loads), and greedy output equals a colocated engine's. Failure paths: an
unclaimed pin expires, a failed pull recomputes or fails per policy, an abort during a pull frees its blocks once
the pull ends."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import Request, RequestStatus
from pdserve.sampling_params import SamplingParams

from conftest import loaded_from_hf

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 6,
    "你好，世界！今天天气很好，我们去公园散步吧。" * 3,
    "one two",
    "x" * 47,
]


def _nixl_available() -> bool:
    try:
        from pdserve.disagg.nixl_connector import import_nixl

        import_nixl()
        return True
    except RuntimeError:
        return False


CONNECTORS = ["zmq", pytest.param("nixl", marks=pytest.mark.skipif(not _nixl_available(),
                                                                    reason="NIXL (nixl-cu12) not importable"))]


@pytest.fixture
def make_engine(tiny_hf_model: Any, tokenizer: Any) -> Iterator[Callable[..., LLMEngine]]:
    made: list[LLMEngine] = []

    def factory(**options: Any) -> LLMEngine:
        options.setdefault("dtype", "float32")
        options.setdefault("num_kv_blocks", 64)
        options.setdefault("max_num_batched_tokens", 32)  # long prompts prefill in several chunks
        eng = LLMEngine(EngineConfig(**options), model=loaded_from_hf(tiny_hf_model), tokenizer=tokenizer)
        made.append(eng)
        return eng

    yield factory
    for eng in made:
        eng.close()


def run(engine: LLMEngine, reqs: list[Request], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while any(not r.is_finished for r in reqs):
        assert time.monotonic() < deadline, f"requests did not finish: {reqs}"
        engine.step()


def settle(engine: LLMEngine, timeout: float = 10.0) -> None:
    """Let the engine apply releases that arrive on the side channel."""
    deadline = time.monotonic() + timeout
    while not engine.block_manager.is_at_baseline() and time.monotonic() < deadline:
        engine.kv_transfer.poll_pins()
        time.sleep(0.01)


def prefill(engine: LLMEngine, prompt: str, rid: str) -> Request:
    req = engine.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=1), rid)
    req.kv_transfer_params = {"do_remote_decode": True}
    engine.add_request(req)
    run(engine, [req])
    assert req.status == RequestStatus.FINISHED_LENGTH and req.kv_transfer_result is not None
    return req


def decode(engine: LLMEngine, prompt: str, params: dict[str, Any], rid: str, max_tokens: int = 12) -> Request:
    req = engine.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), rid)
    req.kv_transfer_params = params
    engine.add_request(req)
    run(engine, [req])
    return req


@pytest.mark.parametrize("connector", CONNECTORS)
def test_handoff_equals_colocated(make_engine: Callable[..., LLMEngine], connector: str) -> None:
    colo = make_engine()
    pre = make_engine(kv_role="prefill", kv_connector=connector)
    dec = make_engine(kv_role="decode", kv_connector=connector)
    for i, prompt in enumerate(PROMPTS):
        ref = colo.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), f"c{i}")
        colo.add_request(ref)
        run(colo, [ref])
        p = prefill(pre, prompt, f"p{i}")
        params = p.kv_transfer_result
        assert params is not None and params["do_remote_prefill"] and params["kv_connector"] == connector
        assert params["remote_port"] == pre.kv_transfer.connector.port and params["remote_block_ids"]
        assert not pre.block_manager.is_at_baseline()  # pinned until the decode side has pulled
        assert pre.kv_transfer.num_pinned_blocks == len(pre.block_manager.get_block_ids(f"p{i}"))
        d = decode(dec, prompt, params, f"d{i}")
        assert d.output_token_ids == ref.output_token_ids, prompt
        res = d.kv_transfer_result
        assert res is not None and res["ok"], res
        if p.num_prompt_tokens > 1:
            assert res["bytes"] > 0 and res["remote_engine_id"] == pre.kv_transfer.engine_id
        settle(pre)
        assert pre.block_manager.is_at_baseline() and pre.kv_transfer.num_pinned_blocks == 0
        assert dec.block_manager.is_at_baseline()
        pre.block_manager.check_integrity()
        dec.block_manager.check_integrity()
    assert pre.kv_transfer.stats.pin_timeouts == 0 and dec.kv_transfer.stats.loads_failed == 0


def test_decode_prefix_cache_skips_cached_blocks(make_engine: Callable[..., LLMEngine]) -> None:
    pre = make_engine(kv_role="prefill")
    dec = make_engine(kv_role="decode")
    prompt = PROMPTS[0]
    first = decode(dec, prompt, prefill(pre, prompt, "p0").kv_transfer_result or {}, "d0")
    second = decode(dec, prompt, prefill(pre, prompt, "p1").kv_transfer_result or {}, "d1")
    assert first.output_token_ids == second.output_token_ids
    r1, r2 = first.kv_transfer_result or {}, second.kv_transfer_result or {}
    n = first.num_prompt_tokens
    if (n - 1) % 16:  # the partial last block is pulled again; full cached blocks are not
        assert r2["num_cached_tokens"] == (n - 1) // 16 * 16 and 0 < r2["bytes"] < r1["bytes"]
    settle(pre)
    assert pre.block_manager.is_at_baseline()


def test_unclaimed_pin_expires_and_decode_recomputes(make_engine: Callable[..., LLMEngine]) -> None:
    colo = make_engine()
    pre = make_engine(kv_role="prefill", kv_transfer_timeout=0.3)
    dec = make_engine(kv_role="decode")
    prompt = PROMPTS[1]
    params = prefill(pre, prompt, "p0").kv_transfer_result or {}
    time.sleep(0.4)
    pre.kv_transfer.poll_pins()
    assert pre.block_manager.is_at_baseline() and pre.kv_transfer.stats.pin_timeouts == 1
    d = decode(dec, prompt, params, "d0")  # the pull is refused: policy recompute computes the prompt here
    ref = colo.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), "c")
    colo.add_request(ref)
    run(colo, [ref])
    assert d.status == RequestStatus.FINISHED_LENGTH and d.output_token_ids == ref.output_token_ids
    res = d.kv_transfer_result or {}
    assert not res["ok"] and "no pinned KV blocks" in res["error"]
    assert dec.kv_transfer.stats.loads_failed == 1 and dec.scheduler.num_kv_load_recomputes == 1
    assert dec.block_manager.is_at_baseline()


def test_failed_pull_with_policy_fail_errors(make_engine: Callable[..., LLMEngine]) -> None:
    pre = make_engine(kv_role="prefill")
    dec = make_engine(kv_role="decode", kv_load_failure_policy="fail", kv_transfer_timeout=1.0)
    prompt = PROMPTS[0]
    params = dict(prefill(pre, prompt, "p0").kv_transfer_result or {})
    port = pre.kv_transfer.connector.port
    params["remote_port"] = port + 1 if port < 65535 else 1  # nobody there
    t0 = time.monotonic()
    d = decode(dec, prompt, params, "d0")
    assert d.status == RequestStatus.FINISHED_ERROR and "KV transfer" in (d.error or "")
    assert time.monotonic() - t0 < 5
    assert dec.block_manager.is_at_baseline()


def test_abort_during_pull_frees_blocks_after_pull(make_engine: Callable[..., LLMEngine]) -> None:
    pre = make_engine(kv_role="prefill")
    dec = make_engine(kv_role="decode")
    conn = dec.kv_transfer.connector
    real_pull = conn._pull

    def slow_pull(job: Any) -> Any:
        time.sleep(0.3)
        return real_pull(job)

    conn._pull = slow_pull  # type: ignore[method-assign]
    prompt = PROMPTS[0]
    params = prefill(pre, prompt, "p0").kv_transfer_result or {}
    req = dec.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=8), "d0")
    req.kv_transfer_params = params
    dec.add_request(req)
    dec.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    dec.abort_request("d0")
    assert not dec.block_manager.is_at_baseline()  # the pull may still write these blocks
    deadline = time.monotonic() + 5
    while not dec.block_manager.is_at_baseline() and time.monotonic() < deadline:
        dec.step()
    assert dec.block_manager.is_at_baseline() and not dec.has_unfinished_requests()
    settle(pre)
    assert pre.block_manager.is_at_baseline()
    dec.block_manager.check_integrity()


def test_mismatched_prompt_is_not_pulled(make_engine: Callable[..., LLMEngine]) -> None:
    pre = make_engine(kv_role="prefill")
    dec = make_engine(kv_role="decode")
    params = prefill(pre, PROMPTS[0], "p0").kv_transfer_result or {}
    d = decode(dec, PROMPTS[0].upper(), params, "d0")
    assert d.status == RequestStatus.FINISHED_LENGTH
    assert not (d.kv_transfer_result or {})["ok"]
    settle(pre)  # the decode side released the pin it did not use
    assert pre.block_manager.is_at_baseline() and pre.kv_transfer.stats.pin_timeouts == 0


def test_router_pool_picks_least_loaded_with_round_robin_ties() -> None:
    from pdserve.disagg.router import Instance, Pool

    a, b, c = Instance("a", "decode"), Instance("b", "decode"), Instance("c", "decode")
    pool = Pool("decode", [a, b, c])
    assert {pool.pick().url for _ in range(6)} == {"a", "b", "c"}  # all idle: round-robin
    a.load, b.inflight = 3, 1
    assert pool.pick() is c
    c.healthy = False
    assert pool.pick() is b  # unhealthy instances are skipped while a healthy one is left
    assert pool.pick({a, b}) is c  # ...and used as the last resort
    assert pool.pick({a, b, c}) is None

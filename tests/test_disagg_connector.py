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
from pdserve.kv_transfer.trust import default_secret, default_secret_path, sign_kv_transfer_params
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
        from pdserve.kv_transfer.nixl_connector import import_nixl

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
    req.kv_transfer_params = sign_kv_transfer_params({"do_remote_decode": True}, default_secret())  # as the router
    engine.add_request(req)
    run(engine, [req])
    assert req.status == RequestStatus.FINISHED_LENGTH and req.kv_transfer_result is not None
    return req


def decode(engine: LLMEngine, prompt: str, params: dict[str, Any], rid: str, max_tokens: int = 12) -> Request:
    req = engine.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), rid)
    if "signature" not in params:  # signed as the router forwards them (default secret)
        params = sign_kv_transfer_params(params, default_secret())
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
    req.kv_transfer_params = sign_kv_transfer_params(params, default_secret())
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
    from pdserve.router.pool import Instance, Pool

    a, b, c = Instance("a", "decode"), Instance("b", "decode"), Instance("c", "decode")
    pool = Pool("decode", [a, b, c])
    assert {pool.pick().url for _ in range(6)} == {"a", "b", "c"}  # all idle: round-robin
    a.load, b.inflight = 3, 1
    assert pool.pick() is c
    c.healthy = False
    assert pool.pick() is b  # unhealthy instances are skipped while a healthy one is left
    assert pool.pick({a, b}) is c  # ...and used as the last resort
    assert pool.pick({a, b, c}) is None


def test_prefill_pool_has_no_last_resort() -> None:
    from pdserve.router.pool import Instance, Pool

    a = Instance("a", "prefill", healthy=False)
    assert Pool("prefill", [a], last_resort=False).pick() is None  # the decode instance computes the prompt
    assert Pool("decode", [a]).pick() is a


# ---- trust: who may hand KV over (pdserve/kv_transfer/trust.py) -------------------------------------------------
def test_verify_kv_transfer_params() -> None:
    from pdserve.errors import ErrorCode, RequestRejected
    from pdserve.kv_transfer.trust import (
        KVTransferTrust,
        PeerAllowList,
        sign_kv_transfer_params,
        verify_kv_transfer_params,
    )

    p = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 5600, "remote_request_id": "r",
         "remote_block_ids": [0, 1], "prompt_hash": "你好"}
    signed = KVTransferTrust.create("s3cret", None)
    assert verify_kv_transfer_params(sign_kv_transfer_params(p, "s3cret"), signed)["remote_port"] == 5600
    assert signed.verify({"do_remote_prefill": False}) == {"do_remote_prefill": False}  # asks for nothing
    remote = {**p, "remote_host": "10.1.2.3"}
    assert signed.verify(sign_kv_transfer_params(remote, "s3cret"))  # a signed peer: the router vouches for it
    bad = [p, sign_kv_transfer_params(p, "other"), {**sign_kv_transfer_params(p, "s3cret"), "remote_port": 6000},
           sign_kv_transfer_params({"do_remote_decode": True}, "other")]
    for params in bad:
        with pytest.raises(RequestRejected) as exc:
            signed.verify(params)
        assert exc.value.code == ErrorCode.KV_TRANSFER_PARAMS_REJECTED and exc.value.param == "kv_transfer_params"
    # no configured secret: the per-user default secret signs (conftest's session cache holds its file), peers are
    # loopback only; a client's own params, unsigned, are refused whatever they ask for
    default = KVTransferTrust.create(None, None)
    key = default_secret()
    assert key and default.secret == key and not default.configured and key not in default.describe()
    assert default_secret_path().stat().st_mode & 0o777 == 0o600
    assert default.verify(sign_kv_transfer_params(p, key))
    assert default.verify(sign_kv_transfer_params({**p, "remote_host": "localhost"}, key))
    assert default.verify(sign_kv_transfer_params({"do_remote_decode": True}, key))
    for params in [p, {"do_remote_decode": True}, {**p, "remote_port": 21990}, sign_kv_transfer_params(remote, key),
                   *[sign_kv_transfer_params(x, key) for x in [
                       {**p, "remote_host": "evil.example"}, {**p, "remote_port": "80"}, {**p, "remote_port": 0},
                       {**p, "remote_block_ids": [-1]}, {**p, "remote_block_ids": "1"},
                       {**p, "remote_request_id": None}]]]:
        with pytest.raises(RequestRejected):
            default.verify(params)
    nokey = KVTransferTrust(None, PeerAllowList.parse("loopback"), configured=False)  # no usable secret file
    with pytest.raises(RequestRejected):
        nokey.verify(sign_kv_transfer_params({"do_remote_decode": True}, key))
    peers = PeerAllowList.parse("10.0.0.0/8, kv-host-1, ::1")
    assert peers.allows("10.9.9.9") and peers.allows("KV-HOST-1") and peers.allows("[::1]")
    assert not peers.allows("127.0.0.1") and not peers.allows("11.0.0.1")
    assert PeerAllowList.parse("*").allows("anything")
    assert "s3cret" not in signed.describe() and "s3cret" not in repr(EngineConfig(kv_transfer_secret="s3cret"))


class ConnectRecorder:
    """A TCP listener that accepts and counts connections and never answers (a forged `remote_host:port`)."""

    def __init__(self) -> None:
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list[Any] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def test_secret_refuses_unsigned_params_without_connecting(make_engine: Callable[..., LLMEngine]) -> None:
    from pdserve.kv_transfer.trust import sign_kv_transfer_params

    pre = make_engine(kv_role="prefill", kv_transfer_secret="s3cret")
    dec = make_engine(kv_role="decode", kv_transfer_secret="s3cret")
    prompt = PROMPTS[1]
    # an unsigned do_remote_decode pins nothing
    req = pre.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=1), "p-unsigned")
    req.kv_transfer_params = {"do_remote_decode": True}
    pre.add_request(req)
    run(pre, [req])
    assert pre.block_manager.is_at_baseline() and pre.kv_transfer.num_pinned_blocks == 0
    # forged do_remote_prefill params: computed here, nothing contacted (no pull, no release)
    rec = ConnectRecorder()
    try:
        forged = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": rec.port,
                  "remote_request_id": "x", "remote_block_ids": list(range(8))}
        d = decode(dec, prompt, forged, "d-forged")
        time.sleep(0.2)
        assert d.status == RequestStatus.FINISHED_LENGTH and rec.conns == []
        assert "signature" in (d.kv_transfer_result or {})["error"]
    finally:
        rec.close()
    # signed params (as the router sends them) hand off as usual, with the same output
    p = pre.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=1), "p0")
    p.kv_transfer_params = sign_kv_transfer_params({"do_remote_decode": True}, "s3cret")
    pre.add_request(p)
    run(pre, [p])
    params = sign_kv_transfer_params(p.kv_transfer_result or {}, "s3cret")
    ok = decode(dec, prompt, params, "d0")
    assert (ok.kv_transfer_result or {})["ok"] and ok.output_token_ids == d.output_token_ids
    settle(pre)
    assert pre.block_manager.is_at_baseline() and dec.block_manager.is_at_baseline()


def test_peer_that_never_answers_fails_fast(make_engine: Callable[..., LLMEngine]) -> None:
    """A peer that accepts TCP but never speaks ZeroMQ fails the pull within the connect timeout, not the whole
    kv_transfer_timeout, so it cannot hold a loader thread."""
    from pdserve.kv_transfer.zmq_connector import CONNECT_TIMEOUT_S

    dec = make_engine(kv_role="decode", kv_transfer_timeout=30.0)
    rec = ConnectRecorder()
    try:
        params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": rec.port,
                  "remote_request_id": "x", "remote_block_ids": list(range(8))}
        t0 = time.monotonic()
        d = decode(dec, PROMPTS[0], params, "d0")
        assert time.monotonic() - t0 < CONNECT_TIMEOUT_S + 3
        res = d.kv_transfer_result or {}
        assert d.status == RequestStatus.FINISHED_LENGTH and not res["ok"] and "KV side channel" in res["error"]
        assert dec.block_manager.is_at_baseline()
    finally:
        rec.close()


def test_block_runs_follow_both_sides() -> None:
    from pdserve.kv_transfer.zmq_connector import block_runs

    assert block_runs([4, 5, 6, 9, 10], [20, 21, 22, 23, 24]) == [(4, 20, 3), (9, 23, 2)]
    assert block_runs([1, 2, 3], [7, 6, 5]) == [(1, 7, 1), (2, 6, 1), (3, 5, 1)]
    assert block_runs([], []) == []


def test_pull_into_scattered_and_consecutive_blocks_moves_every_byte() -> None:
    """One pull whose local blocks are partly consecutive and partly not: each run arrives as its own frames,
    straight into the right blocks; the blocks around them stay as they were; a read of unpinned blocks is
    refused and leaves the local cache alone."""
    import torch

    from pdserve.kv_transfer.connector import KVTransferError, LoadJob, Pin, PinTable
    from pdserve.kv_transfer.zmq_connector import ZmqConnector

    src_cache = torch.randn(2, 2, 12, 4, 2, 8).to(torch.bfloat16)
    dst_cache = torch.randn(2, 2, 12, 4, 2, 8).to(torch.bfloat16)
    before = dst_cache.clone()
    src = ZmqConnector("p", src_cache, "127.0.0.1", 0, PinTable(), 10.0)
    dst = ZmqConnector("d", dst_cache, "127.0.0.1", 0, PinTable(), 10.0)
    src.start()
    dst.start()
    try:
        remote, local = [2, 3, 4, 7, 8], [5, 6, 7, 1, 0]
        src.pins.add("r", Pin(remote, time.monotonic() + 10, 20))
        params = {"remote_host": "127.0.0.1", "remote_port": src.port, "remote_request_id": "r"}
        nbytes, _ = dst._pull(LoadJob("r", local, remote, params, time.monotonic() + 10))
        assert nbytes == src_cache[:, :, remote].numel() * 2
        assert torch.equal(dst_cache[:, :, local], src_cache[:, :, remote])
        others = [b for b in range(12) if b not in local]
        assert torch.equal(dst_cache[:, :, others], before[:, :, others])
        with pytest.raises(KVTransferError, match="not all pinned"):
            dst._pull(LoadJob("r", [9], [10], params, time.monotonic() + 10))
        assert torch.equal(dst_cache[:, :, 9], before[:, :, 9])
    finally:
        src.close()
        dst.close()

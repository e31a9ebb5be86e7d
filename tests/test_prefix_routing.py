"""Prefix-aware routing without servers: the router's block hashes equal the engine's, the cost formula and its
fallback with a fake clock, salt and tenant isolation, the published summary's polling, and the router's prompt
tokens equal to the server's (chat template and plain text, English and Chinese). tests/test_disagg.py runs it on
real instances."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request
from pdserve.prefix_hash import chain_hashes, effective_salt, pack_hashes, unpack_hashes
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pool import Instance, InstanceRegistry, Pool
from pdserve.router.prefix import MAX_PENDING, InstancePrefixes, PrefixQuery, PrefixRoutingConfig, choose
from pdserve.router.prompt_tokens import PromptTokenizer
from pdserve.sampling_params import SamplingParams

BS = 4


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def cached_hashes(tokens: list[int], salt: str | None = None) -> frozenset[int]:
    """The hashes a real BlockManager holds after computing `tokens` (prefill done, request finished)."""
    bm = BlockManager(num_blocks=64, block_size=BS)
    req = Request("r", tokens, SamplingParams(), eos_token_ids={2}, max_tokens=8, cache_salt=salt)
    assert bm.allocate_slots(req, len(tokens))
    req.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(req)
    bm.free("r")
    return frozenset(bm.cached)


def published(tokens: list[int], salt: str | None = None, isolation: str = "none") -> InstancePrefixes:
    p = InstancePrefixes()
    p.publish({"block_size": BS, "isolation": isolation, "hashes": pack_hashes(sorted(cached_hashes(tokens, salt)))},
              '"e-1"')
    return p


def inst(name: str, prefixes: InstancePrefixes | None = None, load: float = 0.0) -> Instance:
    return Instance(name, "decode", load=load, prefixes=prefixes or InstancePrefixes())


PROMPT = list(range(10, 30))  # 5 full blocks; a lookup may hit the first 4 (the last token is always computed)


def test_router_chains_equal_the_block_managers_hashes() -> None:
    for salt in (None, "租户甲"):
        held = cached_hashes(PROMPT, salt)
        chain = chain_hashes(PROMPT, BS, salt)
        assert len(chain) == (len(PROMPT) - 1) // BS and set(chain) <= held
    assert chain_hashes(PROMPT, BS, None) != chain_hashes(PROMPT, BS, "s")
    assert unpack_hashes(pack_hashes([-(2**63), 0, 2**63 - 1])) == {-(2**63), 0, 2**63 - 1}
    assert effective_salt("s", "t", "none") == "s" and effective_salt("s", None, "tenant") == "s"
    assert effective_salt("s", "t", "tenant") == '["t", "s"]'


def test_cost_formula_hit_against_load() -> None:
    cfg = PrefixRoutingConfig(load_cost=4.0, clock=FakeClock())
    query = PrefixQuery(PROMPT + [99] * 4)  # 24 tokens; the first 20 held by `a`
    a, b = inst("a", published(PROMPT)), inst("b")
    assert [c.inst for c in choose([a, b], query, cfg)] == [a]
    assert choose([a, b], query, cfg)[0].hit_tokens == 20 and a.prefixes.hit_tokens(query, 0.0) == (20, 0)
    # cost_a = (24 - 20) + 4 * (2 + 3) = 24 = cost_b = 24 + 4 * 0: a tie goes to the larger hit; one more tips it
    a.load, a.inflight = 2, 3
    assert [c.inst for c in choose([a, b], query, cfg)] == [a]
    assert choose([a, b], query, cfg)[0].cost == 24.0
    a.inflight = 4
    assert [c.inst for c in choose([a, b], query, cfg)] == [b]
    # load_cost 0: the prefix whatever the queue; a shorter match loses to a longer one at equal load
    a.inflight, a.load = 0, 0
    c = inst("c", published(PROMPT[:8] + [7] * 12))
    assert [x.inst for x in choose([c, a, b], query, PrefixRoutingConfig(load_cost=0.0))] == [a]
    # equal cost and hit: every tie is returned (the pool round-robins over them)
    a2 = inst("a2", published(PROMPT))
    assert {x.inst.url for x in choose([a, a2, b], query, cfg)} == {"a", "a2"}


def test_disk_tier_blocks_count_at_their_cost() -> None:
    """Blocks an instance holds on its disk tier only, right after its memory hit, count at disk_cost a token."""
    cfg = PrefixRoutingConfig(load_cost=4.0, disk_cost=0.1, clock=FakeClock())
    query = PrefixQuery(PROMPT + [99] * 4)  # 24 tokens: PROMPT's 5 blocks, then one more
    chain = query.chain(BS, "none")

    def with_disk(memory: list[int], disk: list[int]) -> InstancePrefixes:
        p = InstancePrefixes()
        p.publish({"block_size": BS, "hashes": pack_hashes(memory), "disk_hashes": pack_hashes(disk)}, None)
        return p

    a, b = inst("a", with_disk([], chain[:5])), inst("b")
    assert a.prefixes.hit_tokens(query, 0.0) == (0, 20)
    (got,) = choose([a, b], query, cfg)
    assert got.inst is a and got.hit_tokens == 20 and got.cost == pytest.approx(4 + 0.1 * 20)
    c = inst("c", with_disk(chain[:2], chain[2:5]))  # 8 tokens in memory, the next 12 on disk: cheaper than a
    assert c.prefixes.hit_tokens(query, 0.0) == (8, 12)
    assert [x.inst for x in choose([a, b, c], query, cfg)] == [c]
    a.load = 5  # 6 + 4 x 5 = 26 > 24: b computes it sooner
    assert [x.inst for x in choose([a, b], query, cfg)] == [b]
    assert Pool("decode", [a, b], prefix=cfg).choose(None, query) == (b, "load", 0)  # not a prefix decision
    gap = inst("gap", with_disk([], chain[1:5]))  # the disk run must start where the memory run ends (block 0)
    assert gap.prefixes.hit_tokens(query, 0.0) == (0, 0) and choose([gap, b], query, cfg) == []
    old = InstancePrefixes()  # an instance that publishes no disk_hashes (no tier, an older pdserve)
    old.publish({"block_size": BS, "hashes": pack_hashes(chain[:2])}, None)
    assert old.hit_tokens(query, 0.0) == (8, 0)


def test_nothing_matches_falls_back_to_least_loaded() -> None:
    cfg = PrefixRoutingConfig(clock=FakeClock())
    a, b = inst("a", published(PROMPT), load=1), inst("b", load=3)
    other = PrefixQuery([5] * 20)
    assert choose([a, b], other, cfg) == []
    pool = Pool("decode", [a, b], prefix=cfg)
    assert pool.choose(None, other)[:2] == (a, "no_match")
    assert pool.choose(None, None)[:2] == (a, "no_prefix")
    assert pool.choose({a}, PrefixQuery(PROMPT))[:2] == (b, "no_match")  # the holder excluded (tried already)
    assert Pool("decode", [a, b]).choose(None, PrefixQuery(PROMPT))[:2] == (a, "no_prefix")  # routing off


def test_a_burst_follows_its_first_request_until_the_ttl() -> None:
    """Requests sharing a new prefix go where the first went, before any poll shows its blocks there; the
    expectation lapses after pending_ttl (fake clock) unless the instance published them meanwhile."""
    clock = FakeClock()
    cfg = PrefixRoutingConfig(load_cost=1.0, pending_ttl=5.0, clock=clock)
    empty = {"block_size": BS, "isolation": "none", "hashes": ""}
    a, b = inst("a"), inst("b")
    for i in (a, b):
        i.prefixes.publish(empty, None)
    pool = Pool("decode", [a, b], prefix=cfg)
    first, reason, _ = pool.choose(None, PrefixQuery(PROMPT))
    assert reason == "no_match"
    first.inflight = 2  # busy with it: least-loaded would now pick the other one
    got = pool.choose(None, PrefixQuery(PROMPT + [1, 2, 3]))
    assert got == (first, "prefix", 16)  # what the router expects is the lookup's part of PROMPT: 19 tokens
    clock.t += 5.1
    assert pool.choose(None, PrefixQuery(PROMPT))[1] == "no_match"
    # bounded: the oldest expectations go first
    p = InstancePrefixes(block_size=1)
    p.expect(PrefixQuery(list(range(MAX_PENDING + 10))), until=1e9)
    assert len(p.pending) == MAX_PENDING


def test_a_salt_or_tenant_never_routes_by_anothers_blocks() -> None:
    cfg = PrefixRoutingConfig(clock=FakeClock())
    a, b = inst("a", published(PROMPT, salt="salt-A")), inst("b")
    assert choose([a, b], PrefixQuery(PROMPT), cfg) == []
    assert choose([a, b], PrefixQuery(PROMPT, cache_salt="salt-B"), cfg) == []
    assert choose([a, b], PrefixQuery(PROMPT, cache_salt="salt-A"), cfg)[0].inst is a
    # an instance with tenant isolation hashes under [tenant, salt]: only the same tenant matches
    t = inst("t", published(PROMPT, salt=effective_salt(None, "acme", "tenant"), isolation="tenant"))
    assert choose([t, b], PrefixQuery(PROMPT, tenant="acme"), cfg)[0].inst is t
    assert choose([t, b], PrefixQuery(PROMPT, tenant="globex"), cfg) == []
    assert choose([t, b], PrefixQuery(PROMPT), cfg) == []  # no tenant: the bare chain, which `t` does not hold


def test_registry_polls_the_summary_conditionally() -> None:
    """The poll asks /kv/prefix_hashes with the last ETag: a 304 keeps the set, a new body replaces it, a 404
    (an instance without the route) forgets it; none of it touches health. The instances' API key goes along. The
    load it keeps leaves out this router's own requests the answer counted (they count as in flight)."""
    hashes = sorted(cached_hashes(PROMPT))
    state: dict[str, Any] = {"status": 200, "etag": '"e-1"', "asked": []}

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/metrics":
            return httpx.Response(200, text="pdserve:num_requests_running 1.0\n")
        assert req.headers["authorization"] == "Bearer k"  # the instances' key (--instance-api-key)
        state["asked"].append(req.headers.get("if-none-match"))
        if state["status"] != 200:
            return httpx.Response(state["status"])
        if req.headers.get("if-none-match") == state["etag"]:
            return httpx.Response(304)
        body = {"block_size": BS, "isolation": "none", "hashes": pack_hashes(hashes)}
        return httpx.Response(200, json=body, headers={"etag": state["etag"]})

    reg = InstanceRegistry([], ["http://a"], RouterMetrics(), 0.5, api_key="k", prefix=PrefixRoutingConfig())

    async def poll() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await reg.poll_once(client)

    a = reg.decode.instances[0]
    asyncio.run(poll())
    assert a.prefixes.hashes == frozenset(hashes) and a.load == 1.0
    hashes = hashes[:1]
    asyncio.run(poll())  # unchanged ETag: 304, the old set stays
    assert len(a.prefixes.hashes) == 5 and state["asked"] == [None, '"e-1"']
    state["etag"] = '"e-2"'
    asyncio.run(poll())
    assert len(a.prefixes.hashes) == 1
    state["status"] = 404
    asyncio.run(poll())
    assert a.prefixes.block_size is None and a.healthy
    a.inflight = 1  # the request the instance reports is this router's own: counted once, as in flight
    asyncio.run(poll())
    assert a.load == 0.0
    a.inflight = 0  # it ended before the next poll: the stale answer weighs nothing (load 0, none in flight)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    d = tmp_path_factory.mktemp("tok")
    tokenizer.save_pretrained(d)
    return d


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "你是一个乐于助人的助手。"}, {"role": "user", "content": "北京在哪里？"},
     {"role": "assistant", "content": "在中国北方。"}, {"role": "user", "content": [
         {"type": "text", "text": "Tell me "}, {"type": "text", "text": "more"}]}],
])
def test_router_prompt_tokens_equal_the_servers(tok_dir: Path, tokenizer: Any, messages: list[Any]) -> None:
    from pdserve.api.protocol import ChatCompletionRequest, plain_messages
    from pdserve.server.chat_template import render_chat

    rt = PromptTokenizer.load(str(tok_dir))
    body = {"model": "m", "messages": messages}
    want = render_chat(tokenizer, plain_messages(ChatCompletionRequest.model_validate(body).messages))
    assert rt.prompt_token_ids("/v1/chat/completions", body) == want["prompt_token_ids"]
    for text in ("The quick brown fox", "你好，世界！"):
        assert rt.prompt_token_ids("/v1/completions", {"prompt": text}) == tokenizer.encode(text)
    assert rt.prompt_token_ids("/v1/completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    # what the router does not render routes by load
    assert rt.prompt_token_ids("/v1/completions", {"prompt": ["a", "b"]}) is None
    assert rt.prompt_token_ids("/v1/chat/completions", {**body, "tools": [{"type": "function"}]}) is None


def test_published_summary_is_rebuilt_only_when_the_cached_set_changes() -> None:
    """The engine thread builds the summary when a reader asks; the hash tuple is copied only when a hash entered or
    left the block manager's cache (cache_version), and a new engine gets a new epoch."""
    from types import SimpleNamespace

    from pdserve.engine.client import PrefixSummary

    bm = BlockManager(num_blocks=8, block_size=BS)
    engine: Any = SimpleNamespace(block_manager=bm, kv_offload=None)
    first = PrefixSummary.of(engine)
    assert first.hashes == () and PrefixSummary.of(engine, first) is first
    req = Request("r", PROMPT[:8], SamplingParams(), eos_token_ids={2}, max_tokens=8)
    assert bm.allocate_slots(req, 8)
    req.num_computed_tokens = 8
    bm.cache_full_blocks(req)
    second = PrefixSummary.of(engine, first)
    assert second.epoch == first.epoch and second.version > first.version and len(second.hashes) == 2
    bm.free("r")
    assert PrefixSummary.of(engine, second) is second  # freed, still cached: the same set
    assert bm.allocate_slots(Request("x", [1] * 32, SamplingParams(), eos_token_ids={2}, max_tokens=8), 32)
    assert PrefixSummary.of(engine, second).hashes == ()  # evicted for new blocks
    assert PrefixSummary.of(engine).epoch != first.epoch


def test_engine_client_builds_the_summary_only_when_asked(tiny_hf_model: Any, tokenizer: Any) -> None:
    """Steps never copy the hashes: after a request's blocks are cached the last build is unchanged until a reader
    asks (current_prefix_summary), which then holds the request's full blocks; asking again returns the same build."""
    from pdserve.config import EngineConfig
    from pdserve.engine.client import EngineClient
    from pdserve.engine.engine import LLMEngine

    from conftest import loaded_from_hf

    engine = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=32, max_model_len=256, device_peaks="off"),
                       model=loaded_from_hf(tiny_hf_model), tokenizer=tokenizer)
    client = EngineClient(engine)
    first = client.prefix_summary
    client.start()
    try:
        async def run() -> tuple[Any, Any, Any]:
            params = SamplingParams(max_tokens=2, ignore_eos=True)
            req = engine.make_request({"prompt_token_ids": list(range(100, 140))}, params, "r1")
            async for _ in client.generate(req):
                pass
            stale = client.prefix_summary
            built = await client.current_prefix_summary()
            return stale, built, await client.current_prefix_summary()

        stale, built, again = asyncio.run(run())
    finally:
        client.shutdown()
    bs = engine.block_manager.block_size
    assert stale is first and first.hashes == ()
    assert built.epoch == first.epoch and built.version > first.version and len(built.hashes) == 40 // bs
    assert again is built

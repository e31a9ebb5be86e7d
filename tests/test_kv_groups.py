"""KV cache groups (model/kv_layout.py): the layout plan, the block manager's per-group tables (sliding groups free
the blocks that fell out of their window; a prefix hit needs only the window before its end), a stateful property
test that a hit always hands back blocks holding the right tokens, and the engine on a tiny Gemma 3: the same greedy
tokens as with one table, on every kernel path, with far fewer blocks held by a long request."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_block_manager import admit, make_request

from pdserve import SamplingParams, kernels
from pdserve.engine.block_manager import BlockManager
from pdserve.model.kv_layout import KVCacheGroup, KVCacheLayout

from conftest import make_tiny_hf_model

BS = 4


def gemma3_windows(num_layers: int, window: int = 512, pattern: int = 6) -> list[int]:
    return [0 if (i + 1) % pattern == 0 else window for i in range(num_layers)]


def test_plan_groups_like_vllm() -> None:
    """Gemma 3 270M (18 layers, every sixth global): the 3 global layers set the group size; the 15 local ones make
    five groups of three. Gemma 2 (alternating): two groups. One window everywhere: one sliding group."""
    lay = KVCacheLayout.plan(gemma3_windows(18))
    assert lay.layers_per_block == 3 and lay.windows == (0, 512, 512, 512, 512, 512)
    assert lay.groups[0] == KVCacheGroup(0, (5, 11, 17))
    assert lay.placement(5) == (0, 0) and lay.placement(17) == (0, 2) and lay.placement(4) == (2, 1)
    assert sorted(i for g in lay.groups for i in g.layers) == list(range(18))
    assert KVCacheLayout.plan([4096, 0] * 13).windows == (0, 4096) and KVCacheLayout.plan([4096, 0] * 13) \
        .layers_per_block == 13
    assert KVCacheLayout.plan([4096] * 32).windows == (4096,)
    uneven = KVCacheLayout.plan(gemma3_windows(26))  # 4 global, 22 local: the last local group is padded
    assert uneven.layers_per_block == 4 and len(uneven.groups) == 7 and len(uneven.groups[-1].layers) == 2
    assert KVCacheLayout.plain(5).windows == (0,) and not KVCacheLayout.plain(5).frees_blocks


def test_a_32k_conversation_holds_a_window_of_local_kv() -> None:
    """A 32k-token request on Gemma 3's layout (window 512, block 16): the local groups hold ~33 blocks each, not
    2048; in layer-blocks the request holds ~5.5x less KV than in one table of all 18 layers."""
    lay = KVCacheLayout.plan(gemma3_windows(18))
    bm = BlockManager(4000, 16, windows=lay.windows)
    req = make_request("long", list(range(100, 612)))
    assert bm.allocate_slots(req, 512)
    req.num_computed_tokens = 512
    while req.num_computed_tokens < 32768:  # decode one token a step
        req.append_output_token(7)
        assert bm.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        bm.cache_full_blocks(req)
    tables = [bm.req_blocks["long"]] + [g["long"] for g in bm.group_blocks[1:]]
    held = [sum(b is not bm.null_block for b in t) for t in tables]
    assert held[0] == 2048 and all(h <= 512 // 16 + 2 for h in held[1:])
    assert bm.num_used_blocks == sum(held)
    layer_blocks = bm.num_used_blocks * lay.layers_per_block
    assert 2048 * 18 / layer_blocks > 5
    assert lay.blocks_needed(32768, 16, 512) >= bm.num_used_blocks
    bm.free("long")
    assert bm.is_at_baseline()
    bm.check_integrity()


def test_sliding_hit_needs_only_the_window_before_its_end() -> None:
    """A cached prompt whose early local blocks were evicted is still a hit (those are out of the window); losing
    a block inside the window shortens the hit to before it."""
    bm = BlockManager(64, BS, windows=(0, 8))
    tokens = list(range(100, 141))  # 41 tokens: 10 full blocks
    a = make_request("a", tokens)
    assert admit(bm, a)
    bm.free("a")
    local = bm.group_cached[1]
    # admit freed the local blocks before the window only at the next allocation: all 10 are cached
    assert len(local) == 10 and len(bm.cached) == 10
    early = [blk for blk in local.values() if blk.token_ids[0] < 108]
    for blk in early:  # evict the local group's first two blocks
        bm._drop_hash(blk)
    hit, n = bm.get_computed_blocks(make_request("b", tokens))
    assert n == 40 and hit.groups[1][:8] == [bm.null_block] * 8
    assert all(b is not bm.null_block for b in hit.groups[1][8:])
    assert [b.token_ids for b in hit.groups[0]] == [tuple(tokens[i * BS:(i + 1) * BS]) for i in range(10)]
    in_window = next(blk for blk in local.values() if blk.token_ids[0] == 132)  # block 8: window of the end
    bm._drop_hash(in_window)
    hit, n = bm.get_computed_blocks(make_request("c", tokens))
    assert n == 32  # ends at block 8; its window (blocks 6, 7) is still cached
    assert hit.groups[1][:6] == [bm.null_block] * 6 and len(hit.groups[1]) == 8
    bm.check_integrity()


def test_groups_release_everything_and_trim() -> None:
    bm = BlockManager(40, BS, windows=(0, 6, 6))
    req = make_request("r", list(range(50, 80)))
    assert admit(bm, req)
    for _ in range(12):
        req.append_output_token(3)
        assert bm.allocate_slots(req, 1 + 2)  # a decode with two drafts
        req.num_computed_tokens += 1  # drafts rejected
        bm.cache_full_blocks(req)
        bm.trim(req)
        bm.check_integrity()
    sliding = [sum(b is not bm.null_block for b in g["r"]) for g in bm.group_blocks[1:]]
    assert all(n <= 3 for n in sliding)
    bm.free("r")
    assert bm.is_at_baseline()


class GroupedBlockManagerMachine(RuleBasedStateMachine):
    """Random admissions (with prefix hits), decodes and frees over a full and two sliding groups keep every
    invariant, and every block a hit hands back holds the tokens it stands for in its own group (the K/V each
    block would hold are tracked as (group, tokens) when a request computes them)."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=48, block_size=BS, windows=(0, 6, 9))
        self.live: dict[str, Any] = {}
        self.content: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.n = 0

    def _written(self, req: Any, start: int) -> None:
        """The request computed tokens [start, num_computed_tokens): record what its blocks now hold."""
        tokens = req.all_token_ids
        for g, group in enumerate(self.bm.group_blocks):
            table = group[req.request_id]
            for i in range(start // BS, -(-req.num_computed_tokens // BS)):
                blk = table[i]
                if blk is not self.bm.null_block:
                    self.content[blk.block_id] = (g, tuple(tokens[i * BS:(i + 1) * BS]))

    @rule(prefix=st.sampled_from([[], list(range(1, 13)), list(range(1, 21)), [9] * 8]),
          tail=st.lists(st.integers(3, 12), min_size=1, max_size=10))
    def allocate(self, prefix: list[int], tail: list[int]) -> None:
        self.n += 1
        req = make_request(f"r{self.n}", prefix + tail)
        hit, n_cached = self.bm.get_computed_blocks(req)
        tokens = req.all_token_ids
        for g, blocks in enumerate(hit.groups):
            assert len(blocks) == len(hit)
            lo = self.bm.first_needed_block(n_cached, self.bm.windows[g])
            for i, blk in enumerate(blocks):
                if i < lo:
                    assert blk is self.bm.null_block
                else:  # a block the next query reads holds this group's K/V of these tokens
                    assert self.content[blk.block_id] == (g, tuple(tokens[i * BS:(i + 1) * BS]))
        if self.bm.allocate_slots(req, req.num_tokens - n_cached, hit):
            req.num_computed_tokens = req.num_tokens
            self._written(req, n_cached)
            self.bm.cache_full_blocks(req)
            self.live[req.request_id] = req

    @precondition(lambda self: self.live)
    @rule(data=st.data(), k=st.integers(1, 5))
    def decode(self, data: st.DataObject, k: int) -> None:
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        for _ in range(k):
            req.append_output_token(20 + req.num_tokens % 7)
            if not self.bm.allocate_slots(req, 1):
                req.output_token_ids.pop()  # not computed: a preemption would follow
                return
            start = req.num_computed_tokens
            req.num_computed_tokens += 1
            self._written(req, start)
            self.bm.cache_full_blocks(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.bm.free(rid)
        del self.live[rid]

    @invariant()
    def consistent(self) -> None:
        self.bm.check_integrity()
        for rid, req in self.live.items():
            for g, w in enumerate(self.bm.windows):
                table = self.bm.group_blocks[g][rid]
                assert len(table) * BS >= req.num_computed_tokens
                # what the next query reads is held: the blocks of its window
                first = self.bm.first_needed_block(req.num_computed_tokens, w)
                last = -(-req.num_computed_tokens // BS)
                assert all(b is not self.bm.null_block for b in table[first:last])

    def teardown(self) -> None:
        for rid in list(self.live):
            self.bm.free(rid)
        assert self.bm.is_at_baseline()


TestGroupedBlockManagerMachine = GroupedBlockManagerMachine.TestCase
TestGroupedBlockManagerMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


# ---- the engine on a tiny Gemma 3 (layers: local, global, local; window 24) ----------------------------------------

NEW = 96
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def _run(llm: Any, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Greedy tokens of the prompts run together, and the most blocks the pool had in use at once."""
    engine = llm.engine
    reqs = [engine.add_request({"prompt_token_ids": p}, GREEDY) for p in prompts]
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.block_manager.num_used_blocks)
    assert engine.block_manager.is_at_baseline() or engine.block_manager.num_used_blocks == 0
    return [list(r.output_token_ids) for r in reqs], peak


@pytest.mark.parametrize("kernels_choice,attention", [("native", "auto"), ("torch", "sdpa"), ("torch", "flex")])
def test_engine_groups_match_one_table_with_fewer_blocks(make_llm: Any, kernels_choice: str,
                                                          attention: str) -> None:
    """Long prompts (chunked at 32 tokens) and 96 new tokens each, window 24: the grouped cache gives the same
    greedy tokens as one table of every layer, holds fewer layer-blocks at its peak, and returns to baseline."""
    if kernels_choice == "native" and not kernels.available():
        pytest.skip("native kernels are not built")
    hf = make_tiny_hf_model("gemma3")
    prompts = [list(range(300 + 7 * i, 300 + 7 * i + 90 + 13 * i)) for i in range(3)]
    opts = dict(hf_model=hf, kernels=kernels_choice, attention_backend=attention, max_num_batched_tokens=32,
                block_size=4, num_kv_blocks=1200)  # room to keep every block cached for the second run
    plain_llm = make_llm(disable_hybrid_kv_cache_manager=True, **opts)
    grouped_llm = make_llm(**opts)
    assert plain_llm.engine.kv_layout.num_groups == 1
    assert grouped_llm.engine.kv_layout.windows == (0, 24, 24)
    plain, plain_peak = _run(plain_llm, prompts)
    grouped, grouped_peak = _run(grouped_llm, prompts)
    assert grouped == plain
    # layer-blocks at the peak: one table holds 3 layers a block for every token; groups hold 1 layer a block
    assert grouped_peak * 1 < plain_peak * 3 * 0.7
    again, _ = _run(grouped_llm, prompts)  # from the prefix cache: a hit needs the window before its end only
    assert again == plain
    assert grouped_llm.engine.block_manager.stats.hits > 0
    grouped_llm.engine.block_manager.check_integrity()


def test_parts_that_move_whole_blocks_keep_one_table(make_llm: Any, tmp_path: Any) -> None:
    """The disk tier moves whole blocks: with it, a sliding-window model keeps one table of every layer."""
    hf = make_tiny_hf_model("gemma3")
    llm = make_llm(hf_model=hf, kernels="torch", kv_offload_dir=str(tmp_path))
    assert llm.engine.kv_layout.num_groups == 1 and llm.engine.runner.kv_cache.shape[0] == 3
    llm.engine.close()


def test_requests_past_the_grouped_pool_are_refused_with_a_code(make_llm: Any) -> None:
    """Input limits count a request's blocks by group: a full group holds every token, a sliding one its window
    plus the largest chunk. A request past the pool is refused (context_length_exceeded) and holds no block; one
    that fits runs and the pool returns to baseline."""
    from pdserve.errors import ErrorCode, RequestRejected

    llm = make_llm(hf_model=make_tiny_hf_model("gemma3"), kernels="torch", block_size=4, num_kv_blocks=60,
                   max_num_batched_tokens=32)
    lay, eng = llm.engine.kv_layout, llm.engine
    assert lay.blocks_needed(108, 4, 32) == 27 + 2 * 15 <= 60 < lay.blocks_needed(200, 4, 32)
    with pytest.raises(RequestRejected) as e:
        eng.add_request({"prompt_token_ids": list(range(300, 400))}, SamplingParams(max_tokens=100))
    assert (e.value.code, e.value.param) == (ErrorCode.CONTEXT_LENGTH_EXCEEDED, "max_tokens")
    assert eng.block_manager.is_at_baseline() and not eng.has_unfinished_requests()
    tokens, _ = _run(llm, [list(range(300, 312))])  # 12 + 96 tokens: 57 blocks, fits
    assert len(tokens[0]) == NEW and eng.block_manager.is_at_baseline()

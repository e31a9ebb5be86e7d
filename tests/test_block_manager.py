"""Block manager: prefix caching rules, LRU eviction, and a stateful property test of its invariants."""

from __future__ import annotations

import os

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.engine.block_manager import BlockManager, hash_block, root_hash
from pdserve.engine.request import Request
from pdserve.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(), eos_token_ids={2}, max_tokens=8, cache_salt=cache_salt)


def admit(bm: BlockManager, req: Request) -> bool:
    """What the scheduler does for a waiting request: prefix lookup, then allocate the rest."""
    blocks, n_cached = bm.get_computed_blocks(req)
    ok = bm.allocate_slots(req, req.num_tokens - n_cached, blocks)
    if ok:
        bm.record_lookup(req.num_tokens, n_cached)
        req.num_computed_tokens = req.num_tokens
        bm.cache_full_blocks(req)
    return ok


def fork(bm: BlockManager, parent_id: str, child_id: str, num_computed_tokens: int) -> int:
    """Share the parent's full, computed blocks with a new request (copy-free). Returns the tokens the child may
    treat as computed; a partial last block is never shared, so a shared block is never written again."""
    assert child_id not in bm.req_blocks
    parent_blocks = bm.req_blocks.get(parent_id, [])
    shared = parent_blocks[:min(num_computed_tokens // bm.block_size, len(parent_blocks))]
    for blk in shared:
        blk.ref_cnt += 1  # a held block is never in the free queue
    bm.req_blocks[child_id] = list(shared)
    bm.req_num_hashed[child_id] = min(len(shared), bm.req_num_hashed.get(parent_id, 0))
    bm.req_hashes[child_id] = bm.req_hashes.get(parent_id, [])[:bm.req_num_hashed[child_id]]
    return len(shared) * bm.block_size


def forget_cached_blocks(bm: BlockManager) -> None:
    """Drop the hashes of all free blocks: the prefix cache forgets everything nobody holds."""
    for blk in bm.free_queue.values():
        if blk.block_hash is not None:
            if bm.cached.get(blk.block_hash) is blk:
                del bm.cached[blk.block_hash]
            blk.reset_hash()


def test_hit_capped_at_prompt_minus_one() -> None:
    bm = BlockManager(16, BS)
    a = make_request("a", list(range(8)))  # exactly two full blocks
    assert admit(bm, a)
    bm.free("a")
    b = make_request("b", list(range(8)))
    blocks, n = bm.get_computed_blocks(b)
    assert n == 4 and len(blocks) == 1  # the last token must be computed, so the second block is not reused
    c = make_request("c", list(range(9)))
    assert bm.get_computed_blocks(c)[1] == 8


def test_hit_confirmed_by_tokens_not_hash_alone() -> None:
    bm = BlockManager(16, BS)
    a = make_request("a", [5, 6, 7, 8, 9])
    assert admit(bm, a)
    blk = bm.req_blocks["a"][0]
    blk.token_ids = (0, 0, 0, 0)  # simulate a hash collision: same hash, other tokens
    assert bm.get_computed_blocks(make_request("b", [5, 6, 7, 8, 1]))[1] == 0


def test_chained_hash_depends_on_prefix() -> None:
    bm = BlockManager(16, BS)
    assert admit(bm, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # same second block, different first block: no hit at all
    assert bm.get_computed_blocks(make_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9]))[1] == 0
    assert bm.get_computed_blocks(make_request("c", [1, 2, 3, 4, 5, 6, 7, 8, 0]))[1] == 8


def test_freed_blocks_stay_cached_until_evicted_lru() -> None:
    bm = BlockManager(4, BS)
    assert admit(bm, make_request("a", list(range(100, 109))))  # 3 blocks, 2 full+hashed
    bm.free("a")
    assert bm.num_free_blocks == 4 and len(bm.cached) == 2
    assert bm.get_computed_blocks(make_request("a2", list(range(100, 109))))[1] == 8
    # a request that needs 3 fresh blocks evicts the uncached block first, then the LRU cached ones
    assert admit(bm, make_request("b", list(range(200, 209))))
    assert bm.get_computed_blocks(make_request("a3", list(range(100, 109))))[1] < 8
    bm.check_integrity()


def test_allocation_is_all_or_nothing() -> None:
    bm = BlockManager(3, BS)
    req = make_request("a", list(range(20)))  # needs 5 blocks
    assert not bm.allocate_slots(req, 20)
    assert bm.num_free_blocks == 3 and "a" not in bm.req_blocks
    bm.check_integrity()


def test_fork_shares_full_blocks_only() -> None:
    bm = BlockManager(8, BS)
    a = make_request("a", list(range(10)))
    assert admit(bm, a)
    shared = fork(bm, "a", "child", a.num_computed_tokens)
    assert shared == 8
    assert bm.get_block_ids("child") == bm.get_block_ids("a")[:2]
    assert all(b.ref_cnt == 2 for b in bm.req_blocks["a"][:2])
    bm.free("a")
    bm.free("child")
    assert bm.is_at_baseline()
    bm.check_integrity()


def test_two_requests_share_prefix_blocks() -> None:
    bm = BlockManager(16, BS)
    assert admit(bm, make_request("a", list(range(13))))
    b = make_request("b", list(range(12)) + [99, 98])
    assert admit(bm, b)
    assert bm.get_block_ids("a")[:3] == bm.get_block_ids("b")[:3]
    assert bm.stats.hits == 12
    bm.free("a")
    bm.check_integrity()
    bm.free("b")
    assert bm.is_at_baseline()


def test_in_flight_prefix_block_names_its_writer() -> None:
    """A request computing its prompt names the next prompt block it writes; a waiting request whose first block
    to compute after its hit is that one sees the writer, until the writer hashed it (then it hits it). Salts
    keep their own chains; a freed or forgotten writer names nothing."""
    bm = BlockManager(32, BS)
    prompt = list(range(30))
    a = make_request("a", prompt)
    hit, n = bm.get_computed_blocks(a)
    assert bm.allocate_slots(a, 30, hit)
    bm.note_writing(a)
    b = make_request("b", prompt[:21] + [99])
    assert bm.in_flight_writer(b, bm.get_computed_blocks(b)[0]) == "a"
    assert bm.in_flight_writer(make_request("s", prompt, cache_salt="x"), hit) is None
    assert bm.in_flight_writer(make_request("o", [7] + prompt[1:]), hit) is None
    a.num_computed_tokens = 10  # a chunk: blocks 0-1 hashed, block 2 in flight
    bm.cache_full_blocks(a)
    hit_b, n_b = bm.get_computed_blocks(b)
    assert n_b == 8 and bm.in_flight_writer(b, hit_b) == "a"
    a.num_computed_tokens = 28  # past b's shared blocks: b hits them and computes the rest itself
    bm.cache_full_blocks(a)
    hit_b, n_b = bm.get_computed_blocks(b)
    assert n_b == 20 and bm.in_flight_writer(b, hit_b) is None
    assert not bm.writing  # a's last full prompt block (6) is hashed: nothing of its prompt is in flight
    d = make_request("d", list(range(100, 130)))
    assert bm.allocate_slots(d, 30)
    bm.note_writing(d)
    e = make_request("e", list(range(100, 110)))
    assert bm.in_flight_writer(e, bm.get_computed_blocks(e)[0]) == "d"
    bm.free("d")
    assert not bm.writing and not bm.req_writing
    bm.free("a")
    assert bm.is_at_baseline()
    bm.check_integrity()


def test_cache_salt_isolates_prefixes() -> None:
    """Different salts never share blocks (a tenant cannot probe another's prompts via cached_tokens); the same
    salt still shares, and no salt is a salt of its own."""
    bm = BlockManager(32, BS)
    prompt = list(range(13))  # 3 full blocks
    assert admit(bm, make_request("a", prompt, cache_salt="tenant-a"))
    assert bm.get_computed_blocks(make_request("b", prompt, cache_salt="tenant-b"))[1] == 0
    assert bm.get_computed_blocks(make_request("n", prompt))[1] == 0
    assert bm.get_computed_blocks(make_request("a2", prompt, cache_salt="tenant-a"))[1] == 12
    assert admit(bm, make_request("n2", prompt))  # unsalted copy: its own blocks
    assert bm.get_computed_blocks(make_request("s", prompt, cache_salt="租户甲"))[1] == 0
    assert bm.get_computed_blocks(make_request("n3", prompt))[1] == 12
    assert not set(bm.get_block_ids("a")) & set(bm.get_block_ids("n2"))
    bm.free("a")
    bm.free("n2")
    assert bm.is_at_baseline()
    bm.check_integrity()


def test_block_hashes_are_stable_across_processes() -> None:
    """PD instances and restarts must agree on hashes: no str or None hashing (randomized per process)."""
    import subprocess
    import sys

    import pdserve.engine.block_manager as bm
    import pdserve.prefix_hash as ph

    # the block manager hashes with pdserve.prefix_hash's functions; the child processes import only that module
    # (no torch: a fraction of a second instead of seconds each)
    assert (bm.hash_block, bm.root_hash) == (ph.hash_block, ph.root_hash)
    code = ("from pdserve.prefix_hash import hash_block, root_hash; "
            "print(hash_block(root_hash(None), (1, 2)), hash_block(root_hash('盐'), (1, 2)))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(outs) == 1
    assert root_hash(None) == 0 and root_hash("a") != root_hash("b") and root_hash("a") != 0


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / evict sequences keep every invariant, and freeing everything
    returns the pool to baseline."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=24, block_size=BS, enable_prefix_caching=True)
        self.live: dict[str, Request] = {}
        self.n = 0

    @rule(prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9]]),
          tail=st.lists(st.integers(3, 12), min_size=1, max_size=14))
    def allocate(self, prefix: list[int], tail: list[int]) -> None:
        self.n += 1
        req = make_request(f"r{self.n}", prefix + tail)
        before = self.bm.num_free_blocks
        if admit(self.bm, req):
            self.live[req.request_id] = req
            assert self.bm.num_free_blocks <= before
        else:
            assert req.request_id not in self.bm.req_blocks

    @rule(prefix=st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9]]),
          tail=st.lists(st.integers(3, 12), min_size=1, max_size=14), done=st.integers(0, 12))
    def start_prompt(self, prefix: list[int], tail: list[int], done: int) -> None:
        """Admitted as the scheduler does, its prompt computed only in part (a chunk): its next block in flight."""
        self.n += 1
        req = make_request(f"r{self.n}", prefix + tail)
        hit, n_cached = self.bm.get_computed_blocks(req)
        if self.bm.allocate_slots(req, req.num_tokens - n_cached, hit):
            req.num_computed_tokens = min(n_cached + done, req.num_tokens)
            self.bm.note_writing(req)
            self.bm.cache_full_blocks(req)
            self.live[req.request_id] = req

    @precondition(lambda self: self.live)
    @rule(data=st.data(), k=st.integers(1, 6))
    def append(self, data: st.DataObject, k: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live[rid]
        if self.bm.allocate_slots(req, req.num_tokens + k - req.num_computed_tokens):  # pending + k new
            for t in range(k):
                req.append_output_token(20 + t)
            req.num_computed_tokens = req.num_tokens
            self.bm.cache_full_blocks(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        parent = self.live[rid]
        self.n += 1
        child = make_request(f"r{self.n}", list(parent.all_token_ids))
        child.num_computed_tokens = fork(self.bm, rid, child.request_id, parent.num_computed_tokens)
        self.live[child.request_id] = child

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.bm.free(rid)
        del self.live[rid]

    @rule()
    def evict_all_cached(self) -> None:
        forget_cached_blocks(self.bm)

    @invariant()
    def consistent(self) -> None:
        self.bm.check_integrity()
        for rid, req in self.live.items():
            table = self.bm.req_blocks[rid]
            assert len(table) * BS >= req.num_computed_tokens
            if rid in self.bm.req_writing:  # the first block it has not hashed, a full block of its prompt
                n = self.bm.req_num_hashed.get(rid, 0)
                assert (n + 1) * BS <= req.num_prompt_tokens and n * BS <= req.num_computed_tokens < (n + 1) * BS
                parent = self.bm.req_hashes[rid][n - 1] if n else root_hash(None)
                assert self.bm.req_writing[rid] == hash_block(parent, req.all_token_ids[n * BS:(n + 1) * BS])

    def teardown(self) -> None:
        for rid in list(self.live):
            self.bm.free(rid)
        self.bm.check_integrity()
        assert self.bm.is_at_baseline()


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)

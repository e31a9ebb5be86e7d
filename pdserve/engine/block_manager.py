"""Paged KV cache bookkeeping: blocks, ref counts, automatic prefix caching with LRU eviction.

Only block *ids* live here; the K/V tensors live in the model runner. Block `b` holds the K/V of token slots
`b * block_size ... b * block_size + block_size - 1` in every layer of the KV cache group that holds it (one group
of every layer unless the model has sliding windows: model/kv_layout.py), so a request's `block_table` in a group
(list of block ids) plus a token position gives its slot: `block_table[pos // bs] * bs + pos % bs`.

Block states (invariant checked by `check_integrity`):

    used   ref_cnt > 0, held by >= 1 request (ref_cnt == number of holders); may carry a prefix hash
    free   ref_cnt == 0, in `free_queue` (LRU order: evict from the front); may still carry a hash
           ("cached": a later request with the same prefix can take it back without recompute)

    num_used + len(free_queue) == num_blocks, always.

Prefix hashes are chained over *full* blocks: hash_i = hash((hash_{i-1}, tokens of block i)), starting from
hash_{-1} = root_hash(the request's cache_salt). A lookup is confirmed by comparing the stored parent hash and
tokens, so a hash collision can never return wrong K/V, and requests with different salts never share a block
(one tenant cannot learn from `cached_tokens` what another sent). Every hash is an int computed from ints only, so
it is the same in every process (no PYTHONHASHSEED; `hash(None)` is not stable before Python 3.12); the hashing
lives in pdserve/prefix_hash.py, shared with the router, which computes the same chains to route by prefix.
`cache_version` counts changes to the set of cached hashes, so a published copy is rebuilt only when it moved.

In-flight prefixes: a request computing its prompt records the hash of the next full prompt block it writes
(`writing`, moved on as its blocks are hashed). A waiting request whose own next block, after its cache hit, is
that block would compute the same K/V a second time; the scheduler holds it until the writer has hashed the block
(`in_flight_writer`), and it then hits. Lookups count in `stats` once per admission (`record_lookup`), not once per
step a request waits at the head of the queue.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.engine.request import Request
from pdserve.prefix_hash import hash_block, root_hash

__all__ = ["BlockManager", "KVCacheBlock", "KVSequence", "PrefixCacheStats", "PrefixHit", "hash_block", "root_hash"]


class KVSequence(Protocol):
    """What allocation reads of a sequence (a Request)."""

    request_id: str
    num_computed_tokens: int  # tokens whose K/V are in this pool


@dataclass
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    parent_hash: int | None = None  # hash of the previous block in the chain (root_hash(salt) for the first)
    token_ids: tuple[int, ...] = ()  # tokens of a full, hashed block; used to confirm a hit
    group: int = 0  # the KV cache group whose cached map holds its hash

    def reset_hash(self) -> None:
        self.block_hash, self.parent_hash, self.token_ids = None, None, ()


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache


class PrefixHit(list[KVCacheBlock]):
    """get_computed_blocks' answer: group 0's cached blocks (the list itself), every group's (`groups`, the null
    block where a sliding group needs none) and the hash chain of those blocks (`hashes`)."""

    def __init__(self, groups: Sequence[list[KVCacheBlock]] = ([],), hashes: Sequence[int] = ()) -> None:
        super().__init__(groups[0])
        self.groups = list(groups)
        self.hashes = list(hashes)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: Sequence[int] = (0,)) -> None:
        """`windows`: one per KV cache group (model/kv_layout.py), its sliding window (0: full attention). Each
        group holds one block table per request, all of the same length; a sliding group's table holds the null
        block (id num_blocks: the cache's scratch block, never handed out) where its blocks fell out of the window
        of every query to come, and those blocks return to the pool."""
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(int(w) for w in windows)
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = KVCacheBlock(num_blocks)  # stands in a sliding group's table for a freed block
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        # per group: block_hash -> block holding that prefix; request_id -> its block table
        self.group_cached: list[dict[int, KVCacheBlock]] = [{} for _ in self.windows]
        self.group_blocks: list[dict[str, list[KVCacheBlock]]] = [{} for _ in self.windows]
        self.cached, self.req_blocks = self.group_cached[0], self.group_blocks[0]
        self.cache_version = 0  # bumped whenever a hash enters or leaves a group's cached map
        self.req_num_hashed: dict[str, int] = {}  # request_id -> number of its leading blocks hashed (every group)
        self.req_hashes: dict[str, list[int]] = {}  # request_id -> hash chain of its leading full blocks
        self.req_skipped: dict[str, list[int]] = {}  # request_id -> per group, leading blocks freed (null)
        self.stats = PrefixCacheStats()
        self.num_window_freed = 0  # blocks sliding groups returned because they fell out of the window (total)
        # never-used blocks leave the free queue in id order: every block below this one has been handed out
        self.high_water = 0
        # blocks hashed since the disk tier last took them (engine/kv_offload.py); None: nobody records them
        self.newly_cached: list[KVCacheBlock] | None = None
        # in-flight prefixes (module doc): hash of the next prompt block a request writes -> that request, and back
        self.writing: dict[int, str] = {}
        self.req_writing: dict[str, int] = {}

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        """Group 0's block table of the request."""
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """The block tables of groups 1.. (none with one group)."""
        return [[b.block_id for b in g.get(request_id, ())] for g in self.group_blocks[1:]]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_needed_block(self, num_tokens: int, window: int) -> int:
        """The first block a query at position num_tokens (or later) reads in a group with this window: the keys
        it sees start at num_tokens - window + 1. 0 for full attention."""
        return max(0, num_tokens - window + 1) // self.block_size if window else 0

    # ---- prefix cache --------------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[PrefixHit, int]:
        """Longest run of cached full blocks matching the request's tokens, capped at num_tokens - 1 tokens so
        the last token is always computed (its logits are needed). Does not take references. A request whose
        prompt positions must be computed (prompt logprobs not yet scored) takes no hits, as vLLM. With sliding
        groups, a hit of n blocks needs, in each of them, only the blocks of the window before block n."""
        if not self.enable_prefix_caching or request.needs_prompt_rows:
            return PrefixHit([[] for _ in self.windows]), 0
        hit = self._match_groups(request)
        return hit, len(hit) * self.block_size

    def record_lookup(self, num_tokens: int, num_cached: int) -> None:
        """Count an admitted request's lookup: num_tokens looked up, num_cached of them hit."""
        if self.enable_prefix_caching:
            self.stats.queries += num_tokens
            self.stats.hits += num_cached

    def note_writing(self, request: Request) -> None:
        """Record the request's next block to be written (its first block not hashed) as in flight when it is a full
        block of its prompt; any earlier record of the request is dropped."""
        rid = request.request_id
        self.forget_writing(rid)
        if not self.enable_prefix_caching or rid not in self.req_blocks:
            return
        n, bs = self.req_num_hashed.get(rid, 0), self.block_size
        if (n + 1) * bs > request.num_prompt_tokens:
            return
        h = self._block_hash(request, self.req_hashes.get(rid, []), n)
        if self.writing.setdefault(h, rid) == rid:  # the first writer keeps the record
            self.req_writing[rid] = h

    def in_flight_writer(self, request: Request, hit: PrefixHit) -> str | None:
        """The request now writing the block this (waiting) request would compute first after its hit, if any."""
        if not self.writing or request.needs_prompt_rows:
            return None
        n = len(hit)
        if (n + 1) * self.block_size > len(request.all_token_ids) - 1:  # not a block a lookup could hit
            return None
        return self.writing.get(self._block_hash(request, hit.hashes, n))

    def _block_hash(self, request: Request, chain: Sequence[int], n: int) -> int:
        """The hash of the request's block n, chained from chain[n - 1] (its first n blocks' hashes)."""
        parent = chain[n - 1] if n else root_hash(request.cache_salt, request.lora_int_id)
        bs = self.block_size
        return hash_block(parent, request.all_token_ids[n * bs:(n + 1) * bs])

    def forget_writing(self, rid: str) -> None:
        """The request writes no prompt block any more (finished, aborted, preempted)."""
        h = self.req_writing.pop(rid, None)
        if h is not None and self.writing.get(h) == rid:
            del self.writing[h]

    def match_prefix(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The cached blocks of group 0 on the request's longest matching prefix (of its first num_tokens - 1
        tokens, full blocks) and the hash the next block chains from. Counts nothing."""
        hits: list[KVCacheBlock] = []
        parent = root_hash(request.cache_salt, request.lora_int_id)
        for h, p, chunk in self._chain(request):
            blk = self._lookup(0, h, p, chunk)
            if blk is None:
                break
            hits.append(blk)
            parent = h
        return hits, parent

    def _chain(self, request: Request) -> Iterator[tuple[int, int, tuple[int, ...]]]:
        """(hash, parent hash, tokens) of each full block of the request's first num_tokens - 1 tokens."""
        tokens, bs = request.all_token_ids, self.block_size
        parent = root_hash(request.cache_salt, request.lora_int_id)
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = hash_block(parent, chunk)
            yield h, parent, chunk
            parent = h

    def _lookup(self, group: int, h: int, parent: int, chunk: tuple[int, ...]) -> KVCacheBlock | None:
        """The group's cached block for this chain link; the stored parent and tokens confirm it (no collision)."""
        blk = self.group_cached[group].get(h)
        return blk if blk is not None and blk.parent_hash == parent and blk.token_ids == chunk else None

    def _match_groups(self, request: Request) -> PrefixHit:
        """Every group's hit on the longest prefix all groups can serve: a full group needs each block of it, a
        sliding group only those of the window before its end. Ends shrink until every group agrees."""
        links: list[tuple[int, int, tuple[int, ...]]] = []
        first: list[KVCacheBlock | None] = []  # group 0's lookups
        for link in self._chain(request):
            blk = self._lookup(0, *link)
            if blk is None and self.windows[0] == 0:
                break  # a full-attention group 0 bounds the hit
            links.append(link)
            first.append(blk)
        found = [first] + [[self._lookup(g, *link) for link in links] for g in range(1, len(self.windows))]
        end = len(links)
        if len(self.windows) == 1 and self.windows[0] == 0:  # one full group: its run is the hit
            return PrefixHit([[b for b in first if b is not None]], [h for h, _, _ in links])
        while True:
            new = min(self._hit_end(f, end, w) for f, w in zip(found, self.windows))
            if new == end:
                break
            end = new
        groups = []
        for f, w in zip(found, self.windows):
            lo = self.first_needed_block(end * self.block_size, w)
            blocks = [self.null_block] * lo + [b for b in f[lo:end] if b is not None]
            assert len(blocks) == end
            groups.append(blocks)
        return PrefixHit(groups, [h for h, _, _ in links[:end]])

    def _hit_end(self, found: list[KVCacheBlock | None], end: int, window: int) -> int:
        """The largest e <= end whose blocks [first_needed_block(e), e) are all in `found`."""
        while end > 0:
            lo = self.first_needed_block(end * self.block_size, window)
            miss = next((i for i in range(end - 1, lo - 1, -1) if found[i] is None), None)
            if miss is None:
                return end
            end = miss  # every end in (miss, end) needs block `miss` too (lo grows with the end)
        return 0

    def cache_full_blocks(self, request: Request) -> None:
        """Register hashes of the request's blocks that became full of computed tokens (in every group; a
        sliding group's blocks are hashed before they can fall out of its window)."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        n_full = min(request.num_computed_tokens // self.block_size, len(self.req_blocks.get(rid, ())))
        done = self.req_num_hashed.get(rid, 0)
        if n_full <= done:
            return
        chain = self.req_hashes.setdefault(rid, [])
        parent = chain[done - 1] if done > 0 else root_hash(request.cache_salt, request.lora_int_id)
        tables = [g.get(rid, []) for g in self.group_blocks]
        tokens, bs = request.all_token_ids, self.block_size
        for i in range(done, n_full):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = chain[i] if i < len(chain) else hash_block(parent, chunk)
            if i == len(chain):
                chain.append(h)
            for g, table in enumerate(tables):
                blk = table[i]
                if blk is self.null_block or blk.block_hash is not None:
                    continue
                blk.block_hash, blk.parent_hash, blk.token_ids, blk.group = h, parent, chunk, g
                cached = self.group_cached[g]
                if h not in cached:  # keep the first copy if two requests computed the same prefix
                    cached[h] = blk
                    self.cache_version += 1
                    if g == 0 and self.newly_cached is not None:
                        self.newly_cached.append(blk)
            parent = h
        self.req_num_hashed[rid] = n_full
        self.note_writing(request)

    # ---- allocation ----------------------------------------------------------------------------------------
    def allocate_slots(self, request: KVSequence, num_new_tokens: int,
                       computed_blocks: Sequence[KVCacheBlock] = ()) -> bool:
        """Make the request's block tables cover num_computed_tokens (+ computed_blocks) + num_new_tokens tokens,
        after freeing the blocks that fell out of its sliding groups' windows. All or nothing otherwise: returns
        False and allocates nothing when too few blocks can be had."""
        rid = request.request_id
        hit = computed_blocks if isinstance(computed_blocks, PrefixHit) else PrefixHit(
            [list(computed_blocks)] + [[] for _ in self.windows[1:]], [b.block_hash or 0 for b in computed_blocks])
        assert len(computed_blocks) == 0 or len(self.windows) == 1 or isinstance(computed_blocks, PrefixHit)
        tables = [g.get(rid, []) for g in self.group_blocks]
        for g, w in enumerate(self.windows):
            if w and tables[g]:
                self._free_skipped(rid, g, request.num_computed_tokens)
        total = self.blocks_needed(request.num_computed_tokens + len(hit) * self.block_size + num_new_tokens)
        need = sum(max(0, total - len(t) - len(c)) for t, c in zip(tables, hit.groups))
        # computed blocks that sit in the free queue are revived, so they do not count as free for new ones
        revive = sum(1 for c in hit.groups for b in c if b is not self.null_block and b.ref_cnt == 0)
        if need > self.num_free_blocks - revive:
            return False
        num_hashed = len(tables[0]) + len(hit)
        for g, (held, computed) in enumerate(zip(tables, hit.groups)):  # every hit revived before any eviction
            table = self.group_blocks[g].setdefault(rid, held)
            for blk in computed:
                if blk is not self.null_block:
                    self._touch(blk)
                table.append(blk)
        for g in range(len(self.windows)):
            table = self.group_blocks[g][rid]
            while len(table) < total:
                table.append(self._pop_free())
        if len(hit):
            self.req_num_hashed[rid] = num_hashed
            self.req_hashes[rid] = list(hit.hashes)
            self.req_skipped[rid] = [self.first_needed_block(len(hit) * self.block_size, w) for w in self.windows]
        return True

    def _free_skipped(self, rid: str, group: int, num_computed: int) -> None:
        """A sliding group's blocks that no query to come reads go back to the pool (hashed ones stay cached)."""
        table = self.group_blocks[group][rid]
        skipped = self.req_skipped.setdefault(rid, [0] * len(self.windows))
        end = min(len(table), self.first_needed_block(num_computed, self.windows[group]))
        for i in range(skipped[group], end):
            blk = table[i]
            if blk is not self.null_block:
                table[i] = self.null_block
                self._release(blk)
                self.num_window_freed += 1
        skipped[group] = max(end, skipped[group])

    def trim(self, request: KVSequence) -> None:
        """Free the blocks past those holding the request's computed tokens (speculative decoding: blocks that only
        rejected drafts used). They never carry a hash (only blocks full of computed tokens are hashed): queued
        first, for reuse before any cached block."""
        keep = self.blocks_needed(request.num_computed_tokens)
        for group in self.group_blocks:
            table = group.get(request.request_id)
            while table and len(table) > keep:
                blk = table.pop()
                assert blk.block_hash is None and blk.ref_cnt == 1, "a draft block is never shared nor hashed"
                self._release(blk)

    def free(self, request_id: str) -> None:
        """Drop the request's references. Blocks keep their hash; tail blocks are queued first so they are
        evicted before the (more shareable) head of the prefix."""
        for group in self.group_blocks:
            for blk in reversed(group.pop(request_id, [])):
                if blk is not self.null_block:
                    self._release(blk)
        self.req_num_hashed.pop(request_id, None)
        self.req_hashes.pop(request_id, None)
        self.req_skipped.pop(request_id, None)
        self.forget_writing(request_id)

    def _release(self, blk: KVCacheBlock) -> None:
        """One reference less; a block nobody holds joins the free queue: uncached ones first (reused first),
        cached ones last (evicted last)."""
        blk.ref_cnt -= 1
        if blk.ref_cnt == 0:
            self.free_queue[blk.block_id] = blk
            if blk.block_hash is None or not self.enable_prefix_caching:
                self.free_queue.move_to_end(blk.block_id, last=False)

    def refresh(self, blk: KVCacheBlock) -> None:
        """A cached block just looked up: a free one becomes the most recently freed (evicted last)."""
        if blk.ref_cnt == 0:
            self.free_queue.move_to_end(blk.block_id)

    def adopt_cached(self, block_hash: int, parent_hash: int, token_ids: Sequence[int]) -> KVCacheBlock:
        """A free block (the LRU victim) to hold a prefix block whose K/V the caller writes now, from outside the
        pool (the disk tier): hashed and queued as the most recently freed, as if a request had computed and freed
        it. The caller checks there is a free block and that no block holds the hash."""
        assert block_hash not in self.cached
        blk = self._pop_free()
        blk.ref_cnt = 0
        blk.block_hash, blk.parent_hash, blk.token_ids = block_hash, parent_hash, tuple(token_ids)
        self.cached[block_hash] = blk
        self.cache_version += 1
        self.free_queue[blk.block_id] = blk
        return blk

    # ---- internals -----------------------------------------------------------------------------------------
    def _touch(self, blk: KVCacheBlock) -> None:
        if blk.ref_cnt == 0:
            del self.free_queue[blk.block_id]
        blk.ref_cnt += 1

    def _pop_free(self) -> KVCacheBlock:
        _, blk = self.free_queue.popitem(last=False)  # least recently freed: the LRU victim
        self.high_water = max(self.high_water, blk.block_id + 1)
        if blk.block_hash is not None:
            self._drop_hash(blk)
        blk.ref_cnt = 1
        return blk

    def _drop_hash(self, blk: KVCacheBlock) -> None:
        assert blk.block_hash is not None
        cached = self.group_cached[blk.group]
        if cached.get(blk.block_hash) is blk:
            del cached[blk.block_hash]
            self.cache_version += 1
        blk.reset_hash()
        blk.group = 0

    def check_integrity(self) -> None:
        """Raise AssertionError if any bookkeeping invariant is broken (used by tests)."""
        holders: dict[int, int] = {}
        for group in self.group_blocks:
            for rid, table in group.items():
                real = [b.block_id for b in table if b is not self.null_block]
                assert len(set(real)) == len(real), f"{rid} holds a block twice"
                assert len(table) == len(self.req_blocks[rid]), f"{rid}'s group tables differ in length"
                for b in real:
                    holders[b] = holders.get(b, 0) + 1
        for blk in self.blocks:
            in_free = blk.block_id in self.free_queue
            assert blk.ref_cnt == holders.get(blk.block_id, 0), f"block {blk.block_id} ref_cnt mismatch"
            assert in_free == (blk.ref_cnt == 0), f"block {blk.block_id} free-queue membership wrong"
        assert self.num_used_blocks + len(self.free_queue) == self.num_blocks
        for g, cached in enumerate(self.group_cached):
            for h, blk in cached.items():
                assert blk.block_hash == h and blk.group == g, "cached map points at a block with another hash"
        for rid, h in self.req_writing.items():
            assert self.writing.get(h) == rid and rid in self.req_blocks, f"{rid}'s in-flight record is stale"
        assert all(self.req_writing.get(rid) == h for h, rid in self.writing.items())
        for rid, n in self.req_num_hashed.items():
            for group in self.group_blocks:
                table = group.get(rid, [])
                assert n <= len(table)
                assert all(b.block_hash is not None for b in table[:n] if b is not self.null_block) \
                    or not self.enable_prefix_caching

    def is_at_baseline(self) -> bool:
        """No request holds blocks: every block is free (cached or not)."""
        return not any(self.group_blocks) and self.num_free_blocks == self.num_blocks

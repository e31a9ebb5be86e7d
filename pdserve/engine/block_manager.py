"""Paged KV cache bookkeeping: blocks, ref counts, automatic prefix caching with LRU eviction.

Only block *ids* live here; the K/V tensors live in the model runner. Block `b` holds the K/V of token slots
`b * block_size ... b * block_size + block_size - 1` in every layer's cache, so a request's `block_table`
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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.engine.request import Request
from pdserve.prefix_hash import hash_block, root_hash

__all__ = ["BlockManager", "KVCacheBlock", "KVSequence", "PrefixCacheStats", "hash_block", "root_hash"]


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

    def reset_hash(self) -> None:
        self.block_hash, self.parent_hash, self.token_ids = None, None, ()


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, KVCacheBlock] = {}  # block_hash -> block holding that prefix
        self.cache_version = 0  # bumped whenever a hash enters or leaves `cached`
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}  # request_id -> its block table
        self.req_num_hashed: dict[str, int] = {}  # request_id -> number of its leading blocks hashed
        self.stats = PrefixCacheStats()
        # never-used blocks leave the free queue in id order: every block below this one has been handed out
        self.high_water = 0
        # blocks hashed since the disk tier last took them (engine/kv_offload.py); None: nobody records them
        self.newly_cached: list[KVCacheBlock] | None = None

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
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks matching the request's tokens, capped at num_tokens - 1 tokens so
        the last token is always computed (its logits are needed). Does not take references. A request whose
        prompt positions must be computed (prompt logprobs not yet scored) takes no hits, as vLLM."""
        if not self.enable_prefix_caching or request.needs_prompt_rows:
            return [], 0
        hits, _ = self.match_prefix(request)
        self.stats.queries += len(request.all_token_ids)
        self.stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def match_prefix(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The cached blocks of the request's longest matching prefix (of its first num_tokens - 1 tokens, full
        blocks) and the hash the next block chains from. Counts nothing."""
        tokens = request.all_token_ids
        hits: list[KVCacheBlock] = []
        parent = root_hash(request.cache_salt, request.lora_int_id)
        for i in range((len(tokens) - 1) // self.block_size):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = hash_block(parent, chunk)
            blk = self.cached.get(h)
            if blk is None or blk.parent_hash != parent or blk.token_ids != chunk:
                break
            hits.append(blk)
            parent = h
        return hits, parent

    def cache_full_blocks(self, request: Request) -> None:
        """Register hashes of the request's blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        blocks = self.req_blocks.get(rid, [])
        n_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        done = self.req_num_hashed.get(rid, 0)
        prev = blocks[done - 1].block_hash if done > 0 else root_hash(request.cache_salt, request.lora_int_id)
        assert prev is not None  # the first `done` blocks are hashed
        parent: int = prev
        tokens = request.all_token_ids
        for i in range(done, n_full):
            blk = blocks[i]
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = hash_block(parent, chunk)
            if blk.block_hash is None:
                blk.block_hash, blk.parent_hash, blk.token_ids = h, parent, chunk
                if h not in self.cached:  # keep the first copy if two requests computed the same prefix
                    self.cached[h] = blk
                    self.cache_version += 1
                    if self.newly_cached is not None:
                        self.newly_cached.append(blk)
            parent = blk.block_hash
        self.req_num_hashed[rid] = max(done, n_full)

    # ---- allocation ----------------------------------------------------------------------------------------
    def allocate_slots(self, request: KVSequence, num_new_tokens: int,
                       computed_blocks: Sequence[KVCacheBlock] = ()) -> bool:
        """Make the request's block table cover num_computed_tokens (+ computed_blocks) + num_new_tokens tokens.
        All or nothing: returns False and changes nothing when too few blocks can be had."""
        rid = request.request_id
        held = self.req_blocks.get(rid, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        need = self.blocks_needed(num_computed + num_new_tokens) - len(held) - len(computed_blocks)
        # computed blocks that sit in the free queue are revived, so they do not count as free for new ones
        revive = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if max(need, 0) > self.num_free_blocks - revive:
            return False
        table = self.req_blocks.setdefault(rid, held)
        for blk in computed_blocks:
            self._touch(blk)
            table.append(blk)
        if computed_blocks:
            self.req_num_hashed[rid] = len(table)
        for _ in range(max(need, 0)):
            table.append(self._pop_free())
        return True

    def trim(self, request: KVSequence) -> None:
        """Free the blocks past those holding the request's computed tokens (speculative decoding: blocks that only
        rejected drafts used). They never carry a hash (only blocks full of computed tokens are hashed): queued
        first, for reuse before any cached block."""
        table = self.req_blocks.get(request.request_id)
        if not table:
            return
        keep = self.blocks_needed(request.num_computed_tokens)
        while len(table) > keep:
            blk = table.pop()
            assert blk.block_hash is None and blk.ref_cnt == 1, "a draft block is never shared nor hashed"
            blk.ref_cnt = 0
            self.free_queue[blk.block_id] = blk
            self.free_queue.move_to_end(blk.block_id, last=False)

    def free(self, request_id: str) -> None:
        """Drop the request's references. Blocks keep their hash; tail blocks are queued first so they are
        evicted before the (more shareable) head of the prefix."""
        blocks = self.req_blocks.pop(request_id, [])
        self.req_num_hashed.pop(request_id, None)
        for blk in reversed(blocks):
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                if blk.block_hash is None or not self.enable_prefix_caching:
                    self.free_queue[blk.block_id] = blk
                    self.free_queue.move_to_end(blk.block_id, last=False)  # uncached: reuse first
                else:
                    self.free_queue[blk.block_id] = blk

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
        if self.cached.get(blk.block_hash) is blk:
            del self.cached[blk.block_hash]
            self.cache_version += 1
        blk.reset_hash()

    def check_integrity(self) -> None:
        """Raise AssertionError if any bookkeeping invariant is broken (used by tests)."""
        holders: dict[int, int] = {}
        for rid, table in self.req_blocks.items():
            assert len({b.block_id for b in table}) == len(table), f"{rid} holds a block twice"
            for b in table:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for blk in self.blocks:
            in_free = blk.block_id in self.free_queue
            assert blk.ref_cnt == holders.get(blk.block_id, 0), f"block {blk.block_id} ref_cnt mismatch"
            assert in_free == (blk.ref_cnt == 0), f"block {blk.block_id} free-queue membership wrong"
        assert self.num_used_blocks + len(self.free_queue) == self.num_blocks
        for h, blk in self.cached.items():
            assert blk.block_hash == h, "cached map points at a block with another hash"
        for rid, n in self.req_num_hashed.items():
            table = self.req_blocks.get(rid, [])
            assert n <= len(table)
            assert all(b.block_hash is not None for b in table[:n]) or not self.enable_prefix_caching

    def is_at_baseline(self) -> bool:
        """No request holds blocks: every block is free (cached or not)."""
        return not self.req_blocks and self.num_free_blocks == self.num_blocks


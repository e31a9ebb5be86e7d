"""Prefix-aware routing: which instance already holds a request's prompt blocks, and the choice that weighs that
against load. Used by every pool of `pdserve router` and so of the Ray Serve ingress (pool.py calls `choose`).

What instances publish: GET /kv/prefix_hashes, the chained hashes of the full blocks in their prefix cache (used
or cached-free) and of those only their disk tier holds (`--kv-offload-dir`), 8 bytes a block, with their block size
and isolation mode. The router polls it with the /metrics
poll, conditionally (If-None-Match: an unchanged set costs a 304), so an instance costs at most
8 bytes x num_blocks (x 4/3 base64) per poll interval, and nothing while its cache does not change. The router
keeps one frozenset of ints per instance (~70 bytes a hash in CPython) and, for what it routed itself since, the
hashes it expects there (`pending`: at most MAX_PENDING per instance, each for `pending_ttl` seconds), so a burst
of requests sharing a new prefix follows the first one before the next poll shows its blocks.

The choice, for a request of P prompt tokens whose chain (pdserve/prefix_hash.py, under the request's salt, as
the instance computes it) matches the first H_i tokens in instance i's memory (published or pending) and the D_i
tokens after them on its disk tier (the blocks it would read back instead of computing):

    cost_i = (P - H_i - D_i) + disk_cost * D_i + load_cost * (running_i + waiting_i + router_inflight_i)

the lowest cost wins (ties: more hit, then round-robin); when no instance matches any block, the pool's
least-loaded choice. `load_cost` (--prefix-load-cost, tokens) is what one request already on an instance is worth
in prompt tokens to compute: high values balance load first, 0 follows the prefix whatever the queue. `disk_cost`
(--prefix-disk-cost) is what a token read from disk costs against computing it (0.05-0.16 measured: BENCHMARKS.md,
"The prefix cache's disk tier").
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.prefix_hash import PrefixIsolation, chain_hashes, effective_salt, unpack_hashes

MAX_PENDING = 65536  # hashes the router remembers routing to one instance (oldest forgotten first)


@dataclass
class PrefixRoutingConfig:
    load_cost: float = 256.0  # prompt tokens one request on an instance is worth (see the module docstring)
    disk_cost: float = 0.1  # a prompt token read back from an instance's disk tier, in tokens computed
    pending_ttl: float = 10.0  # seconds a routed request's blocks count as on its instance before a poll shows them
    clock: Callable[[], float] = time.monotonic


@dataclass
class PrefixQuery:
    """A request's prompt tokens and salt; its block hash chain per (block size, isolation), computed once each."""

    token_ids: Sequence[int]
    cache_salt: str | None = None
    tenant: str | None = None
    _chains: dict[tuple[int, str], list[int]] = field(default_factory=dict, repr=False)

    def chain(self, block_size: int, isolation: PrefixIsolation) -> list[int]:
        key = (block_size, isolation)
        if key not in self._chains:
            salt = effective_salt(self.cache_salt, self.tenant, isolation)
            self._chains[key] = chain_hashes(self.token_ids, block_size, salt)
        return self._chains[key]


@dataclass
class InstancePrefixes:
    """One instance's prefix-cache hashes as last published, plus those the router expects after routing there."""

    block_size: int | None = None  # None: nothing published (yet, or the instance has no /kv/prefix_hashes)
    isolation: PrefixIsolation = "none"
    hashes: frozenset[int] = frozenset()
    disk: frozenset[int] = frozenset()  # on its disk tier only
    etag: str | None = None
    pending: OrderedDict[int, float] = field(default_factory=OrderedDict)  # hash -> expiry (config clock)

    def publish(self, summary: dict[str, Any], etag: str | None) -> None:
        """Take a /kv/prefix_hashes body (ValueError/KeyError/TypeError when it is not one)."""
        block_size, isolation = int(summary["block_size"]), summary.get("isolation", "none")
        if block_size < 1 or isolation not in ("none", "tenant"):
            raise ValueError(f"bad prefix summary: block_size {block_size}, isolation {isolation!r}")
        self.hashes = unpack_hashes(summary["hashes"])
        self.disk = unpack_hashes(summary.get("disk_hashes", ""))  # an instance without a disk tier sends none
        if block_size != self.block_size or isolation != self.isolation:
            self.pending.clear()  # hashed under another layout: meaningless now
        self.block_size, self.isolation, self.etag = block_size, isolation, etag

    def forget(self) -> None:
        self.block_size, self.hashes, self.disk, self.etag = None, frozenset(), frozenset(), None
        self.pending.clear()

    def hit_tokens(self, query: PrefixQuery, now: float) -> tuple[int, int]:
        """(in memory, on disk): prompt tokens of `query` this instance is expected to hold in memory, its longest
        matching run of leading blocks, and those of the blocks right after them that its disk tier holds (the
        instance reads those back: consecutive from the end of its memory hit)."""
        if self.block_size is None:
            return 0, 0
        chain = query.chain(self.block_size, self.isolation)
        n = 0
        while n < len(chain) and (chain[n] in self.hashes or self.pending.get(chain[n], -1.0) >= now):
            n += 1
        d = n
        while d < len(chain) and chain[d] in self.disk:
            d += 1
        return n * self.block_size, (d - n) * self.block_size

    def expect(self, query: PrefixQuery, until: float) -> None:
        """Routed `query` here: its blocks count as held until `until` (or until MAX_PENDING newer ones)."""
        if self.block_size is None:
            return
        for h in query.chain(self.block_size, self.isolation):
            self.pending[h] = until
            self.pending.move_to_end(h)
        while len(self.pending) > MAX_PENDING:
            self.pending.popitem(last=False)


class Candidate(Protocol):
    """What the choice reads of an instance (pool.Instance)."""

    load: float
    inflight: int
    prefixes: InstancePrefixes


@dataclass
class PrefixChoice:
    inst: Any  # the Candidate chosen
    hit_tokens: int  # in memory and on disk
    cost: float


def choose(cands: Sequence[Candidate], query: PrefixQuery, cfg: PrefixRoutingConfig) -> list[PrefixChoice]:
    """The candidates of lowest cost (see the module docstring), most hit first; [] when none holds a block of the
    prompt (the caller picks least-loaded then)."""
    now = cfg.clock()
    n = len(query.token_ids)
    scored = [PrefixChoice(c, mem + disk, n - mem - disk + cfg.disk_cost * disk + cfg.load_cost * (c.load + c.inflight))
              for c in cands for mem, disk in (c.prefixes.hit_tokens(query, now),)]
    if not any(s.hit_tokens for s in scored):
        return []
    best = min(s.cost for s in scored)
    ties = [s for s in scored if s.cost == best]
    most = max(s.hit_tokens for s in ties)
    return [s for s in ties if s.hit_tokens == most]

"""What the engine thread publishes for other threads: immutable snapshots, each replaced whole (one reference
store), so the event loop reads them without racing the engine thread that changes the live state."""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine


@dataclass(frozen=True)
class KVSnapshot:
    """Block-manager and KV-transfer state as the engine thread last saw it (after a step, or while idle).
    Immutable, so the event loop reads it without racing the engine thread that changes the live state."""

    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_requests_holding_blocks: int
    num_pinned_blocks: int  # PD prefill role: blocks held for decode instances to pull
    num_requests_loading_kv: int  # PD decode role: requests whose prompt KV is being pulled
    num_pinned_requests: int = 0  # PD prefill role: requests whose blocks are pinned

    @classmethod
    def of(cls, engine: LLMEngine) -> KVSnapshot:
        """Build on the engine thread (or before it starts)."""
        bm, kv = engine.block_manager, engine.kv_transfer
        return cls(bm.num_blocks, bm.num_free_blocks, bm.num_used_blocks, len(bm.cached), len(bm.req_blocks),
                   kv.num_pinned_blocks if kv is not None else 0, kv.num_loading if kv is not None else 0,
                   kv.num_pinned_requests if kv is not None else 0)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class PrefixSummary:
    """The prefix-cache block hashes this engine holds (used or cached-free), and those its disk tier holds that
    are not in memory (`--kv-offload-dir`: a request whose prompt they begin reads them back instead of computing
    them), for prefix-aware routers. Built on the engine thread only when a reader asks and either set changed since
    the last build (BlockManager.cache_version, KVOffloadStore.version), so steps never copy hashes nobody reads:
    8 bytes a hash when packed. `epoch` is new for every engine, so a router never mistakes a restarted one's
    version."""

    epoch: str
    version: int
    block_size: int
    hashes: tuple[int, ...]
    disk_version: int = -1  # -1: no disk tier
    disk_hashes: tuple[int, ...] = ()

    @property
    def etag(self) -> str:
        return f'"{self.epoch}-{self.version}-{self.disk_version}"'

    @classmethod
    def of(cls, engine: LLMEngine, prev: PrefixSummary | None = None) -> PrefixSummary:
        bm, disk = engine.block_manager, engine.kv_offload
        disk_version = disk.version if disk is not None else -1
        if prev is not None and prev.version == bm.cache_version and prev.disk_version == disk_version:
            return prev
        disk_hashes: tuple[int, ...] = ()
        if disk is not None:
            disk_version, held = disk.held()
            disk_hashes = tuple(h for h in held if h not in bm.cached)
        return cls(prev.epoch if prev is not None else uuid.uuid4().hex[:12], bm.cache_version, bm.block_size,
                   tuple(bm.cached), disk_version, disk_hashes)

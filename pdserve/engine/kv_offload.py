"""A disk tier for prefix-cache blocks (`--kv-offload-dir`): full blocks are written to local disk in the cache's
stored format, named by their chained prefix hash, and read back on a prefix miss, so a long shared prompt survives
eviction from memory and restarts of the server.

- Write-behind: after each step, blocks that became full and hashed in it (BlockManager.newly_cached) are copied out
  of the KV cache (every layer's K and V rows of the block) and written by a background thread; a hash already on
  disk is not written again. Writes are atomic (a temporary file, then os.replace), so several servers may share a
  directory. When the disk falls MAX_PENDING_BYTES behind, newer blocks are not written (the tier is a cache).
- Read: before a waiting request's prefix lookup, the chain of its full blocks is followed past the last block
  held in memory; the blocks found on disk (consecutive, from there on) are read, checked and placed into free
  blocks as cached blocks (BlockManager.adopt_cached), so the lookup that follows finds them like any cached block.
  They are read in the engine thread, READ_BYTES_PER_STEP a step, while the request waits at the head of the queue
  and the running requests keep stepping (a 4k-token prompt of the default model is ~90 MB: three steps).
- Checks: a file holds a header (format version, the fingerprint of model, KV layout and dtype, the block's hash,
  its parent hash and token ids, the payload's length and CRC-32) and the payload. A lookup is confirmed as in
  memory (parent hash and tokens), so a hash collision never returns wrong K/V; files of another model, layout,
  dtype or Python (hashes of ints are stable within one Python) live under another fingerprint directory and are
  checked again on read; a file that fails any check is deleted and its tokens are recomputed. Salts and LoRA
  adapters are in the chain's root hash, so tenants never read each other's blocks.
- Size: at most `max_bytes` of files under this fingerprint; the least recently used (written or read) go first.
  The index is rebuilt from the directory at start-up, oldest first by modification time (a read touches the file).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import struct
import sys
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch

from pdserve.engine.block_manager import BlockManager, KVCacheBlock
from pdserve.engine.messages import KVOffloadStats
from pdserve.engine.request import Request
from pdserve.prefix_hash import hash_block

__all__ = ["KVOffloadStore", "layout_fingerprint"]

logger = logging.getLogger(__name__)

MAGIC = b"PDSKVB01"  # file format version in the magic: a new format never reads an old file
_HEAD = struct.Struct("<8sI")  # magic, header length
SUFFIX = ".kvb"
MAX_PENDING_BYTES = 256 * 2**20  # K/V copied out and not yet written: past this, new blocks are not queued
READ_BYTES_PER_STEP = 32 * 2**20  # read back per scheduling step (a bound on the stall of the step's other requests)
SETTLED_MAX = 1024  # requests remembered as walked (promote): more than ever wait at once


def layout_fingerprint(model: str, kv_cache: torch.Tensor, block_size: int) -> str:
    """What must match for a file's bytes to mean the same K/V here: the model, the cache's per-block layout and
    dtype, and the Python whose int hashes name the blocks."""
    layers, planes, _, bs, heads, row = kv_cache.shape
    key = json.dumps([model, layers, planes, bs, heads, row, str(kv_cache.dtype), block_size,
                      sys.version_info[:2], sys.hash_info.algorithm])
    return f"{zlib.crc32(key.encode()):08x}{len(key):04x}"


def _name(block_hash: int) -> str:
    return f"{block_hash & (2**64 - 1):016x}{SUFFIX}"


def _walk_key(request: Request) -> tuple[str, int]:
    return request.request_id, len(request.times.preemptions)


class KVOffloadStore:
    """The disk tier of one engine (see the module docstring). Engine thread: save_new_blocks, promote; the writer
    thread: files and the index (under the lock)."""

    def __init__(self, directory: str, max_bytes: int, model: str, kv_cache: torch.Tensor,
                 block_manager: BlockManager) -> None:
        self.kv_cache = kv_cache
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.max_bytes = max_bytes
        self.block_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()  # one block, every layer's K and V
        # requests whose disk walk ended, not walked again while they wait (for seats, blocks, or a prefix another
        # request is computing: several may wait at once), by (id, preemptions: a preempted one walks again); the
        # most recent SETTLED_MAX
        self._settled: OrderedDict[tuple[str, int], None] = OrderedDict()
        self.fingerprint = layout_fingerprint(model, kv_cache, self.block_size)
        self.dir = Path(directory) / self.fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stats = KVOffloadStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[int, int] = OrderedDict()  # block hash -> file bytes, least recently used first
        self.version = 0  # +1 whenever a hash enters or leaves the index (under the lock): routers' summaries
        self._load_index()
        block_manager.newly_cached = []  # the block manager now records the blocks it hashes for save_new_blocks
        self._queue: queue.Queue[tuple[KVCacheBlock, int, memoryview] | None] = queue.Queue()
        self._pending = 0  # bytes in the queue (under the lock)
        self._writer = threading.Thread(target=self._write_loop, name="pdserve-kv-offload", daemon=True)
        self._writer.start()

    # ---- index ---------------------------------------------------------------------------------------------
    def _load_index(self) -> None:
        files = []
        for p in self.dir.glob(f"*{SUFFIX}"):
            try:
                st = p.stat()
                files.append((st.st_mtime, int(p.stem, 16), st.st_size))
            except (OSError, ValueError):
                continue
        for _, h, size in sorted(files):
            h = h - 2**64 if h >= 2**63 else h  # back to the signed hash
            self._index[h] = size
            self.stats.disk_bytes += size
        logger.info("KV offload: %s holds %d blocks (%.1f MiB)", self.dir, len(self._index),
                    self.stats.disk_bytes / 2**20)

    def held(self) -> tuple[int, tuple[int, ...]]:
        """(version, the hashes of the blocks on disk), consistent with each other."""
        with self._lock:
            return self.version, tuple(self._index)

    def __contains__(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._index

    def _evict_locked(self) -> None:
        while self.stats.disk_bytes > self.max_bytes and self._index:
            h, size = self._index.popitem(last=False)
            self.version += 1
            self.stats.disk_bytes -= size
            self.stats.evicted += 1
            (self.dir / _name(h)).unlink(missing_ok=True)

    def _forget(self, block_hash: int) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self.version += 1
                self.stats.disk_bytes -= size
        (self.dir / _name(block_hash)).unlink(missing_ok=True)

    # ---- write-behind --------------------------------------------------------------------------------------
    def save_new_blocks(self) -> int:
        """Queue the blocks hashed since the last call for writing (engine thread, after the step that filled
        them; their K/V are copied now, before any later step can reuse the blocks). Returns how many."""
        bm = self.block_manager
        pending, bm.newly_cached = bm.newly_cached or [], []
        todo = [b for b in pending if b.block_hash is not None and b.block_hash not in self]
        with self._lock:  # the disk is behind: drop what does not fit (those blocks may be computed again later)
            todo = todo[:max(0, (MAX_PENDING_BYTES - self._pending) // self.block_bytes)]
            self._pending += len(todo) * self.block_bytes
        if not todo:
            return 0
        # the one copy the engine thread makes; the writer hashes, frames and writes the rows of this buffer
        ids = torch.tensor([b.block_id for b in todo])
        data = self.kv_cache.index_select(2, ids).movedim(2, 0).contiguous()  # [n, layers, 2, bs, heads, row]
        rows = data.view(torch.uint8).reshape(len(todo), -1).numpy()
        for i, blk in enumerate(todo):
            assert blk.block_hash is not None and blk.parent_hash is not None
            # the block's identity travels as a copy: the block may be reused before the writer gets to it
            ident = KVCacheBlock(blk.block_id, 0, blk.block_hash, blk.parent_hash, blk.token_ids)
            self._queue.put((ident, blk.block_hash, memoryview(rows[i])))
        return len(todo)

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._write(*item)
            finally:
                with self._lock:
                    self._pending -= item[2].nbytes
                self._queue.task_done()

    def _write(self, blk: KVCacheBlock, h: int, body: memoryview) -> None:
        header = json.dumps({"fingerprint": self.fingerprint, "hash": h, "parent": blk.parent_hash,
                             "tokens": list(blk.token_ids), "bytes": body.nbytes,
                             "crc32": zlib.crc32(body)}).encode()
        path, tmp = self.dir / _name(h), self.dir / f".{_name(h)}.{os.getpid()}.{threading.get_ident()}"
        try:
            with open(tmp, "wb") as f:
                f.write(_HEAD.pack(MAGIC, len(header)) + header)
                f.write(body)
            os.replace(tmp, path)
        except OSError:
            logger.exception("KV offload: writing %s failed", path)
            tmp.unlink(missing_ok=True)
            return
        size = _HEAD.size + len(header) + body.nbytes
        with self._lock:
            old = self._index.pop(h, None)
            self.stats.disk_bytes += size - (old or 0)
            self._index[h] = size
            self.version += old is None
            self.stats.blocks_saved += 1
            self.stats.bytes_saved += body.nbytes
            self._evict_locked()

    def flush(self) -> None:
        """Wait until the queued writes are on disk (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        """Finish the queued writes and stop the writer."""
        self._queue.put(None)
        self._writer.join(timeout=60)

    # ---- read ----------------------------------------------------------------------------------------------
    def promote(self, request: Request) -> bool:
        """Bring the request's prefix blocks that are on disk but not in memory into free KV blocks, as cached
        blocks, at most READ_BYTES_PER_STEP a call; leaves enough free blocks for the rest of the request. False
        while more may follow (the request should wait for the next step), True when nothing more is to be read."""
        bm = self.block_manager
        if not bm.enable_prefix_caching or request.needs_prompt_rows or _walk_key(request) in self._settled:
            return True
        tokens, bs = request.all_token_ids, self.block_size
        max_blocks = (len(tokens) - 1) // bs
        hits, parent = bm.match_prefix(request)
        for blk in hits:
            bm.refresh(blk)  # most recently used: the blocks adopted below must not evict them
        i = len(hits)
        room = bm.num_free_blocks - bm.blocks_needed(len(tokens) + 1)
        budget = max(1, READ_BYTES_PER_STEP // self.block_bytes)
        loaded = 0
        while i < max_blocks and loaded < room:
            if loaded == budget:
                return False
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = hash_block(parent, chunk)
            self.stats.lookups += 1
            if h in bm.cached or h not in self:  # (in memory under this hash: another chain's block, a collision)
                break
            payload = self._read(h, parent, chunk)
            if payload is None:
                break
            blk = bm.adopt_cached(h, parent, chunk)
            dst = self.kv_cache[:, :, blk.block_id]  # [layers, K|V, block_size, heads, row]: strided
            dst.copy_(payload.view(dst.dtype).view(dst.shape))
            self.stats.hits += 1
            self.stats.blocks_loaded += 1
            self.stats.bytes_loaded += payload.numel()
            parent, i, loaded = h, i + 1, loaded + 1
        self._settled[_walk_key(request)] = None
        if len(self._settled) > SETTLED_MAX:
            self._settled.popitem(last=False)
        return True

    def _read(self, block_hash: int, parent: int, tokens: Sequence[int]) -> torch.Tensor | None:
        """The payload of the block's file when every check passes; otherwise the file is deleted and None."""
        path = self.dir / _name(block_hash)
        try:
            with open(path, "rb") as f:  # read into a buffer torch can view: the payload is copied once, into the cache
                raw = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(raw)
            magic, hlen = _HEAD.unpack_from(raw)
            head = json.loads(raw[_HEAD.size:_HEAD.size + hlen])
            start = _HEAD.size + hlen
            body = memoryview(raw)[start:]
            ok = (magic == MAGIC and head.get("fingerprint") == self.fingerprint and head.get("hash") == block_hash
                  and head.get("parent") == parent and head.get("tokens") == list(tokens)
                  and head.get("bytes") == len(body) == self.block_bytes
                  and head.get("crc32") == zlib.crc32(body))
        except (OSError, ValueError, struct.error, UnicodeDecodeError):
            ok = False
        if not ok:
            self.stats.rejected += 1
            logger.warning("KV offload: %s failed its checks; deleted, its tokens are computed again", path.name)
            self._forget(block_hash)
            return None
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        try:
            os.utime(path)  # the LRU order survives a restart
        except OSError:
            pass
        return torch.frombuffer(raw, dtype=torch.uint8, offset=start)

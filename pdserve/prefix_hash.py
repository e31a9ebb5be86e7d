"""Prefix-cache block hashes, shared by the engine's block manager and the router's prefix-aware choice (which must
compute the same hashes without torch or the engine), and the compact form instances publish them in.

A prompt's full blocks hash as a chain: hash_i = hash((hash_{i-1}, tokens of block i)), from hash_{-1} =
root_hash(the request's effective cache salt). Every hash is an int computed from ints only, so it is the same in
every process of the same Python (no PYTHONHASHSEED; `hash(None)` is not stable before Python 3.12).
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from collections.abc import Sequence
from typing import Literal

PrefixIsolation = Literal["none", "tenant"]


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    # ints and tuples of ints hash identically in every Python process (no PYTHONHASHSEED), which keeps
    # hashes comparable across instances for KV hand-off and prefix-aware routing.
    return hash((parent_hash, tuple(token_ids)))


def root_hash(cache_salt: str | None, lora_id: int = 0) -> int:
    """The parent hash of a request's first block: 0 without a salt, else a stable digest of the salt (str
    hashes are randomized per process, so not hash(salt)). A LoRA adapter's id (vLLM: lora_int_id in the block
    hash's extra keys) is chained in, so adapters and the base model never share a block."""
    root = 0
    if cache_salt is not None:
        digest = hashlib.blake2b(cache_salt.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        root = int.from_bytes(digest, "little") | 1  # never 0, the unsalted root
    return hash((root, lora_id)) | 1 if lora_id else root


def effective_salt(cache_salt: str | None, tenant: str | None, isolation: PrefixIsolation) -> str | None:
    """The salt a request's blocks are hashed under: the body's cache_salt; with tenant isolation, combined with
    the tenant (X-Tenant header, else the body's user) unambiguously, as JSON."""
    if isolation == "tenant" and tenant is not None:
        return json.dumps([tenant, cache_salt], ensure_ascii=False)
    return cache_salt


def chain_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None) -> list[int]:
    """The hashes of the blocks a prefix-cache lookup may hit: the full blocks of all but the last token (that
    one is always computed, as BlockManager.get_computed_blocks caps it)."""
    out: list[int] = []
    parent = root_hash(cache_salt)
    for i in range((len(token_ids) - 1) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


# ---- the published form: little-endian signed 64-bit ints, base64 (8 bytes a block, 4/3 of that on the wire) ----
def pack_hashes(hashes: Sequence[int]) -> str:
    return base64.b64encode(struct.pack(f"<{len(hashes)}q", *hashes)).decode("ascii")


def unpack_hashes(text: str) -> frozenset[int]:
    """The hashes of pack_hashes' text; ValueError when it is not such a text."""
    raw = base64.b64decode(text, validate=True)
    if len(raw) % 8:
        raise ValueError("packed hashes must be a multiple of 8 bytes")
    return frozenset(struct.unpack(f"<{len(raw) // 8}q", raw))

"""Stored responses of POST /v1/responses (`store`, `previous_response_id`, GET and DELETE /v1/responses/{id}).

Entries are bounded three ways: at most `max_entries`, at most `max_bytes` of JSON in all (the oldest go first when a
new one does not fit; one larger than `max_bytes` is not stored), and each expires `ttl` seconds after it was
stored. Every entry belongs to an owner (`owner_key`: the API key's hash and the X-Tenant header): a lookup under
another owner finds nothing, exactly as for an id that never existed, so one tenant cannot even learn that another's
id exists. The clock is injected (tests move it); the store is in memory and per server process.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def owner_key(authorization: str | None, tenant: str | None) -> str:
    """Who may read a stored response: the bearer token (hashed: the key itself is never kept) and the tenant."""
    token = (authorization or "").strip().partition(" ")[2].strip()
    digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return json.dumps([digest, tenant or ""], ensure_ascii=False)


@dataclass(frozen=True)
class StoredResponse:
    owner: str
    response: dict[str, Any]  # the response object as returned
    items: list[dict[str, Any]]  # the conversation so far (previous ones, input, output): the next turn's history
    nbytes: int
    expires: float


class ResponseStore:
    def __init__(self, max_entries: int = 1024, max_bytes: int = 64 * 2**20, ttl: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries, self.max_bytes, self.ttl, self.clock = max_entries, max_bytes, ttl, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def put(self, owner: str, response: dict[str, Any], items: list[dict[str, Any]]) -> bool:
        """Store `response` under its id; False when it cannot be (the store is off or the entry is too large)."""
        nbytes = len(json.dumps([response, items], ensure_ascii=False).encode("utf-8", "surrogatepass"))
        if self.max_entries <= 0 or nbytes > self.max_bytes:
            return False
        entry = StoredResponse(owner, response, items, nbytes, self.clock() + self.ttl)
        with self._lock:
            self._drop(response["id"])
            self._expire()
            while self._entries and (len(self._entries) >= self.max_entries or
                                     self._bytes + nbytes > self.max_bytes):
                self._drop(next(iter(self._entries)))
            self._entries[response["id"]] = entry
            self._bytes += nbytes
        return True

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """The entry, if it exists, has not expired and belongs to `owner`."""
        with self._lock:
            self._expire()
            entry = self._entries.get(response_id)
        return entry if entry is not None and entry.owner == owner else None

    def delete(self, owner: str, response_id: str) -> bool:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or entry.owner != owner:
                return False
            self._drop(response_id)
        return True

    def _expire(self) -> None:
        # entries are in insertion order and share one ttl: the expired ones are a prefix
        now = self.clock()
        while self._entries and next(iter(self._entries.values())).expires <= now:
            self._drop(next(iter(self._entries)))

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.nbytes

"""ReplicaDirectory: a small named Ray actor where each engine replica advertises the URL of its `pdserve serve`
process (with its role, node and replica id), and the ingress reads the live ones.

Replicas re-register every `HEARTBEAT_S`; an entry not refreshed for `max_age` seconds is gone (its replica died
without unregistering: Ray restarts it under a new id, which registers itself).
"""

from __future__ import annotations

import time
from typing import Any

import ray

HEARTBEAT_S = 1.0
NAMESPACE = "pdserve"


@ray.remote(num_cpus=0)
class ReplicaDirectory:
    def __init__(self) -> None:
        self._entries: dict[str, dict[str, Any]] = {}

    def register(self, entry: dict[str, Any]) -> None:
        self._entries[entry["replica_id"]] = {**entry, "seen": time.monotonic()}

    def unregister(self, replica_id: str) -> None:
        self._entries.pop(replica_id, None)

    def list(self, max_age: float = 4 * HEARTBEAT_S) -> list[dict[str, Any]]:
        now = time.monotonic()
        self._entries = {k: e for k, e in self._entries.items() if now - e["seen"] <= max_age}
        return sorted(self._entries.values(), key=lambda e: (e["role"], e["replica_id"]))


def directory_name(app_name: str) -> str:
    return f"pdserve-directory-{app_name}"


def get_directory(app_name: str) -> Any:
    """The application's directory actor, created by the first caller. Detached: it outlives any one replica;
    `delete_app` (app.py) removes it with the application."""
    return ReplicaDirectory.options(  # type: ignore[attr-defined]
        name=directory_name(app_name), namespace=NAMESPACE, lifetime="detached", get_if_exists=True).remote()


def pools(entries: list[dict[str, Any]]) -> dict[str, list[str]]:
    """{prefill|decode: URLs} for the router's pools: colocated replicas (role both) serve as decode instances."""
    out: dict[str, list[str]] = {"prefill": [], "decode": []}
    for e in entries:
        out["prefill" if e["role"] == "prefill" else "decode"].append(e["url"])
    return out

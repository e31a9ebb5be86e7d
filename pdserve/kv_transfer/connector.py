"""KV connector interface: move a request's KV blocks from a prefill instance to a decode instance.

The KV cache is one tensor `[layer, 2 (K|V), num_blocks, block_size, kv_heads, head_dim]` (see
pdserve/model/runner.py), so one block of one layer's K (or V) is a contiguous chunk of
`block_size * kv_heads * head_dim` elements:

    kv_cache[l, kv, b]  ->  byte offset ((l * 2 + kv) * num_blocks + b) * chunk_bytes

A hand-off, in vLLM's NixlConnector terms (the same `kv_transfer_params` in the OpenAI body):

    router ──(do_remote_decode)──► prefill instance: prefill, first token, finish; blocks stay *pinned*
           ◄─ kv_transfer_params {do_remote_prefill, remote_engine_id, remote_host, remote_port,
                                  remote_block_ids, remote_request_id, ...}
    router ──(those params)──────► decode instance: allocate blocks, pull the remote blocks in a connector
                                   thread (request WAITING_FOR_REMOTE_KVS), then compute the last prompt token
                                   and decode. After the pull it tells the prefill side to release the pin.

Both sides of one connector class run in every instance that has a connector: a *server* part (a ZeroMQ ROUTER
socket on the KV port that serves pinned blocks and hears releases) and a *loader* part (worker threads that pull
blocks into freshly allocated local blocks). Pins are guarded by `PinTable`; the engine thread frees released and
expired pins' blocks (the block manager is single-threaded), the connector threads never touch it.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


class KVTransferError(RuntimeError):
    """A pull that cannot complete: the remote side refused it or sent something unexpected."""


@dataclass
class LoadJob:
    """Pull `remote_block_ids` of a pinned remote request into `local_block_ids` (same order, same length)."""

    request_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    params: dict[str, Any]  # the request's kv_transfer_params (remote_host, remote_port, remote_request_id, ...)
    deadline: float  # time.monotonic() by which the pull must be done


@dataclass
class LoadResult:
    request_id: str
    ok: bool
    num_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None


@dataclass
class Pin:
    block_ids: list[int]
    deadline: float  # time.monotonic(); an unclaimed pin is freed after it
    num_prompt_tokens: int


@dataclass
class PinTable:
    """Blocks of finished prefill requests kept for a decode instance to pull. Shared between the engine thread
    (adds pins, frees released or expired ones) and the connector's server thread (validates reads, queues
    releases); `lock` is held while a server reads pinned blocks so a pin cannot expire mid-read."""

    lock: threading.RLock = field(default_factory=threading.RLock)
    pins: dict[str, Pin] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)

    def add(self, request_id: str, pin: Pin) -> None:
        with self.lock:
            self.pins[request_id] = pin

    def check(self, request_id: str, block_ids: list[int], extend_to: float | None = None) -> str | None:
        """None if `block_ids` are pinned for `request_id` (optionally extending the pin), else why not.
        Call with `lock` held when the caller reads the blocks afterwards."""
        with self.lock:
            pin = self.pins.get(request_id)
            if pin is None:
                return f"request {request_id!r} has no pinned KV blocks here (released, expired or never pinned)"
            if not set(block_ids) <= set(pin.block_ids):
                return f"blocks {block_ids} are not all pinned for request {request_id!r}"
            if extend_to is not None:
                pin.deadline = max(pin.deadline, extend_to)
            return None

    def release(self, request_id: str) -> None:
        with self.lock:
            if request_id in self.pins:
                self.released.append(request_id)

    def take_done(self, now: float) -> tuple[list[str], list[str]]:
        """Remove and return (released, expired) request ids."""
        with self.lock:
            released = [r for r in dict.fromkeys(self.released) if r in self.pins]
            self.released.clear()
            for r in released:
                del self.pins[r]
            expired = [r for r, p in self.pins.items() if p.deadline < now]
            for r in expired:
                del self.pins[r]
            return released, expired

    @property
    def num_blocks(self) -> int:
        with self.lock:
            return sum(len(p.block_ids) for p in self.pins.values())

    def __len__(self) -> int:
        return len(self.pins)


def kv_layout(kv_cache: torch.Tensor) -> dict[str, Any]:
    n_layers, two, n_blocks, bs, heads, dim = kv_cache.shape
    assert two == 2 and kv_cache.is_contiguous()
    return {"num_layers": n_layers, "num_blocks": n_blocks, "block_size": bs, "kv_heads": heads, "head_dim": dim,
            "dtype": str(kv_cache.dtype).removeprefix("torch."), "element_size": kv_cache.element_size()}


def check_compatible(local: dict[str, Any], remote: dict[str, Any]) -> str | None:
    """None if blocks can be copied between the two caches as they are, else why not. Blocks move as stored bytes
    (int8/fp8 rows with their scales), so the two instances need the same --kv-cache-dtype."""
    if local.get("dtype") != remote.get("dtype"):
        return (f"KV cache dtypes differ: local {local.get('dtype')!r}, remote {remote.get('dtype')!r}; start the "
                "prefill and decode instances with the same --kv-cache-dtype (and --dtype when it is auto)")
    for key in ("num_layers", "block_size", "kv_heads", "head_dim"):
        if local.get(key) != remote.get(key):
            return f"KV layouts differ in {key}: local {local.get(key)!r}, remote {remote.get(key)!r}"
    return None


class KVConnector(ABC):
    """One per engine. `start_load` is asynchronous (a connector thread pulls); results come back through
    `get_finished`. `wakeup` (set by the owner) is called from connector threads whenever there is something for
    the engine thread to pick up."""

    name = "base"

    def __init__(self, engine_id: str, kv_cache: torch.Tensor, host: str, port: int, pins: PinTable,
                 timeout: float) -> None:
        self.engine_id = engine_id
        self.timeout = timeout  # seconds a pull, or an unclaimed pin, may take
        self.kv_cache = kv_cache
        self.layout = kv_layout(kv_cache)
        self.host = host
        self.port = port  # the bound port once started
        self.pins = pins
        self.wakeup: Callable[[], None] = lambda: None
        self._results: list[LoadResult] = []
        self._results_lock = threading.Lock()
        self.event = threading.Event()  # set when a result or a release arrives

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def start_load(self, job: LoadJob) -> None:
        """Begin pulling a job's blocks in the background; its LoadResult is delivered via get_finished()."""

    @abstractmethod
    def send_release(self, params: dict[str, Any]) -> None:
        """Tell a prefill instance (best effort, in the background) that its pin is no longer needed."""

    def params(self) -> dict[str, Any]:
        """Connector-specific fields for a prefill response's kv_transfer_params."""
        return {"kv_connector": self.name}

    # ---- results (connector threads -> engine thread) ------------------------------------------------------
    def deliver(self, result: LoadResult) -> None:
        with self._results_lock:
            self._results.append(result)
        self.notify()

    def notify(self) -> None:
        """Wake the engine thread: a result or a release arrived."""
        self.event.set()
        self.wakeup()

    def get_finished(self) -> list[LoadResult]:
        with self._results_lock:
            out, self._results = self._results, []
        return out

    def wait(self, timeout: float) -> None:
        """Block the engine thread until something arrives (or `timeout`)."""
        self.event.wait(timeout)
        self.event.clear()

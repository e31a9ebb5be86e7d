"""Engine-side bookkeeping of KV hand-offs; everything here runs on the engine thread.

Prefill side: a request with `kv_transfer_params.do_remote_decode` that finishes normally keeps its blocks
(`on_finish` pins them instead of letting the scheduler free them) and gets response params
(`request.kv_transfer_result`). `poll_pins` (also run by `get_finished`) frees pins the decode side released, and
pins nobody claimed within `kv_transfer_timeout` (counted in `stats.pin_timeouts`).

Decode side: a waiting request with `kv_transfer_params.do_remote_prefill` is admitted by `start_load`: blocks for
all prompt tokens but the last are allocated (prefix-cache hits are reused and not pulled), the request goes to
WAITING_FOR_REMOTE_KVS (set by the scheduler) and the connector pulls the rest in its own thread. `get_finished`
reports ended pulls as `FinishedLoad`s; the scheduler applies them (`Scheduler.update_from_kv_transfer`): on success
the request joins the running batch with `num_computed_tokens = prompt - 1`, so the next step computes the last
prompt token and samples the first output token here (greedy output equals colocated); on failure it is recomputed
from the prompt or failed, per `kv_load_failure_policy`. A request aborted during its pull keeps its blocks until
the pull ends (the connector thread may still be writing them), then they are freed here.

KVTransferManager implements `pdserve.kv_transfer.base.KVTransfer` (what the engine and scheduler call); it never
touches the scheduler's queues, and reaches requests and blocks through base.py's structural types.
"""

from __future__ import annotations

import array
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.errors import RequestRejected
from pdserve.kv_transfer.base import FinishedLoad, FinishStatus, KVBlocks, KVRequest
from pdserve.kv_transfer.connector import KVConnector, LoadJob, Pin
from pdserve.kv_transfer.trust import trust_from_config

if TYPE_CHECKING:
    from pdserve.config import EngineConfig

logger = logging.getLogger("pdserve.kv_transfer")


@dataclass
class KVTransferStats:
    loads_ok: int = 0
    loads_failed: int = 0
    bytes_loaded: int = 0
    pins: int = 0
    pins_released: int = 0
    pin_timeouts: int = 0


@dataclass
class PendingLoad:
    request: KVRequest
    num_tokens: int  # prompt tokens whose KV the pull provides (together with prefix-cache hits)
    num_cached: int  # of which were prefix-cache hits (not pulled)
    started: float


def prompt_hash(token_ids: Sequence[int]) -> str:
    """A digest of the prompt's token ids, so both sides can check they hold the same prompt (Python's hash() is
    not stable across processes: hash(None) differs before 3.12)."""
    return hashlib.blake2b(array.array("q", token_ids).tobytes(), digest_size=16).hexdigest()


class KVTransferManager:
    def __init__(self, config: EngineConfig, block_manager: KVBlocks, connector: KVConnector) -> None:
        """`connector` (not yet started) shares this manager's `pins` and `engine_id`: factory.py builds both."""
        self.timeout = config.kv_transfer_timeout
        self.block_manager = block_manager
        self.pins = connector.pins
        self.engine_id = connector.engine_id
        self.connector = connector
        self.connector.start()
        self.trust = trust_from_config(config)
        logger.info("KV transfer (%s role): %s", config.kv_role, self.trust.describe())
        self.loading: dict[str, PendingLoad] = {}
        self.orphans: set[str] = set()  # aborted during their pull: blocks freed when the pull ends
        self.stats = KVTransferStats()
        # observers (metrics)
        self.on_load: Callable[[FinishedLoad], None] | None = None
        self.on_pin_timeout: Callable[[], None] | None = None

    @property
    def wakeup(self) -> Callable[[], None]:
        return self.connector.wakeup

    @wakeup.setter
    def wakeup(self, fn: Callable[[], None]) -> None:
        self.connector.wakeup = fn

    @property
    def num_loading(self) -> int:
        return len(self.loading) + len(self.orphans)

    @property
    def num_pinned_blocks(self) -> int:
        return self.pins.num_blocks

    @property
    def num_pinned_requests(self) -> int:
        return len(self.pins)

    def close(self) -> None:
        self.connector.close()

    def check_params(self, params: dict[str, Any]) -> dict[str, Any]:
        return self.trust.verify(params)

    # ---- decode side ---------------------------------------------------------------------------------------
    def wants_remote_load(self, req: KVRequest, num_cached: int) -> bool:
        """True when the request should pull KV before computing. Consumes the params either way, so a later
        recompute (preemption, failed pull) never pulls again."""
        p = req.kv_transfer_params
        if not p or not p.get("do_remote_prefill") or req.kv_transfer_result is not None:
            return False
        try:  # the server verified them already; checked again so that nothing unverified ever connects out
            self.trust.verify(p)
        except RequestRejected as exc:
            req.kv_transfer_result = {"ok": False, "bytes": 0, "seconds": 0.0, "error": str(exc)}
            logger.warning("request %s: %s; computing the prompt here", req.request_id, exc)
            return False  # no release either: that would contact the untrusted peer
        error = self._check_params(req, p)
        ok = error is None
        if ok and req.num_prompt_tokens - 1 <= num_cached:
            error = "nothing to pull (all but the last prompt token are in the local prefix cache)"
        if error is None:
            return True  # start_load records the result once the blocks are allocated
        req.kv_transfer_result = {"remote_engine_id": p.get("remote_engine_id"), "ok": ok, "bytes": 0,
                                  "seconds": 0.0, "error": error}
        if not ok:
            logger.warning("request %s: not pulling KV: %s; computing the prompt here", req.request_id, error)
        self.connector.send_release(p)
        return False

    def _check_params(self, req: KVRequest, p: dict[str, Any]) -> str | None:
        for key in ("remote_host", "remote_port", "remote_request_id", "remote_block_ids"):
            if p.get(key) is None:
                return f"kv_transfer_params lacks {key}"
        if p.get("kv_connector", self.connector.name) != self.connector.name:
            return f"the prefill side used the {p.get('kv_connector')} connector, this instance {self.connector.name}"
        n = p.get("num_prompt_tokens")
        if n is not None and n != req.num_prompt_tokens:
            return f"prompt length differs from the prefill side's ({req.num_prompt_tokens} vs {n} tokens)"
        h = p.get("prompt_hash")
        if h is not None and h != prompt_hash(req.prompt_token_ids):
            return "the prompt differs from the one the prefill side computed"
        bs = self.block_manager.block_size
        if p.get("block_size", bs) != bs:
            return f"block sizes differ (prefill {p.get('block_size')}, decode {bs})"
        if len(p["remote_block_ids"]) < self.block_manager.blocks_needed(req.num_prompt_tokens - 1):
            return "remote_block_ids cover fewer tokens than the prompt"
        return None

    def start_load(self, req: KVRequest, computed_blocks: Sequence[Any], num_cached: int) -> bool:
        """Allocate blocks for all prompt tokens but the last and start pulling the ones not cached here.
        Returns False (changing nothing) when the blocks cannot be had now; the scheduler sets the status."""
        n_load = req.num_prompt_tokens - 1
        if not self.block_manager.allocate_slots(req, n_load - num_cached, computed_blocks):
            return False
        p = req.kv_transfer_params
        assert p is not None
        first = num_cached // self.block_manager.block_size
        n_blocks = self.block_manager.blocks_needed(n_load)
        local = self.block_manager.get_block_ids(req.request_id)[first:n_blocks]
        remote = [int(b) for b in p["remote_block_ids"][first:n_blocks]]
        req.kv_transfer_result = {"remote_engine_id": p.get("remote_engine_id"), "ok": False, "bytes": 0,
                                  "seconds": 0.0}
        self.loading[req.request_id] = PendingLoad(req, n_load, num_cached, time.perf_counter())
        self.connector.start_load(LoadJob(req.request_id, local, remote, p, time.monotonic() + self.timeout))
        return True

    # ---- both sides ----------------------------------------------------------------------------------------
    def on_finish(self, req: KVRequest, status: FinishStatus) -> bool:
        """Called by the scheduler when a request finishes. True: the manager keeps the request's blocks (a pin,
        or a pull still writing them); False: the scheduler frees them as usual."""
        rid = req.request_id
        if rid in self.loading:
            del self.loading[rid]
            self.orphans.add(rid)
            return True
        p = req.kv_transfer_params
        if not p or not p.get("do_remote_decode") or status.finish_reason not in ("stop", "length"):
            return False
        try:  # pins only for the router (the server verified the params already)
            self.trust.verify(p)
        except RequestRejected as exc:
            logger.warning("request %s: not pinning its KV: %s", rid, exc)
            return False
        ids = self.block_manager.get_block_ids(rid)
        if not ids:
            return False
        n = req.num_prompt_tokens
        self.pins.add(rid, Pin(ids, time.monotonic() + self.timeout, n))
        self.stats.pins += 1
        req.kv_transfer_result = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
            "remote_host": self.connector.host, "remote_port": self.connector.port,
            "remote_block_ids": ids[:self.block_manager.blocks_needed(n)], "remote_request_id": rid,
            "num_prompt_tokens": n, "prompt_hash": prompt_hash(req.prompt_token_ids),
            "block_size": self.block_manager.block_size, "tp_size": 1, **self.connector.params()}
        return True

    def get_finished(self) -> list[FinishedLoad]:
        """Pulls that ended since the last call, with the requests' kv_transfer_result filled in. Frees the blocks
        of requests aborted during their pull, and of released and expired pins."""
        finished: list[FinishedLoad] = []
        for res in self.connector.get_finished():
            if res.request_id in self.orphans:
                self.orphans.discard(res.request_id)
                self.block_manager.free(res.request_id)
                continue
            pending = self.loading.pop(res.request_id, None)
            if pending is None:
                continue
            req = pending.request
            remote = (req.kv_transfer_params or {}).get("remote_engine_id")
            assert req.kv_transfer_result is not None
            req.kv_transfer_result.update(ok=res.ok, bytes=res.num_bytes, seconds=round(res.seconds, 6),
                                          error=res.error, num_loaded_tokens=pending.num_tokens - pending.num_cached,
                                          num_cached_tokens=pending.num_cached)
            if res.ok:
                self.stats.loads_ok += 1
                self.stats.bytes_loaded += res.num_bytes
            else:
                self.stats.loads_failed += 1
            load = FinishedLoad(res.request_id, res.ok, pending.num_tokens,
                                None if res.ok else f"KV transfer from {remote} failed: {res.error}",
                                res.num_bytes, res.seconds)
            if self.on_load is not None:
                self.on_load(load)
            finished.append(load)
        self.poll_pins()
        return finished

    def poll_pins(self) -> None:
        released, expired = self.pins.take_done(time.monotonic())
        for rid in released:
            self.block_manager.free(rid)
            self.stats.pins_released += 1
        for rid in expired:
            self.block_manager.free(rid)
            self.stats.pin_timeouts += 1
            logger.warning("KV pin of request %s expired after %.0fs unclaimed; blocks freed", rid, self.timeout)
            if self.on_pin_timeout is not None:
                self.on_pin_timeout()

    def wait(self, timeout: float) -> None:
        self.connector.wait(timeout)

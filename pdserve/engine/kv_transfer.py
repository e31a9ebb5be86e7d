"""The KV-transfer seam: what the engine and scheduler need from PD disaggregation (pdserve.disagg implements it).

The transfer side allocates and pins blocks and runs the connector; it never moves requests between the
scheduler's queues. It reports finished pulls as `FinishedLoad`s and the scheduler applies them
(`Scheduler.update_from_kv_transfer`, vLLM's `_update_waiting_for_remote_kv`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pdserve.engine.block_manager import KVCacheBlock
    from pdserve.engine.request import Request, RequestStatus


@dataclass
class FinishedLoad:
    """A pull of a request's KV that ended, whether it worked or not."""

    request_id: str
    ok: bool
    num_computed_tokens: int  # on success: the request's tokens whose K/V are now in its local blocks
    error: str | None = None  # on failure: why, worded for the request's error
    num_bytes: int = 0
    seconds: float = 0.0


class KVTransfer(Protocol):
    engine_id: str
    wakeup: Callable[[], None]  # called from transfer threads when there is something for the engine to pick up
    on_load: Callable[[FinishedLoad], None] | None  # observers (metrics)
    on_pin_timeout: Callable[[], None] | None

    @property
    def num_loading(self) -> int:
        """Requests whose KV is being pulled (they hold blocks and count against max_num_seqs)."""
        ...

    @property
    def num_pinned_blocks(self) -> int: ...

    @property
    def num_pinned_requests(self) -> int: ...

    def check_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """A request's `kv_transfer_params` if this instance may act on them (signed by the router, or from an
        allowed peer); raises RequestRejected otherwise, having contacted nothing."""
        ...

    def wants_remote_load(self, request: Request, num_cached: int) -> bool:
        """True when the waiting request should pull its prompt's KV instead of computing it."""
        ...

    def start_load(self, request: Request, computed_blocks: Sequence[KVCacheBlock], num_cached: int) -> bool:
        """Allocate the request's blocks and start the pull; False (nothing changed) when blocks are short."""
        ...

    def on_finish(self, request: Request, status: RequestStatus) -> bool:
        """A request finished. True: the transfer side keeps (and later frees) its blocks."""
        ...

    def get_finished(self) -> list[FinishedLoad]:
        """Pulls that ended since the last call (pins released or expired are freed on the way)."""
        ...

    def poll_pins(self) -> None:
        """Free the blocks of pins released by the decode side or expired."""
        ...

    def wait(self, timeout: float) -> None:
        """Block until a pull lands or a pin is released, or `timeout` seconds pass."""
        ...

    def close(self) -> None: ...

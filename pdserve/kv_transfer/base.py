"""The KV-transfer seam: what the engine and scheduler need from PD disaggregation (`KVTransfer`, implemented by
manager.py), and what the transfer side needs from the engine's objects (`KVRequest`, `KVBlocks`, `FinishStatus`:
structural types, so this package imports nothing from the engine).

The transfer side allocates and pins blocks and runs the connector; it never moves requests between the
scheduler's queues. It reports finished pulls as `FinishedLoad`s and the scheduler applies them
(`Scheduler.update_from_kv_transfer`, vLLM's `_update_waiting_for_remote_kv`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class FinishedLoad:
    """A pull of a request's KV that ended, whether it worked or not."""

    request_id: str
    ok: bool
    num_computed_tokens: int  # on success: the request's tokens whose K/V are now in its local blocks
    error: str | None = None  # on failure: why, worded for the request's error
    num_bytes: int = 0
    seconds: float = 0.0


class KVRequest(Protocol):
    """What the transfer side reads and writes on a request (the engine's Request has these)."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None  # as sent by the router
    kv_transfer_result: dict[str, Any] | None  # what happened, reported in the response and the request log

    @property
    def num_prompt_tokens(self) -> int: ...


class KVBlocks(Protocol):
    """The block manager's part the transfer side uses (only on the engine thread)."""

    @property
    def block_size(self) -> int: ...

    def blocks_needed(self, num_tokens: int) -> int: ...

    def get_block_ids(self, request_id: str) -> list[int]: ...

    def allocate_slots(self, request: Any, num_new_tokens: int, computed_blocks: Sequence[Any]) -> bool: ...

    def free(self, request_id: str) -> None: ...


class FinishStatus(Protocol):
    """How a request finished (the engine's RequestStatus): OpenAI's finish_reason, `stop` or `length` when it
    ended normally."""

    @property
    def finish_reason(self) -> str | None: ...


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

    def wants_remote_load(self, request: KVRequest, num_cached: int) -> bool:
        """True when the waiting request should pull its prompt's KV instead of computing it."""
        ...

    def start_load(self, request: KVRequest, computed_blocks: Sequence[Any], num_cached: int) -> bool:
        """Allocate the request's blocks and start the pull; False (nothing changed) when blocks are short."""
        ...

    def on_finish(self, request: KVRequest, status: FinishStatus) -> bool:
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

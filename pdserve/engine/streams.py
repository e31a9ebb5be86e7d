"""A request's stream of outputs from the engine thread to its consumer's event loop (RequestStream), and a step's
outputs handed to those loops together (StepDeliveries)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine.request import Request
from pdserve.outputs import RequestOutput


@dataclass
class RequestStream:
    """One admitted request's outputs, queued for its consumer's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    request: Request
    on_finished: Callable[[RequestOutput], None] | None = None  # runs on the engine thread once, aborts included
    tenant: str | None = None  # who sent it: kept with its explanation (GET /debug/requests/{id} shows it to them)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def deliver(self, item: RequestOutput | BaseException) -> None:
        """Hand an item to the consumer's event loop (from the engine thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # that loop is closed: nobody listens any more, and its abort is on the way
            pass


def _put_all(items: list[tuple[asyncio.Queue[RequestOutput | BaseException], RequestOutput]]) -> None:
    for q, item in items:
        q.put_nowait(item)


class StepDeliveries:
    """A step's outputs for their consumers' event loops, handed over with one call per loop (each
    call_soon_threadsafe writes to the loop's wake-up pipe: at 32 streams a step, 32 writes became one). Items of
    one loop keep their order, and a step's batch goes out before the next step's."""

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop,
                            list[tuple[asyncio.Queue[RequestOutput | BaseException], RequestOutput]]] = {}

    def add(self, stream: RequestStream, out: RequestOutput) -> None:
        self._by_loop.setdefault(stream.loop, []).append((stream.queue, out))

    def flush(self) -> None:
        for loop, items in self._by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is closed: nobody listens any more
                pass
        self._by_loop = {}

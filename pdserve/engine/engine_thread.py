"""Where an engine runs in a server: its own thread (EngineThread), taking turns with other models' engines
(StepTurns)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class EngineThread:
    """The one thread that runs torch in a server: it builds the engine, then runs the engine loop.

    Why one thread: PyTorch's OpenMP team belongs to the thread that first runs a parallel op. When the main thread
    loads the model (creating its team) and another thread then steps the engine, every step of the second
    thread's team is ~1.6x slower on this 2-core machine (decode step 26 ms offline vs 43 ms; measured with the
    same engine, main thread vs a second thread). Building and stepping in the same thread avoids it."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            fn, fut = task
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(exc)

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        self._tasks.put((fn, fut))
        return fut

    def call(self, fn: Callable[[], Any]) -> Any:
        return self.submit(fn).result()

    def stop(self, timeout: float = 10.0) -> None:
        """End the thread once the tasks queued before this ran (an unloaded model's thread does not linger)."""
        self._tasks.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)


class StepTurns:
    """Several models in one server take turns at stepping: one engine step runs at a time, granted in arrival
    order (a ticket lock), so k busy models get about 1/k of the steps each and every step has all the CPU threads
    (engines stepping at once would oversubscribe the cores: OpenMP teams spin against each other). An idle model
    takes no turns. Each step is bounded by its engine's token budget (max_num_batched_tokens, max_step_ms)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next_ticket = 0
        self._serving = 0

    def __enter__(self) -> None:
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            while ticket != self._serving:
                self._cond.wait()

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()

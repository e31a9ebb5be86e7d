"""The memory of a server under benchmark: its process tree's RSS (sampled, with the peak) and a guard that kills it
before the machine runs out (a 24 GiB machine shared with other jobs, and a model that is dequantized at load can
need more than is free: better a recorded "did not fit" than an OOM-killed neighbour).

The server is the benchmark's only child process while it runs (one server at a time; the client runs in-process),
so the tree watched is this process's children: no pid needs passing in before the server is even healthy.
RSS sums the processes' resident sets (pages shared between vLLM's processes count once per process).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import TracebackType

import psutil

GIB = 2**30


def children() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def tree_rss() -> int:
    """Resident bytes of this process's children, summed."""
    total = 0
    for p in children():
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def available() -> int:
    return int(psutil.virtual_memory().available)


class MemoryWatch:
    """While entered: samples the children's RSS every `interval` s (peak in `peak_rss`) and, when the machine's
    available memory falls below `min_free` bytes, kills every child (their process groups first) and says why in
    `killed`."""

    def __init__(self, min_free: float, interval: float = 0.5) -> None:
        self.min_free = min_free
        self.interval = interval
        self.peak_rss = 0
        self.killed: str | None = None
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-watch", daemon=True)

    def __enter__(self) -> MemoryWatch:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def sample(self) -> int:
        rss = tree_rss()
        self.peak_rss = max(self.peak_rss, rss)
        return rss

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            rss = self.sample()
            free = available()
            if free < self.min_free and self.killed is None and rss > 0:
                self.killed = (f"killed by the benchmark's memory guard after {time.monotonic() - self._t0:.0f} s: "
                               f"the machine had {free / GIB:.1f} GiB available (guard: {self.min_free / GIB:.1f}) "
                               f"with the server at {rss / GIB:.1f} GiB RSS")
                self._kill()

    def _kill(self) -> None:
        procs = children()
        for p in procs:
            try:
                if os.getpgid(p.pid) == p.pid:  # a group leader (servers start in their own group): end its group
                    os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass

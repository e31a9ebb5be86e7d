"""Progress of one model load: a `progress(fraction, stage)` callback (0..1; the server's /v1/models can show it
while a model loads) and, for a large model, a log line at every tenth of the weights.

Fractions only grow; the last call is (1.0, "loaded"). The callback runs on the loading threads, so it must be
cheap and thread-safe (e.g. store the number)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("pdserve.loader")

ProgressFn = Callable[[float, str], None]
LOG_FROM_BYTES = 256 * 2**20  # models at least this large log their progress; smaller ones load in a blink
HEADER_SHARE = 0.05  # the fraction reported once the header is read and the weights begin


class LoadProgress:
    def __init__(self, name: str, total_bytes: int, callback: ProgressFn | None) -> None:
        self.name, self.total, self.callback = name, max(1, total_bytes), callback
        self.done = 0
        self.t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._logged_tenth = 0
        self._report(HEADER_SHARE, "reading weights")

    def _report(self, fraction: float, stage: str) -> None:
        if self.callback is not None:
            self.callback(fraction, stage)

    def advance(self, nbytes: int, stage: str = "reading weights") -> None:
        """`nbytes` more of the weights are in memory."""
        with self._lock:
            self.done += nbytes
            share = min(self.done / self.total, 1.0)
            fraction = HEADER_SHARE + (1.0 - HEADER_SHARE) * share * 0.99  # 1.0 is for finish()
            tenth = int(share * 10)
            log = self.total >= LOG_FROM_BYTES and tenth > self._logged_tenth
            if log:
                self._logged_tenth = tenth
            self._report(fraction, stage)
        if log:
            logger.info("loading %s: %d%% of %.0f MiB (%.1f s)", self.name, tenth * 10, self.total / 2**20,
                        time.perf_counter() - self.t0)

    def finish(self) -> None:
        self._report(1.0, "loaded")
        logger.info("loaded %s: %.0f MiB in %.2f s", self.name, self.total / 2**20, time.perf_counter() - self.t0)

"""A bounded record of what each engine step carried, for per-request explanations (explain.py).

The engine appends one StepRecord per non-idle step; only the last `size` steps are kept, so memory is bounded
whatever the traffic. A record holds counts and the prefill chunks (request id, tokens) of the step, never the
decoding requests' ids: a decoding request appears in every step it is scheduled in, and its own token timestamps
already say which steps those were (a step that produced its token ends exactly at that token's time).
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from dataclasses import dataclass

STEP_LOG_SIZE = 4096  # steps kept: minutes of decode at ~30 ms a step; one record is ~200 bytes


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step's composition. `end` is the timestamp postprocess gave the tokens this step sampled."""

    index: int
    start: float
    end: float
    kind: str  # StepKind value
    num_decodes: int  # decode rows (a speculating decode counts once)
    prefill_chunks: tuple[tuple[str, int], ...]  # (request id, prompt tokens computed) per prefill chunk
    preempted: tuple[str, ...]  # requests preempted while scheduling this step
    grammar_s: float  # structured output: filling the next-token bitmasks
    kv_wait_s: float  # PD roles: polling KV transfers (pulls landing, pins released) before scheduling
    model_s: float  # forward pass and sampling
    lora_ids: tuple[int, ...] = ()  # with --enable-lora: the adapters with rows in the step (0: the base model)


class StepLog:
    """A ring of the last `size` StepRecords. Written by the engine thread, read by any (a lock: the ring is
    copied for readers, never iterated while it changes)."""

    def __init__(self, size: int = STEP_LOG_SIZE) -> None:
        self._steps: deque[StepRecord] = deque(maxlen=size)
        self._lock = threading.Lock()
        self.num_steps = 0  # recorded in total (the index of the next record)

    def append(self, start: float, end: float, kind: str, num_decodes: int,
               prefill_chunks: tuple[tuple[str, int], ...], preempted: tuple[str, ...], grammar_s: float,
               kv_wait_s: float, model_s: float, lora_ids: tuple[int, ...] = ()) -> StepRecord:
        rec = StepRecord(self.num_steps, start, end, kind, num_decodes, prefill_chunks, preempted, grammar_s,
                         kv_wait_s, model_s, lora_ids)
        with self._lock:
            self._steps.append(rec)
            self.num_steps += 1
        return rec

    def between(self, t0: float, t1: float) -> tuple[list[StepRecord], bool]:
        """The steps that ended in (t0, t1], oldest first, and whether the ring still reaches back to t0 (False:
        older steps were dropped, the list may be incomplete)."""
        with self._lock:
            steps = list(self._steps)
        complete = not steps or steps[0].end <= t0 or len(steps) < (self._steps.maxlen or 0)
        # ends are increasing (one engine thread, perf_counter): two binary searches, no scan
        lo, hi = bisect.bisect_right(steps, t0, key=_end), bisect.bisect_right(steps, t1, key=_end)
        return steps[lo:hi], complete


def _end(step: StepRecord) -> float:
    return step.end

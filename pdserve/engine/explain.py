"""Why was a request slow: its timeline, and a cause for each stall (an inter-token gap above a threshold).

Built from what the engine already keeps: the request's phase timestamps (RequestTimes) and the StepLog of recent
steps. A token is stamped with the end time of the step that sampled it, so the steps inside a gap (t_k, t_k+1]
are exactly the steps that ended after token k up to the one that produced token k+1. Causes, in that window:
  * `prefill_chunk`: a step also computed another request's prompt chunk (which request, how many tokens);
  * `preempted`: this request lost its KV blocks and recomputed;
  * `not_scheduled`: steps ran without this request (waiting for KV blocks or a batch slot);
  * `grammar`: structured output bitmasks took a large share of the gap;
  * `kv_transfer`: PD roles polling KV transfers took a large share of the gap;
  * `slow_step`: none of the above: the step itself was slow (a busy machine, a large batch).
Output is bounded (at most MAX_STALLS stalls, MAX_CHUNKS chunks listed), so it fits in a log line.
"""

from __future__ import annotations

import re
import statistics
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pdserve.engine.step_log import StepLog, StepRecord
from pdserve.outputs import RequestTimes

MAX_STALLS = 8  # the largest gaps explained per request
MAX_CHUNKS = 16  # prefill chunks listed in a timeline (the rest summed)
MAX_CAUSE_CHUNKS = 4  # other requests' chunks named per stall (the largest)
SHARE = 0.25  # grammar / KV-transfer time counts as a cause above this share of the gap


@dataclass(frozen=True)
class StallThreshold:
    """An ITL gap is a stall above `factor` x the request's median ITL, or above `seconds` when that is set."""

    factor: float = 2.0
    seconds: float | None = None

    @classmethod
    def parse(cls, text: str) -> StallThreshold:
        """`3x` (relative to the median ITL), `50ms` or `0.05` (seconds)."""
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(x|ms|s)?\s*", text)
        if m is None or float(m.group(1)) <= 0:
            raise ValueError(f"ITL threshold {text!r}: give a factor like 2x, or a time like 50ms or 0.05")
        value, unit = float(m.group(1)), m.group(2) or "s"
        if unit == "x":
            return cls(factor=value)
        return cls(seconds=value / 1000 if unit == "ms" else value)

    def of(self, itls: list[float]) -> float:
        return self.seconds if self.seconds is not None else self.factor * statistics.median(itls)


@dataclass(frozen=True)
class _Explained:
    request_id: str
    times: RequestTimes
    finish_reason: str | None
    kv_transfer_result: dict[str, Any] | None


def _r(x: float) -> float:
    return round(x, 5)


class RequestExplainer:
    """Explains finished (or running) requests from their timestamps and the engine's StepLog."""

    def __init__(self, step_log: StepLog, threshold: StallThreshold | None = None) -> None:
        self.step_log = step_log
        self.threshold = threshold or StallThreshold()

    def explain(self, request_id: str, times: RequestTimes, finish_reason: str | None = None,
                kv_transfer_result: dict[str, Any] | None = None) -> dict[str, Any]:
        """A request's timeline and stalls, from its timestamps (a RequestOutput's `metrics`), why it finished and
        its PD hand-off (RequestOutput.kv_transfer_result)."""
        req = _Explained(request_id, times, finish_reason, kv_transfer_result)
        t = times
        steps, complete = self.step_log.between(t.arrival, t.finished if t.finished is not None else float("inf"))
        out: dict[str, Any] = {"timeline": self._timeline(req), "stalls": []}
        itls = t.itls
        if itls:
            limit = self.threshold.of(itls)
            out["itl_median_s"], out["itl_threshold_s"] = _r(statistics.median(itls)), _r(limit)
            gaps = sorted(((g, k) for k, g in enumerate(itls) if g > limit), reverse=True)[:MAX_STALLS]
            out["stalls"] = [self._stall(req, k, g, steps) for g, k in sorted(gaps, key=lambda x: x[1])]
        if not complete:
            out["steps_dropped"] = True  # the step ring no longer reaches this request's start: causes may be missing
        return out

    def _timeline(self, req: _Explained) -> list[dict[str, Any]]:
        t, a = req.times, req.times.arrival
        events: list[dict[str, Any]] = [{"event": "queued", "at_s": 0.0, "duration_s": _r(t.queue_time)
                                         if t.queue_time is not None else None}]
        res = req.kv_transfer_result or {}
        if res and not res.get("do_remote_prefill"):  # PD decode instance: the prompt's KV pulled from prefill
            events.append({"event": "kv_pull", "duration_s": res.get("seconds"), "bytes": res.get("bytes"),
                           "ok": res.get("ok"), "from": res.get("remote_engine_id")})
        for end, n in t.prefill_chunks[:MAX_CHUNKS]:
            events.append({"event": "prefill_chunk", "at_s": _r(end - a), "tokens": n})
        if len(t.prefill_chunks) > MAX_CHUNKS:
            rest = t.prefill_chunks[MAX_CHUNKS:]
            events.append({"event": "prefill_chunks_more", "count": len(rest), "tokens": sum(n for _, n in rest)})
        events += [{"event": "preempted", "at_s": _r(p - a)} for p in t.preemptions]
        if t.first_token is not None:
            events.append({"event": "first_token", "at_s": _r(t.first_token - a)})
        if len(t.token_times) > 1:
            events.append({"event": "decode", "at_s": _r(t.token_times[0] - a), "tokens": len(t.token_times) - 1,
                           "duration_s": _r(t.token_times[-1] - t.token_times[0]), "tpot_s": _r(t.tpot or 0.0)})
        if t.finished is not None:
            events.append({"event": "finished", "at_s": _r(t.finished - a), "reason": req.finish_reason})
        return sorted(events, key=lambda e: float(e.get("at_s") or 0.0))

    def _stall(self, req: _Explained, k: int, gap: float, steps: list[StepRecord]) -> dict[str, Any]:
        """The gap between output tokens k and k+1, and its causes."""
        t0, t1 = req.times.token_times[k], req.times.token_times[k + 1]
        window = [s for s in steps if t0 < s.end <= t1]
        rid = req.request_id
        causes: list[dict[str, Any]] = []
        chunks = [(n, other, s.index) for s in window for other, n in s.prefill_chunks if other != rid]
        for n, other, index in sorted(chunks, reverse=True)[:MAX_CAUSE_CHUNKS]:
            causes.append({"cause": "prefill_chunk", "request_id": other, "tokens": n, "step": index})
        if len(chunks) > MAX_CAUSE_CHUNKS:
            causes.append({"cause": "prefill_chunk_more", "count": len(chunks) - MAX_CAUSE_CHUNKS,
                           "tokens": sum(n for n, _, _ in sorted(chunks, reverse=True)[MAX_CAUSE_CHUNKS:])})
        if any(t0 < p <= t1 for p in req.times.preemptions):
            causes.append({"cause": "preempted", "recomputed_tokens": sum(n for s in window for o, n in
                                                                          s.prefill_chunks if o == rid)})
        elif len(window) > 1:  # a decode gets a token in every step it runs in: the others ran without it
            causes.append({"cause": "not_scheduled", "steps": len(window) - 1})
        for name, field in (("grammar", "grammar_s"), ("kv_transfer", "kv_wait_s")):
            spent = sum(getattr(s, field) for s in window)
            if spent > SHARE * gap:
                causes.append({"cause": name, "seconds": _r(spent)})
        if not causes:
            last = window[-1] if window else None
            causes.append({"cause": "slow_step", "step_s": _r(last.end - last.start) if last else None,
                           "model_s": _r(last.model_s) if last else None,
                           "batch": last.num_decodes + len(last.prefill_chunks) if last else None})
        return {"token_index": k + 1, "at_s": _r(t1 - req.times.arrival), "gap_s": _r(gap), "causes": causes}


class ExplanationHistory:
    """The explanations of the last `size` finished requests, by request id (bounded: oldest dropped). Written on
    the engine thread, read by HTTP handlers."""

    def __init__(self, size: int = 1000) -> None:
        self.size = size
        self._items: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, request_id: str, record: dict[str, Any]) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._items[request_id] = record
            self._items.move_to_end(request_id)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, request_id: str, tenant: str | None = None, any_tenant: bool = False,
            by_prefix: bool = False) -> list[dict[str, Any]]:
        """The record of `request_id`, or of each child of the API request `request_id` (`<id>-<i>-<j>`), that
        belongs to `tenant` (a record's `tenant`, None for none) unless `any_tenant`. `by_prefix` (the admin):
        every record whose id starts with `request_id`, of any tenant."""
        with self._lock:
            if by_prefix:
                return [v for k, v in self._items.items() if k.startswith(request_id)]
            if request_id in self._items:
                found = [self._items[request_id]]
            else:
                child = re.compile(re.escape(request_id) + r"-\d+-\d+")
                found = [v for k, v in self._items.items() if child.fullmatch(k)]
        return [v for v in found if any_tenant or v.get("tenant") == tenant]

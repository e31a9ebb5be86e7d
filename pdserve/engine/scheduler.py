"""Iteration-level scheduler: every step re-plans which requests advance and by how many tokens.

There is no prefill phase or decode phase here, only `num_computed_tokens` catching up with `num_tokens` within a
token budget. Order: running requests first (their decodes, or the next chunk of a chunked prefill), then waiting
requests in arrival order. When blocks run out, the latest-arrived running request is preempted (its blocks
freed; it recomputes later). Only `Engine.postprocess` appends tokens and finishes requests.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request, RequestStatus


class StepKind(enum.StrEnum):
    """What a step computed: the step-time metric label."""

    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"  # decodes and prefill chunks in one step
    IDLE = "idle"


@dataclass
class SchedulerOutput:
    """What one step computes. `scheduled` keeps decodes (one new token) ahead of prefill chunks."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, num_new_tokens)
    preempted: list[Request] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def kind(self) -> StepKind:
        if not self.scheduled:
            return StepKind.IDLE
        if self.num_prefill_tokens and self.num_decode_tokens:
            return StepKind.MIXED
        return StepKind.PREFILL if self.num_prefill_tokens else StepKind.DECODE


def is_decode(request: Request, num_new_tokens: int) -> bool:
    """A decode advances by exactly the newest output token."""
    return (num_new_tokens == 1 and request.num_output_tokens > 0
            and request.num_computed_tokens == request.num_tokens - 1)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # total, for metrics
        # pdserve.disagg.manager.KVTransferManager when this engine hands KV over (PD roles)
        self.kv_transfer: Any = None

    # ---- admission / removal -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Retire a request: free its blocks at once. Idempotent."""
        assert status.finished
        if request.request_id not in self.requests:
            return
        request.status = status
        request.times.finished = time.perf_counter()
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        # the KV transfer manager may keep the blocks (pinned for a decode instance)
        if self.kv_transfer is None or not self.kv_transfer.on_finish(request, status):
            self.block_manager.free(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + (self.kv_transfer.num_loading if self.kv_transfer is not None else 0)

    # ---- one step ------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        now = time.perf_counter()
        decodes: list[tuple[Request, int]] = []
        prefills: list[tuple[Request, int]] = []

        # 1. running requests, in order; preempt the latest arrival when blocks run out
        scheduled_running: list[Request] = []
        queue = list(self.running)
        while queue and budget > 0:
            req = queue.pop(0)
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(req, num_new):
                victim = queue[-1] if queue else req  # `running` is in arrival order
                self._preempt(victim, now, out)
                if victim is req:
                    break
                queue.remove(victim)
            else:
                scheduled_running.append(req)
                (decodes if is_decode(req, num_new) else prefills).append((req, num_new))
                budget -= num_new

        # 2. waiting requests in arrival order, unless this step had to preempt (memory is tight)
        num_loading = self.kv_transfer.num_loading if self.kv_transfer is not None else 0
        while (self.waiting and not out.preempted and budget > 0
               and len(self.running) + num_loading < self.max_num_seqs):
            req = self.waiting[0]
            computed_blocks, num_cached = self.block_manager.get_computed_blocks(req)
            if self.kv_transfer is not None and self.kv_transfer.wants_remote_load(req, num_cached):
                # PD decode side: hold blocks, pull the prompt's KV in a connector thread (no token budget)
                if not self.kv_transfer.start_load(req, computed_blocks, num_cached, now):
                    break
                self.waiting.popleft()
                num_loading += 1
                continue
            remaining = req.num_tokens - num_cached
            if not self.enable_chunked_prefill and remaining > budget:
                break
            num_new = min(remaining, budget)
            if not self.block_manager.allocate_slots(req, num_new, computed_blocks):
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            if req.times.first_scheduled is None:
                req.times.first_scheduled = now
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.times.preemptions:  # keep `running` in arrival order: the preemption victim is its tail
                self.running.sort(key=lambda r: r.times.arrival)
            prefills.append((req, num_new))
            budget -= num_new

        out.scheduled = decodes + prefills
        out.num_decode_tokens = len(decodes)
        out.num_prefill_tokens = sum(n for _, n in prefills)
        return out

    def _preempt(self, req: Request, now: float, out: SchedulerOutput) -> None:
        """Recompute-style preemption: free all blocks, go back to the head of the waiting queue."""
        self.running.remove(req)
        self.block_manager.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.times.preemptions.append(now)
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        out.preempted.append(req)

"""Iteration-level scheduler: every step re-plans which requests advance and by how many tokens.

There is no prefill phase or decode phase here, only `num_computed_tokens` catching up with `num_tokens` within a
token budget. Order: running requests first (their decodes, or the next chunk of a chunked prefill), then waiting
requests in queue order. When blocks run out, the running request last in queue order is preempted (its blocks
freed; it recomputes later). Only `Engine.postprocess` appends tokens and finishes requests.

Queue order (`Scheduler.order_key`): under policy `fcfs`, arrival. Under `priority`, the request field `priority`
(lower first, as vLLM) aged by waiting time: a request's key is `arrival + priority x aging_s`, which orders requests
exactly as an effective priority `priority - waited / aging_s` that improves with every second waited (all requests
share "now", so the static key gives the same order at any instant). Starvation bound: a request of priority p that
arrived at t is overtaken only by requests that arrive before `t + (p - q) x aging_s`, q their priority; with q_min
the best priority clients send, after `(p - q_min) x aging_s` seconds no new arrival goes ahead of it. `aging_s = 0`
is strict (priority, arrival), with no such bound.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Sequence

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.spec_decode import SpecDecoder
from pdserve.engine.step_budget import StepBudget
from pdserve.kv_transfer.base import KVTransfer
from pdserve.model.inputs import SamplingMetadata, ScheduledRequest, SchedulerOutput, StepKind

__all__ = ["Scheduler", "SchedulerOutput", "StepKind", "is_decode", "make_sampling_metadata"]


def is_decode(request: Request, num_new_tokens: int) -> bool:
    """A decode advances by exactly the newest output token."""
    return (num_new_tokens == 1 and request.num_output_tokens > 0
            and request.num_computed_tokens == request.num_tokens - 1)


def make_sampling_metadata(requests: Sequence[Request]) -> SamplingMetadata:
    """The sampler's per-row view of `requests` (one row each, in order), taken before this step's tokens are
    appended. Token lists and generators are shared with the requests, not copied."""
    md = SamplingMetadata()
    for r in requests:
        p = r.sampling_params
        md.temperature.append(p.temperature)
        md.greedy.append(p.greedy)
        md.top_k.append(p.top_k)
        md.top_p.append(p.top_p)
        md.min_p.append(p.min_p)
        md.repetition_penalty.append(p.repetition_penalty)
        md.presence_penalty.append(p.presence_penalty)
        md.frequency_penalty.append(p.frequency_penalty)
        md.generators.append(r.generator)
        md.num_logprobs.append(p.logprobs)
        banned: list[int] = []
        # no stop token (nor EOS) before min_tokens; a constrained row's grammar alone decides when it may end
        if r.num_output_tokens < p.min_tokens and r.matcher is None:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(r.eos_token_ids))
        md.banned_token_ids.append(banned)
        md.prompt_token_ids.append(r.prompt_token_ids)
        md.output_token_ids.append(r.output_token_ids)
        md.logit_bias.append(p.logit_bias)
        md.token_bitmask.append(None)  # the engine fills constrained rows (LLMEngine._fill_token_bitmasks)
        md.draft_token_ids.append(r.spec_token_ids)
        md.banned_positions.append(max(0, p.min_tokens - r.num_output_tokens) if banned else 0)
    return md


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, kv_transfer: KVTransfer | None = None,
                 kv_load_failure_policy: str = "recompute", step_budget: StepBudget | None = None,
                 policy: str = "fcfs", priority_aging_s: float = 0.0, spec: SpecDecoder | None = None) -> None:
        self.block_manager = block_manager
        self.spec = spec  # speculative decoding: drafts for decodes (None: off)
        self.policy = policy  # "fcfs" | "priority": see order_key
        self.priority_aging_s = priority_aging_s
        self.step_budget = step_budget  # caps the prefill tokens of steps that carry decodes (ITL tail)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()  # in queue order (order_key), preempted requests first under fcfs
        self.running: list[Request] = []  # in queue order: the preemption victim is the tail
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # total, for metrics
        # PD roles: pulls KV for WAITING_FOR_REMOTE_KVS requests and pins finished prefills' blocks
        self.kv_transfer = kv_transfer
        self.kv_load_failure_policy = kv_load_failure_policy  # "recompute" | "fail"
        self.num_kv_load_recomputes = 0  # failed pulls recomputed from the prompt, for metrics

    # ---- admission / removal -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self._enqueue(request)

    def order_key(self, req: Request) -> tuple[float, float]:
        """Queue order, smallest first: arrival under fcfs; aged (priority, arrival) under priority (module doc)."""
        arrival = req.times.arrival
        if self.policy != "priority":
            return (0.0, arrival)
        if self.priority_aging_s > 0:
            return (arrival + req.priority * self.priority_aging_s, arrival)
        return (float(req.priority), arrival)

    def _enqueue(self, req: Request, front: bool = False) -> None:
        """Into the waiting queue: fcfs appends (or, for a preempted or failed-load request, puts it first);
        priority inserts it at its key's place."""
        if self.policy != "priority":
            if front:
                self.waiting.appendleft(req)
            else:
                self.waiting.append(req)
            return
        self.waiting.insert(bisect.bisect_right(self.waiting, self.order_key(req), key=self.order_key), req)

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
        # the KV transfer may keep the blocks (pinned for a decode instance, or a pull still writing them)
        if self.kv_transfer is None or not self.kv_transfer.on_finish(request, status):
            self.block_manager.free(request.request_id)
        if self.spec is not None:
            self.spec.on_finished(request)
        del self.requests[request.request_id]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_loading(self) -> int:
        """Requests waiting for remote KV: they hold blocks and a running slot."""
        return self.kv_transfer.num_loading if self.kv_transfer is not None else 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + self.num_loading

    def _add_running(self, req: Request) -> None:
        """Join the running batch, keeping it in queue order (a preempted or KV-loaded request may come before
        the tail)."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        if len(self.running) > 1 and self.order_key(self.running[-2]) > self.order_key(req):
            self.running.sort(key=self.order_key)

    # ---- KV transfer (PD disaggregation) -------------------------------------------------------------------
    def update_from_kv_transfer(self) -> list[tuple[Request, str]]:
        """Apply the pulls that ended: a loaded request joins the running batch (its next step computes the last
        prompt token); a failed one is recomputed from the prompt or, under policy 'fail', returned with the
        reason for the engine to fail it."""
        if self.kv_transfer is None:
            return []
        failed: list[tuple[Request, str]] = []
        for load in self.kv_transfer.get_finished():
            req = self.requests.get(load.request_id)
            if req is None or req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            if load.ok:
                req.num_computed_tokens = load.num_computed_tokens
                self.block_manager.cache_full_blocks(req)
                self._add_running(req)
            elif self.kv_load_failure_policy == "recompute":
                self.num_kv_load_recomputes += 1
                self.block_manager.free(req.request_id)
                req.num_computed_tokens = 0
                req.status = RequestStatus.WAITING
                self._enqueue(req, front=True)
            else:
                failed.append((req, load.error or "KV transfer failed"))
        return failed

    # ---- one step ------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        now = time.perf_counter()
        decodes: list[tuple[Request, int]] = []
        prefills: list[tuple[Request, int]] = []

        cap = self._prefill_cap(budget)  # None: prefill chunks limited by the token budget only

        # 1. running requests, in queue order; preempt the last one in that order when blocks run out
        queue = list(self.running)
        while queue and budget > 0:
            req = queue.pop(0)
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            decode = is_decode(req, num_new)
            if cap is not None and not decode:
                if cap <= 0:
                    continue
                num_new = min(num_new, cap)
                cap -= num_new
            while not self.block_manager.allocate_slots(req, num_new):
                victim = queue[-1] if queue else req  # `running` is in queue order: the worst key is last
                self._preempt(victim, now, out)
                if victim is req:
                    break
                queue.remove(victim)
            else:
                req.spec_token_ids = []
                (decodes if decode else prefills).append((req, num_new))
                budget -= num_new

        # 2. waiting requests in queue order, unless this step had to preempt (memory is tight)
        kv = self.kv_transfer
        num_loading = self.num_loading
        while (self.waiting and not out.preempted_req_ids and budget > 0
               and len(self.running) + num_loading < self.max_num_seqs):
            req = self.waiting[0]
            computed_blocks, num_cached = self.block_manager.get_computed_blocks(req)
            if kv is not None and kv.wants_remote_load(req, num_cached):
                # PD decode side: hold blocks, pull the prompt's KV in a connector thread (no token budget)
                if not kv.start_load(req, computed_blocks, num_cached):
                    break
                self.waiting.popleft()
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                req.num_cached_tokens = num_cached
                if req.times.first_scheduled is None:
                    req.times.first_scheduled = now
                num_loading += 1
                continue
            remaining = req.num_tokens - num_cached
            if not self.enable_chunked_prefill and remaining > budget:
                break
            num_new = min(remaining, budget)
            if cap is not None and self.enable_chunked_prefill:
                if cap <= 0:
                    break
                num_new = min(num_new, cap)
            if not self.block_manager.allocate_slots(req, num_new, computed_blocks):
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            if req.times.first_scheduled is None:
                req.times.first_scheduled = now
            self._add_running(req)
            prefills.append((req, num_new))
            budget -= num_new
            if cap is not None:
                cap -= num_new

        # 3. drafts for the decodes, from the budget that prefills left (a draft never delays a prompt's chunk)
        if self.spec is not None and decodes:
            self._schedule_drafts(decodes, budget, len(prefills) + len(self.waiting))
        return self._fill_output(out, decodes, prefills)

    def _schedule_drafts(self, decodes: list[tuple[Request, int]], budget: int, num_prefilling: int) -> None:
        """Speculative decoding: the policy plans each decode's drafts (weighing the requests whose prefill they
        would delay); each gets the slots its drafts need, or none (never a preemption for a draft)."""
        assert self.spec is not None
        if not self.spec.begin_step([r for r, _ in decodes], num_prefilling):
            return
        for req, num_new in decodes:
            if budget <= 0:
                break
            drafts, cost = self.spec.propose(req, budget)
            if drafts and not self.block_manager.allocate_slots(req, num_new + len(drafts)):
                # no target slots for them: a plain decode (what a draft model computed of the context stays valid)
                drafts = []
            req.spec_token_ids = drafts
            budget -= cost

    def _fill_output(self, out: SchedulerOutput, decodes: list[tuple[Request, int]],
                     prefills: list[tuple[Request, int]]) -> SchedulerOutput:
        """The step's rows in the runner's order: plain decodes, decodes with drafts, prefill chunks."""
        if self.spec is not None:  # a batched proposer (draft model) drafts for the speculating decodes now
            self.spec.fill([r for r, _ in decodes if r.spec_token_ids])
        spec = [(r, n) for r, n in decodes if r.spec_token_ids]
        plain = [(r, n) for r, n in decodes if not r.spec_token_ids]
        order = plain + spec + prefills
        out.scheduled_reqs = [self._scheduled(r, n) for r, n in order]
        out.num_decode_tokens = len(plain)
        out.num_spec_decodes = len(spec)
        out.num_spec_tokens = sum(n + len(r.spec_token_ids) for r, n in spec)
        out.num_prefill_tokens = sum(n for _, n in prefills)
        out.sampling_metadata = make_sampling_metadata(
            [r for (r, _), s in zip(order, out.scheduled_reqs) if s.sample])
        return out

    def _prefill_cap(self, budget: int) -> int | None:
        """The step budget's prefill cap for this step's decodes (the running requests one token behind)."""
        if self.step_budget is None:
            return None
        decodes = [(r.num_computed_tokens, 1) for r in self.running
                   if is_decode(r, r.num_tokens - r.num_computed_tokens)]
        if not self.waiting and len(decodes) == len(self.running):
            return None  # a decode-only step: no prefill to cap, so no prediction to make
        return self.step_budget.prefill_cap(decodes, budget - len(decodes))

    def _scheduled(self, req: Request, num_new: int) -> ScheduledRequest:
        c = req.num_computed_tokens
        s = ScheduledRequest(req.request_id, req.all_token_ids[c:c + num_new] + req.spec_token_ids, c,
                             self.block_manager.get_block_ids(req.request_id),
                             c + num_new == req.num_tokens and not req.pooling, len(req.spec_token_ids))
        if req.pooling:  # an embedding request: its rows are pooled (each position once), none sampled
            if req.num_pooled < c + num_new:
                s.pool_offset = max(0, req.num_pooled - c)
        elif req.needs_prompt_rows:  # position p scores prompt token p + 1; tokens already scored are skipped
            start, end = max(c, len(req.prompt_logprobs) - 1), min(c + num_new, req.num_prompt_tokens - 1)
            if start < end:
                s.prompt_logprobs = req.sampling_params.prompt_logprobs
                s.prompt_logprob_offset = start - c
                s.prompt_logprob_targets = req.prompt_token_ids[start + 1:end + 1]
        return s

    def _preempt(self, req: Request, now: float, out: SchedulerOutput) -> None:
        """Recompute-style preemption: free all blocks, back to the waiting queue (fcfs: at its head)."""
        self.running.remove(req)
        self.block_manager.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.times.preemptions.append(now)
        if self.spec is not None:
            self.spec.on_preempted(req)
        self._enqueue(req, front=True)
        self.num_preemptions += 1
        out.preempted_req_ids.append(req.request_id)

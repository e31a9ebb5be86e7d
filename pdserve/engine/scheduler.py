"""Iteration-level scheduler: every step re-plans which requests advance and by how many tokens.

There is no prefill phase or decode phase here, only `num_computed_tokens` catching up with `num_tokens` within a
token budget. Order: running requests first (their decodes, or the next chunk of a chunked prefill), then waiting
requests in queue order. When blocks run out, the running request last in queue order is preempted (its blocks
freed; it recomputes later).

The scheduler is the one writer of request state: `schedule()` admits, preempts and books KV slots;
`update_from_output()` applies what the model computed (num_computed_tokens, appended tokens, stop tokens and
max_tokens, hashed and trimmed blocks); `finish_requests` / `fail` / `finish_by_stop_string` retire requests and free
their blocks at once. Every other part reads requests, or reports to the scheduler.

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
from pdserve.engine.kv_offload import KVOffloadStore
from pdserve.engine.messages import EngineCoreOutput
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.spec_decode import SpecDecoder
from pdserve.engine.step_budget import StepBudget
from pdserve.engine.structured import fill_bitmask
from pdserve.errors import ErrorCode
from pdserve.kv_transfer.base import KVTransfer
from pdserve.model.inputs import ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput, StepKind
from pdserve.outputs import TokenLogprobs

__all__ = ["Scheduler", "SchedulerOutput", "StepKind", "is_decode"]


def is_decode(request: Request, num_new_tokens: int) -> bool:
    """A decode advances by exactly the newest output token."""
    return (num_new_tokens == 1 and request.num_output_tokens > 0
            and request.num_computed_tokens == request.num_tokens - 1)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, kv_transfer: KVTransfer | None = None,
                 kv_load_failure_policy: str = "recompute", step_budget: StepBudget | None = None,
                 policy: str = "fcfs", priority_aging_s: float = 0.0, spec: SpecDecoder | None = None,
                 max_model_len: int | None = None, vocab_size: int = 0) -> None:
        self.block_manager = block_manager
        self.vocab_size = vocab_size  # structured output's token bitmasks
        self.max_model_len = max_model_len  # a request stops (length) when its tokens reach it (None: no limit)
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
        # the requests the last update_from_output stepped, finished ones included: a stop string found in their new
        # tokens (the output processor's) finishes them here (finish_by_stop_string)
        self._stepped: dict[str, Request] = {}
        self._in_runner: set[str] = set()  # requests whose state the model runner holds (sent as new_requests)
        self.kv_offload: KVOffloadStore | None = None  # the prefix cache's disk tier (set by the engine)
        self._finished_req_ids: list[str] = []  # of those, finished since take_finished_req_ids
        # waiting requests held for a prefix block another request is writing; the total held, for metrics
        self._prefix_waiters: set[str] = set()
        self.num_prefix_waits = 0

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
        else:  # kept, but nobody may wait on a block it will not write
            self.block_manager.forget_writing(request.request_id)
        if self.spec is not None:
            self.spec.on_finished(request)
        del self.requests[request.request_id]
        self._prefix_waiters.discard(request.request_id)
        if request.request_id in self._in_runner:  # the runner drops its state (EngineCore tells it)
            self._in_runner.discard(request.request_id)
            self._finished_req_ids.append(request.request_id)

    def finish_requests(self, request_ids: Sequence[str], status: RequestStatus) -> list[EngineCoreOutput]:
        """Retire the requests (those still here) with `status` (an abort), freeing their blocks at once."""
        outs = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self.finish_request(req, status)
                outs.append(self.output(req))
        return outs

    def fail(self, req: Request, message: str, code: ErrorCode) -> EngineCoreOutput:
        """Finish a request as failed (its blocks freed); only it fails, never its neighbours."""
        req.error, req.error_code = message, code
        self.finish_request(req, RequestStatus.FINISHED_ERROR)
        return self.output(req)

    def take_finished_req_ids(self) -> list[str]:
        """Requests finished since the last call whose state the runner holds (it frees it)."""
        ids, self._finished_req_ids = self._finished_req_ids, []
        return ids

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
    def update_from_kv_transfer(self) -> list[EngineCoreOutput]:
        """Apply the pulls that ended: a loaded request joins the running batch (its next step computes the last
        prompt token); a failed one is recomputed from the prompt or, under policy 'fail', fails (its output
        returned)."""
        if self.kv_transfer is None:
            return []
        failed: list[EngineCoreOutput] = []
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
                failed.append(self.fail(req, load.error or "KV transfer failed", ErrorCode.KV_TRANSFER_FAILED))
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
                if not decode:  # proposals are for a decode's next token
                    req.spec_token_ids = []
                (decodes if decode else prefills).append((req, num_new))
                budget -= num_new

        # 2. waiting requests in queue order, unless this step had to preempt (memory is tight)
        if not out.preempted_req_ids:
            budget = self._schedule_waiting(prefills, budget, cap, now)

        # 3. drafts for the decodes, from the budget that prefills left (a draft never delays a prompt's chunk)
        if self.spec is not None and decodes:
            budget = self._schedule_drafts(decodes, budget, len(prefills) + len(self.waiting))
        return self._fill_output(out, decodes, prefills, budget)

    def _schedule_waiting(self, prefills: list[tuple[Request, int]], budget: int, cap: int | None,
                          now: float) -> int:
        """Admit waiting requests in queue order within the budget (and the step budget's prefill cap); one whose next
        prompt block a running request is writing waits for it (it hits it then) while those behind it go on.
        Returns the budget left."""
        kv = self.kv_transfer
        num_loading = self.num_loading
        bm = self.block_manager
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) + num_loading < self.max_num_seqs:
            req = self.waiting[i]
            if self.kv_offload is not None and not self.kv_offload.promote(req):
                break  # its prefix is read from disk a bounded amount a step (cached blocks, then the lookup)
            computed_blocks, num_cached = bm.get_computed_blocks(req)
            if kv is not None and kv.wants_remote_load(req, num_cached):
                # PD decode side: hold blocks, pull the prompt's KV in a connector thread (no token budget)
                if not kv.start_load(req, computed_blocks, num_cached):
                    break
                del self.waiting[i]
                self._admitted(req, num_cached, now)
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                num_loading += 1
                continue
            if bm.in_flight_writer(req, computed_blocks) is not None:
                if req.request_id not in self._prefix_waiters:
                    self._prefix_waiters.add(req.request_id)
                    self.num_prefix_waits += 1
                i += 1
                continue
            remaining = req.num_tokens - num_cached
            if not self.enable_chunked_prefill and remaining > budget:
                break
            num_new = min(remaining, budget)
            if cap is not None and self.enable_chunked_prefill:
                if cap <= 0:
                    break
                num_new = min(num_new, cap)
            if not bm.allocate_slots(req, num_new, computed_blocks):
                break
            del self.waiting[i]
            req.num_computed_tokens = num_cached
            self._admitted(req, num_cached, now)
            self._add_running(req)
            prefills.append((req, num_new))
            budget -= num_new
            if cap is not None:
                cap -= num_new
        return budget

    def _admitted(self, req: Request, num_cached: int, now: float) -> None:
        """A waiting request got its blocks: its lookup counts, its next prompt block is in flight."""
        self.block_manager.record_lookup(req.num_tokens, num_cached)
        self.block_manager.note_writing(req)
        self._prefix_waiters.discard(req.request_id)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_cached
        if req.times.first_scheduled is None:
            req.times.first_scheduled = now

    def _schedule_drafts(self, decodes: list[tuple[Request, int]], budget: int, num_prefilling: int) -> int:
        """Speculative decoding: of each decode's proposals (spec_token_ids, from the runner's drafter after its
        last step), the row takes what the policy plans (weighing the requests whose prefill drafts would delay) and
        the budget leaves, if slots can be had for them (never a preemption for a draft). Returns the budget left."""
        assert self.spec is not None
        if not self.spec.begin_step([r for r, _ in decodes], num_prefilling):
            for req, _ in decodes:
                req.spec_token_ids = []
            return budget
        for req, num_new in decodes:
            drafts = req.spec_token_ids[:self.spec.num_drafts(req, budget)]
            if drafts and not self.block_manager.allocate_slots(req, num_new + len(drafts)):
                drafts = []  # no target slots for them: a plain decode
            req.spec_token_ids = drafts
            budget -= len(drafts)
        return budget

    def _fill_output(self, out: SchedulerOutput, decodes: list[tuple[Request, int]],
                     prefills: list[tuple[Request, int]], budget: int) -> SchedulerOutput:
        """The step's rows in the runner's order: plain decodes, decodes with drafts, prefill chunks; the requests
        new to the runner; and, with speculative decoding, which rows to draft for after the step and the budget
        their drafting may take."""
        spec = [(r, n) for r, n in decodes if r.spec_token_ids]
        plain = [(r, n) for r, n in decodes if not r.spec_token_ids]
        order = plain + spec + prefills
        out.scheduled_reqs = [self._scheduled(r, n) for r, n in order]
        out.num_decodes = len(plain)
        out.num_spec_decodes = len(spec)
        out.num_spec_tokens = sum(n + len(r.spec_token_ids) for r, n in spec)
        out.num_prefill_tokens = sum(n for _, n in prefills)
        for req, _ in order:
            if req.request_id not in self._in_runner and not req.pooling:
                self._in_runner.add(req.request_id)
                out.new_requests.append(NewRequestData(
                    req.request_id, req.prompt_token_ids, req.sampling_params, frozenset(req.eos_token_ids),
                    req.matcher is not None, list(req.output_token_ids)))
        if self.spec is not None:
            num_sampling = sum(s.sample for s in out.scheduled_reqs)
            for (req, _), s in zip(order, out.scheduled_reqs):
                if s.sample and not req.lora_int_id:  # drafters know the base model only: no LoRA drafts
                    s.propose_drafts = self.spec.num_to_propose(req, num_sampling)
            out.draft_budget = max(budget, 0)
        return out

    def _prefill_cap(self, budget: int) -> int | None:
        """The step budget's prefill cap for this step's decodes (the running requests one token behind)."""
        if self.step_budget is None:
            return None
        decodes: list[tuple[int, int]] = []
        backlog = 0  # prompt tokens still to compute
        pending = len(self.waiting)  # requests whose prompt is not yet computed
        for r in self.running:
            n = r.num_tokens - r.num_computed_tokens
            if is_decode(r, n):
                decodes.append((r.num_computed_tokens, 1))
            else:
                backlog += n
                pending += 1
        if not decodes or (not self.waiting and not backlog):
            return None  # no decodes to protect, or a decode-only step: nothing to cap
        for r in self.waiting:  # counted only as far as matters: the queue may be long
            if backlog > 64 * budget:
                break
            backlog += r.num_tokens - r.num_computed_tokens
        formed = min(self.max_num_seqs, len(self.running) + len(self.waiting))
        return self.step_budget.prefill_cap(decodes, budget - len(decodes), formed, backlog, pending)

    def _scheduled(self, req: Request, num_new: int) -> ScheduledRequest:
        c = req.num_computed_tokens
        s = ScheduledRequest(req.request_id, req.all_token_ids[c:c + num_new] + req.spec_token_ids, c,
                             self.block_manager.get_block_ids(req.request_id),
                             c + num_new == req.num_tokens and not req.pooling, len(req.spec_token_ids),
                             lora_id=req.lora_int_id, num_prompt_tokens=req.num_prompt_tokens,
                             group_block_ids=self.block_manager.group_block_ids(req.request_id))
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
        req.spec_token_ids = []
        self._enqueue(req, front=True)
        self.num_preemptions += 1
        out.preempted_req_ids.append(req.request_id)

    # ---- a step's results ----------------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput,
                           now: float) -> list[EngineCoreOutput]:
        """Apply what the model computed for `sched`: advance num_computed_tokens, hash the blocks that filled up,
        keep scored prompt logprobs and pooled states, append sampled tokens and finish requests at a stop token,
        max_tokens or the context limit (their blocks freed at once), and keep the drafts proposed for the next
        step. Rows of `out` are the sampled requests of `sched` (ScheduledRequest.sample), in order. `now` stamps
        this step's tokens and chunks. Returns one EngineCoreOutput per request that sampled, finished or failed."""
        outs: list[EngineCoreOutput] = []
        self._stepped = {}
        row = 0
        for d in sched.scheduled_reqs:
            req = self.requests[d.req_id]
            self._stepped[req.request_id] = req
            self._advance(req, d, now)
            if (scored := out.prompt_logprobs.get(req.request_id)) is not None:
                req.prompt_logprobs.extend(scored)
            if d.pool_offset is not None and (pooled := out.pooled.get(req.request_id)) is not None:
                req.pool_sum = pooled if req.pool_sum is None else req.pool_sum + pooled
                # a recompute after preemption passes positions pooled before: they count once
                req.num_pooled = max(req.num_pooled, d.num_computed_tokens + d.num_scheduled_tokens)
            if req.pooling and req.num_computed_tokens == req.num_tokens:
                assert req.pool_sum is not None and req.num_pooled == req.num_prompt_tokens
                self.finish_request(req, RequestStatus.FINISHED_STOPPED)
                outs.append(self.output(req))
            elif d.sample:
                outs.append(self._append_sampled(req, d, out, row, now))
            row += d.sample
        for rid, drafts in out.draft_token_ids.items():
            if (running := self.requests.get(rid)) is not None:  # still running: they wait for its next step
                running.spec_token_ids = drafts
        return outs

    def _advance(self, req: Request, d: ScheduledRequest, now: float) -> None:
        """The step computed d's tokens: all but its drafts count now (accepted drafts count as appended)."""
        if not d.num_draft_tokens and not is_decode(req, d.num_scheduled_tokens):
            req.times.prefill_chunks.append((now, d.num_scheduled_tokens))
        req.num_computed_tokens += d.num_scheduled_tokens - d.num_draft_tokens
        self.block_manager.cache_full_blocks(req)

    def _append_sampled(self, req: Request, d: ScheduledRequest, out: ModelRunnerOutput, row: int,
                        now: float) -> EngineCoreOutput:
        """Append a sampled row's tokens in order, as if decoded one by one: one token, or a speculating decode's
        accepted drafts then its correction/bonus token. A stop token, max_tokens, the context limit or a complete
        grammar finishes the request and drops the rest."""
        drafted, req.spec_token_ids = d.num_draft_tokens, []
        if out.errors and (err := out.errors[row]) is not None:  # only this row's sampling raised
            return self.fail(req, f"sampling failed: {err}", ErrorCode.SAMPLING_FAILED)
        toks, lps = out.sampled_token_ids[row], out.logprobs[row]
        if drafted and self.spec is not None:
            self.spec.on_verified(req, drafted, len(toks) - 1)
            req.num_draft_tokens += drafted
            req.num_accepted_tokens += len(toks) - 1
        if req.matcher is not None and not req.matcher.accept_token(toks[0]):  # constrained: never drafts
            # only when every token was masked (a bug or an impossible grammar): fail, never emit invalid output
            return self.fail(req, f"sampled token {toks[0]} is not allowed by the structured output grammar",
                             ErrorCode.SAMPLING_FAILED)
        appended = 0
        for tok in toks:
            if appended:  # the previous token was an accepted draft: its K/V were computed this step
                req.num_computed_tokens += 1
            req.append_output_token(tok)
            appended += 1
            req.times.token_times.append(now)
            if req.times.first_token is None:
                req.times.first_token = now
            status = self._check_stop(req, tok)
            if status is not None:
                self.finish_request(req, status)
                break
        if drafted and not req.is_finished:  # hash the blocks the accepted drafts filled; free rejected ones'
            self.block_manager.cache_full_blocks(req)
            self.block_manager.trim(req)
        want_lps = req.sampling_params.logprobs is not None
        return self.output(req, toks[:appended], [lp for lp in lps[:appended] if lp is not None] if want_lps
                           else None)

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        """The stops a token decides (stop strings need text: the output processor finds them)."""
        p = req.sampling_params
        if req.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and tok in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if tok in p.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or (self.max_model_len is not None
                                                       and req.num_tokens >= self.max_model_len):
            return RequestStatus.FINISHED_LENGTH
        if req.matcher is not None and req.matcher.is_terminated():
            return RequestStatus.FINISHED_STOPPED  # the grammar is complete (its stop token was accepted)
        return None

    def finish_by_stop_string(self, request_id: str, num_output_tokens: int, stop: str) -> None:
        """The output processor found stop string `stop` completed by output token `num_output_tokens` of a request
        the last step appended to: its later tokens are dropped and it finishes as stopped (its blocks freed now,
        before the next step). A request already finished by the step (at max_tokens, or a stop token after the
        string) takes the string's reason instead."""
        req = self._stepped.get(request_id)
        if req is None:
            return
        extra = req.num_output_tokens - num_output_tokens
        assert 0 <= extra, "a stop string ends within the tokens appended"
        if extra:
            del req.output_token_ids[num_output_tokens:]
            del req.all_token_ids[len(req.all_token_ids) - extra:]
            del req.times.token_times[len(req.times.token_times) - extra:]
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
        req.stop_reason = stop
        if req.is_finished:
            req.status = RequestStatus.FINISHED_STOPPED
        else:
            self.finish_request(req, RequestStatus.FINISHED_STOPPED)

    def fail_stepped(self, request_id: str, message: str, code: ErrorCode) -> None:
        """A request the last step appended to failed after the step (its output could not be processed)."""
        req = self._stepped.get(request_id)
        if req is None:
            return
        req.error, req.error_code = message, code
        if req.is_finished:
            req.status = RequestStatus.FINISHED_ERROR
        else:
            self.finish_request(req, RequestStatus.FINISHED_ERROR)

    def fill_grammar_bitmask(self, sched: SchedulerOutput) -> float:
        """Structured output: the next-token bitmask of each constrained sampled row, from its matcher (a batch with
        no constrained row costs one pass over the rows). Returns the seconds it took."""
        t0 = time.perf_counter()
        sampled = [self.requests[d.req_id] for d in sched.scheduled_reqs if d.sample]
        constrained = [r for r in sampled if r.matcher is not None]
        if constrained:
            bitmask = fill_bitmask([r.matcher for r in constrained], self.vocab_size)
            for j, r in enumerate(constrained):
                sched.token_bitmask[r.request_id] = bitmask[j]
        return time.perf_counter() - t0

    def output(self, req: Request, new_token_ids: list[int] | None = None,
               new_logprobs: list[TokenLogprobs] | None = None) -> EngineCoreOutput:
        """What the request reports this step (plain data: no reference to the request itself)."""
        pooled = None
        if req.pooling and req.status == RequestStatus.FINISHED_STOPPED and req.pool_sum is not None:
            pooled = req.pool_sum / req.num_pooled
        return EngineCoreOutput(
            req.request_id, new_token_ids or [], new_logprobs, req.times, max(req.num_cached_tokens, 0),
            req.status.finish_reason, req.stop_reason, req.error, req.error_code,
            req.prompt_logprobs if req.sampling_params.prompt_logprobs is not None else None, pooled,
            req.kv_transfer_result, req.num_draft_tokens, req.num_accepted_tokens)

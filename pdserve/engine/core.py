"""EngineCore: one step is schedule -> run -> update, and what it did.

The core holds the scheduler (the one writer of request state) and the model runner, and measures each step for
the live roofline, the step budget's time model and speculative decoding. It speaks plain data both ways: Requests
in (from the input processor), EngineCoreOutputs out (to the output processor), so it could run in a process of its
own. Single-threaded: the engine thread drives it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from pdserve.engine.kv_offload import KVOffloadStore
from pdserve.engine.messages import EngineCoreOutput, EngineCoreOutputs, StepStats
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler, SchedulerOutput, StepKind, is_decode
from pdserve.engine.spec_decode import SpecDecoder
from pdserve.engine.step_budget import StepBudget
from pdserve.engine.step_log import StepLog
from pdserve.errors import ErrorCode
from pdserve.kv_transfer.base import KVTransfer
from pdserve.model.runner import ModelRunner
from pdserve.roofline import RooflineMeter, StepCostModel

logger = logging.getLogger("pdserve.engine")


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, step_budget: StepBudget, roofline: RooflineMeter,
                 kv_transfer: KVTransfer | None = None, spec: SpecDecoder | None = None) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.step_budget = step_budget
        self.step_cost: StepCostModel = step_budget.cost
        self.roofline = roofline
        self.kv_transfer = kv_transfer
        self.spec = spec
        self.step_log = StepLog()  # what each recent step carried: per-request explanations (explain.py)
        self.kv_offload: KVOffloadStore | None = None  # the prefix cache's disk tier (set by the engine)

    def add_request(self, req: Request) -> None:
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: Sequence[str]) -> list[EngineCoreOutput]:
        """Finish requests as aborted and free their blocks at once."""
        outs = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self._release_finished()
        return outs

    def _release_finished(self) -> None:
        """The runner drops the state of the requests that finished (its drafter's KV blocks too)."""
        if finished := self.scheduler.take_finished_req_ids():
            self.runner.finish_requests(finished)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> EngineCoreOutputs:
        """Schedule, run and update once; returns each stepped request's news and what the step did."""
        t0 = time.perf_counter()
        outputs = self.scheduler.update_from_kv_transfer()  # pulls that landed join; failed ones fail
        t_kv = time.perf_counter() - t0
        sched = self.scheduler.schedule()
        if not sched.scheduled_reqs:
            return self._idle(sched, outputs, t0)
        t_grammar = self.scheduler.fill_grammar_bitmask(sched)
        t_run = time.perf_counter()
        try:
            with torch.profiler.record_function(f"pdserve.forward.{sched.kind.value}"):  # profiler label
                result = self.runner.execute(sched)
        except Exception as exc:  # a failed forward fails the requests in it, not the engine
            logger.exception("model step failed")
            failed = [self.scheduler.fail(self.scheduler.requests[d.req_id], f"model step failed: {exc!r}",
                                          ErrorCode.MODEL_STEP_FAILED) for d in sched.scheduled_reqs]
            self._release_finished()
            return EngineCoreOutputs(outputs + failed, self._stats(sched, time.perf_counter() - t0))
        t_run = time.perf_counter() - t_run
        accepted0 = self.spec.stats.num_accepted_tokens if self.spec is not None else 0
        now = time.perf_counter()
        self._log_step(sched, t0, now, t_grammar, t_kv, t_run)
        outputs += self.scheduler.update_from_output(sched, result, now)
        if self.kv_offload is not None:  # blocks this step filled, copied out before a later step reuses them
            self.kv_offload.save_new_blocks()
        self._release_finished()
        stats = self._stats(sched, 0.0)
        if self.spec is not None:
            stats.num_accepted_tokens = self.spec.stats.num_accepted_tokens - accepted0
        self._observe(sched, stats, t_run, time.perf_counter() - t0)
        return EngineCoreOutputs(outputs, stats)

    def _idle(self, sched: SchedulerOutput, outputs: list[EngineCoreOutput], t0: float) -> EngineCoreOutputs:
        self._release_finished()  # KV pulls that failed
        if self.kv_transfer is not None and self.scheduler.num_loading and not outputs:
            self.kv_transfer.wait(0.01)  # only KV pulls in flight: sleep until one lands instead of spinning
        return EngineCoreOutputs(outputs, StepStats(StepKind.IDLE, 0, 0, len(sched.preempted_req_ids),
                                                    time.perf_counter() - t0))

    @staticmethod
    def _stats(sched: SchedulerOutput, duration: float) -> StepStats:
        return StepStats(sched.kind, sched.num_prefill_tokens, sched.num_decodes + sched.num_spec_tokens,
                         len(sched.preempted_req_ids), duration,
                         num_draft_tokens=sum(d.num_draft_tokens for d in sched.scheduled_reqs))

    def _log_step(self, sched: SchedulerOutput, t0: float, now: float, t_grammar: float, t_kv: float,
                  t_run: float) -> None:
        """The step's record for explanations: its decodes, its prefill chunks (request, tokens), its preemptions.
        Read before the update advances the counters that tell a decode from a chunk."""
        reqs = self.scheduler.requests
        chunks = tuple((d.req_id, d.num_scheduled_tokens) for d in sched.scheduled_reqs
                       if not d.num_draft_tokens and not is_decode(reqs[d.req_id], d.num_scheduled_tokens))
        loras = tuple(sorted({d.lora_id for d in sched.scheduled_reqs})) if self.runner.lora is not None else ()
        self.step_log.append(t0, now, sched.kind.value, len(sched.scheduled_reqs) - len(chunks), chunks,
                             tuple(sched.preempted_req_ids), t_grammar, t_kv, t_run, loras)

    def _observe(self, sched: SchedulerOutput, stats: StepStats, t_run: float, duration: float) -> None:
        """Feed the step to the roofline meter, the step budget's time model and speculative decoding."""
        seqs = [(d.num_computed_tokens, d.num_scheduled_tokens) for d in sched.scheduled_reqs]
        stats.flops, stats.bytes = self.step_cost.cost(seqs, sum(d.num_sample_rows for d in sched.scheduled_reqs))
        self.roofline.add(sched.kind, t_run, stats.flops, stats.bytes)
        # speculation compares the step with its prediction from before this step was fitted in
        predicted = self.step_budget.predict_cost(stats.flops, stats.bytes) if self.spec is not None else None
        self.step_budget.observe(stats.flops, stats.bytes, t_run)
        stats.mfu, stats.mbu = self.roofline.utilization(stats.flops, stats.bytes, t_run)
        stats.model_time, stats.duration = t_run, duration
        if self.spec is not None:
            self._observe_spec_step(sched, seqs, stats, predicted)

    def _observe_spec_step(self, sched: SchedulerOutput, seqs: list[tuple[int, int]], stats: StepStats,
                           predicted: float | None) -> None:
        """Speculative decoding learns from each step: the decode tokens it emitted and its duration, less the
        predicted time of its prefill chunks (the same in either mode), and for a decode-only step its residual
        against the time model."""
        assert self.spec is not None
        num_decodes = sched.num_decodes + sched.num_spec_decodes
        seconds: float | None = stats.duration
        if sched.num_prefill_tokens:
            rows = sum(d.num_sample_rows for d in sched.scheduled_reqs[:num_decodes])
            decode_only = self.step_budget.predict_cost(*self.step_cost.cost(seqs[:num_decodes], rows))
            seconds = None if predicted is None or decode_only is None else stats.duration - (predicted - decode_only)
        self.spec.observe_step(num_decodes, num_decodes + stats.num_accepted_tokens, stats.num_draft_tokens,
                               seconds, None if sched.num_prefill_tokens else predicted)

    def apply_output_processing(self, stops: Sequence[tuple[str, int, str]],
                                failed: Sequence[tuple[str, str]]) -> None:
        """What the output processor found in the step's text: stop strings (request, output tokens kept, the
        string) and postprocessing failures. The scheduler finishes those requests, freeing their blocks before
        the next step."""
        for rid, num_output_tokens, stop in stops:
            self.scheduler.finish_by_stop_string(rid, num_output_tokens, stop)
        for rid, message in failed:
            self.scheduler.fail_stepped(rid, message, ErrorCode.POSTPROCESS_FAILED)
        self._release_finished()

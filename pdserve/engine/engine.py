"""LLMEngine: add requests, step (schedule -> run -> postprocess), abort. Single-threaded; the async front
(server) drives it from its own thread.

Postprocess is the only place that appends tokens, finishes requests and frees blocks.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.config import EngineConfig, dtype_reason, parse_size
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.kv_transfer import KVTransfer
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler, SchedulerOutput, StepKind, is_decode
from pdserve.engine.spec_decode import DraftTarget, SpecDecoder, make_proposer
from pdserve.engine.step_budget import StepBudget
from pdserve.engine.step_log import StepLog
from pdserve.engine.structured import StructuredOutputManager, fill_bitmask
from pdserve.errors import ErrorCode, RequestRejected
from pdserve.kernels import kernels_description, kernels_isa, resolve_kernels
from pdserve.model.device import device_memory, kv_cache_budget, resolve_device
from pdserve.model.load_progress import ProgressFn
from pdserve.model.loader import LoadedModel, load_model
from pdserve.model.packed_weights import describe_weights
from pdserve.model.runner import ModelRunner
from pdserve.model.sampler import SamplerOutput
from pdserve.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from pdserve.roofline import DeviceSpec, RooflineMeter
from pdserve.sampling_params import SamplingParams

logger = logging.getLogger("pdserve.engine")

PromptType = str | list[int] | dict[str, Any]
MAX_PRIORITY = 2**31 - 1  # request priorities, as an int32


@dataclass
class StepStats:
    """What one step did, for metrics and the live roofline."""

    kind: StepKind
    num_prefill_tokens: int
    num_decode_tokens: int  # decode rows' tokens: one each, 1 + drafts for a speculating decode
    num_preempted: int
    duration: float  # seconds spent in the model step (schedule + run + postprocess)
    model_time: float = 0.0  # seconds in the forward pass and sampling alone
    flops: float = 0.0  # work the step needed, from the model shape (roofline.StepCostModel)
    bytes: float = 0.0
    mfu: float = 0.0  # flops / model_time / peak FLOP/s (0 when no peaks are known)
    mbu: float = 0.0  # bytes / model_time / memory bandwidth
    num_draft_tokens: int = 0  # speculative decoding: drafts verified this step
    num_accepted_tokens: int = 0  # of which accepted


@dataclass
class StepResult:
    """What one call of `LLMEngine.step()` did: the outputs it produced and its stats."""

    outputs: list[RequestOutput]
    stats: StepStats


class LLMEngine:
    def __init__(self, config: EngineConfig, model: LoadedModel | None = None, tokenizer: Any = None, *,
                 device_peaks: DeviceSpec | None = None, load_progress: ProgressFn | None = None) -> None:
        """`device_peaks`: what the live roofline measures MFU/MBU against (None: no peaks). Callers resolve
        `config.device_peaks` (roofline.resolve_device_peaks), which may benchmark the machine.
        `load_progress(fraction, stage)`: the weights' load progress (model/load_progress.py)."""
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.device = resolve_device(config.device)
        self.kernels = resolve_kernels(config.kernels, config.torch_dtype, config.device)  # "native" | "torch"
        cuda_sized = self.device.type == "cuda" and config.num_kv_blocks is None  # KV from device memory
        free_total = device_memory(self.device) if cuda_sized else (0, 0)
        loaded = model if model is not None else load_model(config.model, dtype=config.torch_dtype,
                                                            keep_quantized=self.kernels == "native",
                                                            progress=load_progress)
        self.arch = loaded.arch
        self.tokenizer = tokenizer if tokenizer is not None else loaded.tokenizer()
        self.model_name = config.model or "smollm2-135m"
        self.max_model_len = min(config.max_model_len or self.arch.max_position_embeddings,
                                 self.arch.max_position_embeddings)
        self.block_size = config.block_size
        num_blocks = ModelRunner.profile_num_blocks(config.max_num_batched_tokens, config.max_num_seqs,
                                                    config.block_size) if cuda_sized else self._num_blocks(config)
        self.runner = ModelRunner(self.arch, loaded.state_dict, config.torch_dtype, num_blocks,
                                  config.block_size, self.max_model_len, self.kernels,
                                  config.quantization, config.linear_backend, self.device, config.attention_backend,
                                  max_num_seqs=config.max_num_seqs)
        if self.device.type == "cuda" and not config.enforce_eager:
            self.runner.enable_decode_graphs()
        if cuda_sized:
            self._size_kv_cache_from_device(config, *free_total)
        self.num_blocks = self.runner.num_blocks
        self.block_manager = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        # PD disaggregation (prefill/decode roles): KV hand-off over a connector
        self.kv_transfer: KVTransfer | None = None
        if config.kv_role != "both":
            from pdserve.disagg.manager import KVTransferManager

            self.kv_transfer = KVTransferManager(config, self.block_manager, self.runner.kv_cache)
        self.step_cost = self.runner.step_cost_model()
        self.step_budget = StepBudget(self.step_cost, config.max_step_ms)
        spec_config = config.speculative
        self.spec = None
        if spec_config is not None:  # a draft model loads here, with the target's vocabulary and block geometry
            target = DraftTarget(config, self.arch, self.tokenizer, self.kernels, self.num_blocks, self.max_model_len)
            self.spec = SpecDecoder(spec_config, make_proposer(spec_config, target), predict=self.step_budget.predict)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, self.kv_transfer, config.kv_load_failure_policy,
                                   self.step_budget, config.scheduling_policy, config.priority_aging_s, self.spec)
        self.eos_token_ids = self._eos_ids()
        self.structured = StructuredOutputManager(self.tokenizer, self.arch.vocab_size, self.eos_token_ids)
        self._ids = itertools.count()
        self.roofline = RooflineMeter(device_peaks, config.torch_dtype)
        self.step_log = StepLog()  # what each recent step carried: per-request explanations (explain.py)
        logger.info("engine ready: %s, %s, %d KV blocks x %d tokens (%.1f MiB), max_model_len %d, kernels %s",
                    self.model_name, config.torch_dtype, self.num_blocks, self.block_size,
                    self.runner.kv_cache.numel() * self.runner.kv_cache.element_size() / 2**20, self.max_model_len,
                    kernels_description(self.kernels))
        if self.kernels == "native":
            logger.info("native kernels (%s): weights %s; float weights and KV cache in %s (--dtype %s: %s)",
                        kernels_isa("native")[0], describe_weights(self.runner.model),
                        str(config.torch_dtype).removeprefix("torch."), config.dtype, dtype_reason(config.dtype))

    def _num_blocks(self, config: EngineConfig) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        per_block = config.block_size * self.arch.kv_bytes_per_token(config.torch_dtype)
        n = parse_size(config.kv_cache_memory) // per_block
        if n < 1:
            raise ValueError(f"kv_cache_memory={config.kv_cache_memory} holds no block of {per_block} bytes")
        return int(n)

    def _size_kv_cache_from_device(self, config: EngineConfig, free: int, total: int) -> None:
        """vLLM's gpu_memory_utilization: profile the largest step, then give the KV cache what the budget leaves."""
        activations = self.runner.profile_activation_bytes(config.max_num_batched_tokens, config.max_num_seqs)
        plan = kv_cache_budget(total, free, self.runner.weight_bytes, activations, config.gpu_memory_utilization)
        per_block = config.block_size * self.arch.kv_bytes_per_token(config.torch_dtype)
        self.runner.allocate_kv_cache(max(1, plan.num_blocks(per_block) - 1))  # one block is the scratch block
        logger.info("device memory plan: %s", plan)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        eos = self.arch.eos_token_id
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(eos)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ---- requests ------------------------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """Render a conversation with the model's own chat template (given `tools`, OpenAI function tools, as
        Hugging Face templates take them); returns a token-id prompt."""
        kw = {"tools": tools} if tools else {}
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **kw)
        # the template writes its own special tokens, so the tokenizer must not add a BOS again
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}

    def make_request(self, prompt: PromptType, params: SamplingParams | None = None, request_id: str | None = None,
                     arrival_time: float | None = None, priority: int = 0) -> Request:
        """Tokenize and validate; raises RequestRejected if the request can never be served. Touches no engine
        state, so a server thread may call it while the engine thread steps. `priority`: lower runs first; only
        under scheduling_policy `priority` may it be non-zero (as vLLM)."""
        params = params or SamplingParams()
        self._validate_priority(priority)
        text, token_ids = self.tokenize(prompt)
        max_tokens = self._validate(token_ids, params)
        rid = request_id if request_id is not None else str(next(self._ids))
        req = Request(rid, token_ids, params, self.eos_token_ids, max_tokens, prompt=text, arrival_time=arrival_time,
                      priority=priority)
        if params.structured_outputs is not None:  # compiled here, off the engine thread (cached: once for n > 1)
            req.matcher = self.structured.new_matcher(self.structured.compile(params.structured_outputs))
        req.detokenizer = IncrementalDetokenizer(
            self.tokenizer, token_ids, skip_special_tokens=params.skip_special_tokens, stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output, min_tokens=params.min_tokens)
        return req

    def make_requests(self, prompts: list[PromptType], params: SamplingParams, parent_id: str,
                      arrival_time: float | None = None, cache_salt: str | None = None,
                      priority: int = 0) -> list[Request]:
        """Fan one API request out into its sequences: `params.n` samples of each prompt, ids
        `<parent_id>-<prompt index>-<sample index>`, sample j seeded with `seed + j`. The prefix cache shares the
        samples' prompt blocks. `cache_salt` (vLLM's request field): prefix-cache blocks are shared only with
        requests of the same salt. Raises RequestRejected for the first child that can never be served."""
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise RequestRejected("cache_salt must be a non-empty string", "cache_salt", ErrorCode.INVALID_PARAMETER)
        reqs = []
        for i, prompt in enumerate(prompts):
            for j in range(params.n):
                child = params if params.n == 1 else dataclasses.replace(
                    params, n=1, seed=None if params.seed is None else params.seed + j)
                req = self.make_request(prompt, child, f"{parent_id}-{i}-{j}", arrival_time, priority)
                req.parent_id, req.prompt_index, req.sample_index = parent_id, i, j
                req.cache_salt = cache_salt  # set before the scheduler first looks the prompt up
                reqs.append(req)
        return reqs

    def make_embedding_requests(self, prompts: list[PromptType], parent_id: str,
                                priority: int = 0) -> list[Request]:
        """One pooling request per prompt (ids `<parent_id>-<i>-0`): prefilled, never sampled; it finishes when its
        prompt is computed, with `RequestOutput.embedding` the mean over its tokens of the final hidden state (after
        the model's final norm), L2-normalised. A prompt may have at most max_model_len - 1 tokens."""
        reqs = self.make_requests(prompts, SamplingParams(max_tokens=1, temperature=0.0), parent_id,
                                  priority=priority)
        for r in reqs:
            r.pooling = True
        return reqs

    def add_request(self, prompt: PromptType | Request, params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> Request:
        """Queue one sequence (a prompt, or a Request from make_request)."""
        req = prompt if isinstance(prompt, Request) else self.make_request(prompt, params, request_id, arrival_time)
        self.scheduler.add_request(req)
        return req

    def _validate(self, token_ids: list[int], params: SamplingParams) -> int:
        n = len(token_ids)
        if n == 0:
            raise RequestRejected("the prompt is empty", "prompt", ErrorCode.INVALID_PROMPT)
        vocab = self.arch.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})", "prompt", ErrorCode.INVALID_PROMPT)
        limit = self.max_model_len
        if n >= limit:
            raise RequestRejected(f"the prompt has {n} tokens; this model's maximum context length is {limit} "
                                  f"tokens, which must also hold at least one output token", "prompt",
                                  ErrorCode.CONTEXT_LENGTH_EXCEEDED)
        self._validate_sampling(params)
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
        if n + max_tokens > limit:
            raise RequestRejected(f"the prompt has {n} tokens and max_tokens is {max_tokens}: {n + max_tokens} "
                                  f"tokens exceed this model's maximum context length of {limit}", "max_tokens",
                                  ErrorCode.CONTEXT_LENGTH_EXCEEDED)
        need = self.block_manager.blocks_needed(n + max_tokens)
        if need > self.num_blocks:
            raise RequestRejected(f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) needs {need} KV blocks "
                                  f"of {self.block_size} tokens but the whole cache has {self.num_blocks}",
                                  "max_tokens", ErrorCode.CONTEXT_LENGTH_EXCEEDED)
        if not self.config.enable_chunked_prefill and n > self.config.max_num_batched_tokens:
            raise RequestRejected(f"the prompt has {n} tokens; with chunked prefill off a prompt may have at most "
                                  f"max_num_batched_tokens={self.config.max_num_batched_tokens}", "prompt",
                                  ErrorCode.INVALID_PROMPT)
        return max_tokens

    def _validate_priority(self, priority: int) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise RequestRejected("priority must be an integer", "priority", ErrorCode.INVALID_PARAMETER)
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise RequestRejected(f"priority is {priority} but priority scheduling is off; start the server with "
                                  "--scheduling-policy priority, or send priority 0", "priority",
                                  ErrorCode.INVALID_PARAMETER)
        if abs(priority) > MAX_PRIORITY:
            raise RequestRejected(f"priority must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}]", "priority",
                                  ErrorCode.INVALID_PARAMETER)

    def _validate_sampling(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check without the model: token ids must index its logits (the sampler
        would raise for the whole batch otherwise)."""
        vocab = self.arch.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {})):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestRejected(f"{name} has token id {bad[0]}, outside this model's vocabulary [0, {vocab})",
                                      name, ErrorCode.INVALID_PARAMETER)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Finish requests as aborted and free their blocks at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outs = []
        for rid in ids:
            req = self.scheduler.requests.get(rid)
            if req is not None:
                self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
                outs.append(self._output(req, [], ""))
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def close(self) -> None:
        """Stop background parts (the KV connector's threads and sockets)."""
        if self.kv_transfer is not None:
            self.kv_transfer.close()

    # ---- one iteration -------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Schedule, run and postprocess once; returns the outputs and what the step did."""
        t0 = time.perf_counter()
        kv_failed = [self._fail(r, msg, ErrorCode.KV_TRANSFER_FAILED)
                     for r, msg in self.scheduler.update_from_kv_transfer()]
        t_kv = time.perf_counter() - t0
        sched = self.scheduler.schedule()
        if not sched.scheduled_reqs:
            if self.kv_transfer is not None and self.scheduler.num_loading and not kv_failed:
                self.kv_transfer.wait(0.01)  # only KV pulls in flight: sleep until one lands instead of spinning
            return StepResult(kv_failed, StepStats(StepKind.IDLE, 0, 0, len(sched.preempted_req_ids),
                                                   time.perf_counter() - t0))
        reqs = [self.scheduler.requests[d.req_id] for d in sched.scheduled_reqs]
        sampled_reqs = [r for r, d in zip(reqs, sched.scheduled_reqs) if d.sample]  # the sampler's rows, in order
        t_grammar = time.perf_counter()
        self._fill_token_bitmasks(sched, sampled_reqs)
        t_grammar = time.perf_counter() - t_grammar
        seqs = [(d.num_computed_tokens, d.num_scheduled_tokens) for d in sched.scheduled_reqs]
        chunks = tuple((r.request_id, d.num_scheduled_tokens) for r, d in zip(reqs, sched.scheduled_reqs)
                       if not d.num_draft_tokens and not is_decode(r, d.num_scheduled_tokens))
        stats = StepStats(sched.kind, sched.num_prefill_tokens, sched.num_decode_tokens + sched.num_spec_tokens,
                          len(sched.preempted_req_ids), 0.0,
                          num_draft_tokens=sum(d.num_draft_tokens for d in sched.scheduled_reqs))
        try:
            t_run = time.perf_counter()
            with torch.profiler.record_function(f"pdserve.forward.{sched.kind.value}"):  # profiler label
                sampled = self.runner.execute(sched)
            t_run = time.perf_counter() - t_run
        except Exception as exc:  # a failed forward fails the requests in it, not the engine
            logger.exception("model step failed")
            failed = [self._fail(r, f"model step failed: {exc!r}", ErrorCode.MODEL_STEP_FAILED) for r in reqs]
            stats.duration = time.perf_counter() - t0
            return StepResult(kv_failed + failed, stats)
        for rid, scored in sampled.prompt_logprobs.items():
            self.scheduler.requests[rid].prompt_logprobs.extend(scored)
        self._add_pooled(sched, reqs, sampled.pooled)
        accepted0 = self.spec.stats.num_accepted_tokens if self.spec is not None else 0
        now = time.perf_counter()
        self.step_log.append(t0, now, sched.kind.value, len(reqs) - len(chunks), chunks,
                             tuple(sched.preempted_req_ids), t_grammar, t_kv, t_run)
        outs = kv_failed + self._postprocess(sched, reqs, sampled_reqs, sampled, now)
        if self.spec is not None:
            stats.num_accepted_tokens = self.spec.stats.num_accepted_tokens - accepted0
        stats.flops, stats.bytes = self.step_cost.cost(seqs, sum(d.num_sample_rows for d in sched.scheduled_reqs))
        self.roofline.add(sched.kind, t_run, stats.flops, stats.bytes)
        # speculation compares the step with its prediction from before this step was fitted in
        predicted = self.step_budget.predict_cost(stats.flops, stats.bytes) if self.spec is not None else None
        self.step_budget.observe(stats.flops, stats.bytes, t_run)
        stats.mfu, stats.mbu = self.roofline.utilization(stats.flops, stats.bytes, t_run)
        stats.model_time, stats.duration = t_run, time.perf_counter() - t0
        if self.spec is not None:
            self._observe_spec_step(sched, seqs, stats, predicted)
        return StepResult(outs, stats)

    def _observe_spec_step(self, sched: SchedulerOutput, seqs: list[tuple[int, int]], stats: StepStats,
                           predicted: float | None) -> None:
        """Speculative decoding learns from each step: the decode tokens it emitted and its duration, less the
        predicted time of its prefill chunks (the same in either mode), and for a decode-only step its residual
        against the time model."""
        assert self.spec is not None
        num_decodes = sched.num_decode_tokens + sched.num_spec_decodes
        seconds: float | None = stats.duration
        if sched.num_prefill_tokens:
            rows = sum(d.num_sample_rows for d in sched.scheduled_reqs[:num_decodes])
            decode_only = self.step_budget.predict_cost(*self.step_cost.cost(seqs[:num_decodes], rows))
            seconds = None if predicted is None or decode_only is None else stats.duration - (predicted - decode_only)
        self.spec.observe_step(num_decodes, num_decodes + stats.num_accepted_tokens, stats.num_draft_tokens,
                               seconds, None if sched.num_prefill_tokens else predicted)

    def _fill_token_bitmasks(self, sched: SchedulerOutput, sampled_reqs: list[Request]) -> None:
        """Structured output: the next-token bitmask of each constrained sampled row, from its matcher. A batch with
        no constrained row costs one pass over the rows."""
        rows = [k for k, r in enumerate(sampled_reqs) if r.matcher is not None]
        if not rows:
            return
        bitmask = fill_bitmask([sampled_reqs[k].matcher for k in rows], self.arch.vocab_size)
        for j, k in enumerate(rows):
            sched.sampling_metadata.token_bitmask[k] = bitmask[j]

    def _postprocess(self, sched: SchedulerOutput, reqs: list[Request], sampled: list[Request],
                     out: SamplerOutput, now: float) -> list[RequestOutput]:
        """reqs[i] is sched.scheduled_reqs[i]; the sampler output's rows (tokens, logprobs, errors: empty when none
        failed, extra tokens: empty without drafts) are per request of `sampled` (the scheduled requests that
        sample), in that order. A decode with drafts counts only its newest token as computed here; its accepted
        drafts count as they are appended (_append_tokens). `now` stamps this step's tokens (and its StepRecord)."""
        for req, d in zip(reqs, sched.scheduled_reqs):
            if not d.num_draft_tokens and not is_decode(req, d.num_scheduled_tokens):
                req.times.prefill_chunks.append((now, d.num_scheduled_tokens))
            req.num_computed_tokens += d.num_scheduled_tokens - d.num_draft_tokens
            self.block_manager.cache_full_blocks(req)
        errors = out.errors or [None] * len(sampled)
        extra = out.extra_token_ids or [[] for _ in sampled]
        extra_lps = out.extra_logprobs or [[] for _ in sampled]
        outs = [self._finish_pooling(r) for r in reqs if r.pooling and r.num_computed_tokens == r.num_tokens]
        for k, (req, tok, lp, err) in enumerate(zip(sampled, out.token_ids, out.logprobs, errors)):
            if err is not None:  # only this row's sampling raised; its neighbours got their tokens
                req.spec_token_ids = []
                outs.append(self._fail(req, f"sampling failed: {err}", ErrorCode.SAMPLING_FAILED))
                continue
            try:
                outs.append(self._append_tokens(req, [tok, *extra[k]], [lp, *extra_lps[k]], now))
            except Exception as exc:  # e.g. a detokenizer failure: fail this request only
                logger.exception("postprocess failed for request %s", req.request_id)
                outs.append(self._fail(req, f"postprocess failed: {exc!r}", ErrorCode.POSTPROCESS_FAILED))
        return outs

    @staticmethod
    def _add_pooled(sched: SchedulerOutput, reqs: list[Request], pooled: dict[str, torch.Tensor]) -> None:
        for req, d in zip(reqs, sched.scheduled_reqs):
            if d.pool_offset is not None and req.request_id in pooled:
                s = pooled[req.request_id]
                req.pool_sum = s if req.pool_sum is None else req.pool_sum + s
                # a recompute after preemption passes positions pooled before: they count once
                req.num_pooled = max(req.num_pooled, d.num_computed_tokens + d.num_scheduled_tokens)

    def _finish_pooling(self, req: Request) -> RequestOutput:
        """An embedding request whose prompt is computed: the mean of its final hidden states, L2-normalised."""
        assert req.pool_sum is not None and req.num_pooled == req.num_prompt_tokens
        req.embedding = torch.nn.functional.normalize(req.pool_sum / req.num_pooled, dim=0).tolist()
        self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)
        return self._output(req, [], "")

    def _append_tokens(self, req: Request, toks: list[int], lps: list[TokenLogprobs | None],
                       now: float) -> RequestOutput:
        """Append a step's tokens in order, as if decoded one by one: one token, or a speculating decode's accepted
        drafts then its correction/bonus token. A stop (token, string, max_tokens, grammar) drops the rest."""
        drafted, req.spec_token_ids = len(req.spec_token_ids), []
        if drafted and self.spec is not None:
            self.spec.on_verified(req, drafted, len(toks) - 1)
            req.num_draft_tokens += drafted
            req.num_accepted_tokens += len(toks) - 1
        if req.matcher is not None and not req.matcher.accept_token(toks[0]):  # constrained: never drafts
            # only when every token was masked (a bug or an impossible grammar): fail, never emit invalid output
            return self._fail(req, f"sampled token {toks[0]} is not allowed by the structured output grammar",
                              ErrorCode.SAMPLING_FAILED)
        appended: list[int] = []
        for tok, lp in zip(toks, lps):
            if appended:  # the previous token was an accepted draft: its K/V were computed this step
                req.num_computed_tokens += 1
            req.append_output_token(tok)
            appended.append(tok)
            req.times.token_times.append(now)
            if req.times.first_token is None:
                req.times.first_token = now
            if lp is not None:
                req.logprobs.append(lp)
            status = self._check_stop(req, tok)
            if status is None and req.matcher is not None and req.matcher.is_terminated():
                status = RequestStatus.FINISHED_STOPPED  # the grammar is complete (its stop token was accepted)
            if status is not None:
                self.scheduler.finish_request(req, status)
                break
        if drafted and not req.is_finished:  # hash the blocks the accepted drafts filled; free rejected ones'
            self.block_manager.cache_full_blocks(req)
            self.block_manager.trim(req)
        assert req.detokenizer is not None
        delta = req.detokenizer.get_delta(finished=req.is_finished)
        return self._output(req, appended, delta)

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        p = req.sampling_params
        assert req.detokenizer is not None
        stop_str = req.detokenizer.update([tok])
        if req.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and tok in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if tok in p.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
            if stop_str is not None:
                req.stop_reason = stop_str
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _fail(self, req: Request, message: str, code: ErrorCode) -> RequestOutput:
        req.error, req.error_code = message, code
        self.scheduler.finish_request(req, RequestStatus.FINISHED_ERROR)
        return self._output(req, [], "")

    def _output(self, req: Request, new_tokens: list[int], delta: str) -> RequestOutput:
        """Deltas on every step; the full text, token ids and logprobs (O(length) to copy) only once finished."""
        det, done = req.detokenizer, req.is_finished
        want_lp = req.sampling_params.logprobs is not None
        comp = CompletionOutput(
            index=0, text=det.output_text if det is not None and done else "",
            token_ids=list(req.output_token_ids) if done else [],
            finish_reason=req.status.finish_reason, stop_reason=req.stop_reason,
            logprobs=list(req.logprobs) if want_lp and done else None,
            delta_text=delta, delta_token_ids=new_tokens,
            delta_logprobs=req.logprobs[len(req.logprobs) - len(new_tokens):] if want_lp and new_tokens else None)
        # the list is complete (never appended to again) once the first token is sampled: shared, not copied
        plp = req.prompt_logprobs if req.sampling_params.prompt_logprobs is not None else None
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [comp], req.is_finished, req.times,
                             max(req.num_cached_tokens, 0), req.error, req.error_code, plp, req.embedding)

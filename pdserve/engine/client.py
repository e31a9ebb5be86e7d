"""EngineClient: the server's one face of an engine (vLLM's EngineClient), over plain data.

What a server may do with an engine: process inputs (prompts -> validated requests; a worker thread may call it),
add requests all or none and stream their RequestOutputs, abort, read the tokenizer and the model's facts
(ModelInfo), the published KV state (KVSnapshot), per-request explanations, and profile steps. The server reads a
request only for its inputs (id, prompt, token ids, fan-out indices); what became of it comes in RequestOutputs. So
the engine core could move to a process of its own behind this same face (issue 28).

In-process, the engine runs in its own thread (EngineThread): HTTP work (parsing, JSON, SSE writes) happens on the
event-loop thread, tokenizing in worker threads; the engine thread only drains a command queue (adds, aborts) and
steps. Torch kernels release the GIL, so the event loop keeps serving clients while a step runs. An abort (client
gone) is applied before the next step starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from pdserve.config import EngineConfig
from pdserve.engine.client_lora import ClientLoRAs, LoRAExists, LoRAInUse, LoRANotLoaded
from pdserve.engine.engine import LLMEngine, PromptType, StepResult
from pdserve.engine.engine_thread import EngineThread, StepTurns
from pdserve.engine.explain import ExplanationHistory, RequestExplainer, StallThreshold
from pdserve.engine.messages import KVOffloadStats, LoRAStats, SchedulerStats, StepStats
from pdserve.engine.published import KVSnapshot, PrefixSummary
from pdserve.engine.request import Request
from pdserve.engine.spec_decode.stats import SpecDecodeStats
from pdserve.engine.streams import RequestStream, StepDeliveries
from pdserve.kv_transfer.base import FinishedLoad
from pdserve.lora_request import LoRARequest, next_lora_id
from pdserve.model.inputs import StepKind
from pdserve.model.lora_peft import LoRAAdapterError
from pdserve.model.packed_weights import stored_types
from pdserve.outputs import RequestOutput
from pdserve.profiler import PhaseProfiler, ProfileResult
from pdserve.profiler.traces import ProfilerLimits
from pdserve.roofline import DeviceSpec
from pdserve.sampling_params import SamplingParams

logger = logging.getLogger("pdserve.engine_client")

EngineRequest = Request  # what process_inputs makes: the server reads only its inputs

__all__ = ["EngineClient", "EngineDead", "EngineRequest", "EngineThread", "FinishedLoad", "KVOffloadStats",
           "KVSnapshot", "LLMEngine",
           "LoRAAdapterError", "LoRAExists", "LoRAInUse", "LoRANotLoaded", "LoRARequest", "LoRAStats",
           "ModelInfo",
           "PrefixSummary", "ProfilerState", "PromptType", "QueueFull", "RequestStream", "SchedulerStats",
           "ShuttingDown", "SpecDecodeStats", "StatLogger", "StepStats", "StepTurns"]


class QueueFull(RuntimeError):
    pass


class EngineDead(RuntimeError):
    pass


class ShuttingDown(RuntimeError):
    """The shutdown grace ran out: open requests end, new ones are refused."""


class ProfilerState(RuntimeError):
    """/start_profile while a profile runs, or /stop_profile with none started."""


@dataclass(frozen=True)
class ModelInfo:
    """What a server knows of the model an engine serves."""

    model: str  # the model's path or name, as configured
    max_model_len: int
    vocab_size: int
    hidden_size: int  # an embedding's dimension
    dtype: str
    kernels: str  # resolved: "native" | "torch"
    kv_role: str  # "both" | "prefill" | "decode" (PD disaggregation)
    engine_id: str | None  # PD roles: this instance's id in KV hand-offs
    speculative: bool  # speculative decoding is on: outputs report drafted and accepted tokens
    device: DeviceSpec | None  # the peaks the live roofline measures MFU/MBU against (None: unknown)
    peak_flops: float
    weight_formats: dict[str, int] = field(default_factory=dict)  # matrices per stored type: {"Q4_K": 112, "F32": 1}
    kv_cache_dtype: str = ""  # how the KV cache stores K/V: float32 | bfloat16 | int8 | float8_e4m3fn | float8_e5m2
    kv_bytes_per_token: int = 0  # KV bytes one token holds over every layer (what a PD hand-off moves)


class StatLogger(Protocol):
    """Where the engine thread reports steps and outputs (the server's metrics)."""

    def observe_step(self, step: StepStats, sched: SchedulerStats) -> None: ...

    def observe_output(self, out: RequestOutput) -> None: ...


class EngineClient:
    def __init__(self, engine: LLMEngine, stat_logger: StatLogger | None = None,
                 max_waiting_requests: int | None = None, engine_thread: EngineThread | None = None,
                 step_turns: StepTurns | None = None) -> None:
        """Serve `engine` (built on `engine_thread`, which then runs its loop; None: a thread of its own).
        `step_turns`: several models in one server take turns at stepping."""
        self._engine = engine
        self.step_turns = step_turns
        self.stat_logger = stat_logger
        self.max_waiting_requests = max_waiting_requests
        self._cmds: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()  # guards _streams between the event loop and the engine thread
        self._stop = threading.Event()
        self._engine_thread = engine_thread  # the thread that built the engine runs its loop too
        self._loop_done: Future[Any] | None = None
        self._thread = threading.Thread(target=self._loop, name="pdserve-engine", daemon=True)
        self._started = False  # the loop runs: LoRA adapters are (un)registered on it, between steps
        self._loras = ClientLoRAs()  # guarded by _lock
        self.dead: BaseException | None = None
        self.draining = False  # set at SIGTERM: /health answers 503 (requests are still served during the grace)
        self.closed = False  # set when the grace ran out: new requests are refused
        self._kv_snapshot = KVSnapshot.of(engine)  # replaced whole (one reference store) by the engine thread
        self._prefix_summary = PrefixSummary.of(engine)  # replaced whole on the engine thread, when asked
        if engine.kv_transfer is not None:  # PD roles: KV pulls landing and pins released wake the engine loop
            engine.kv_transfer.wakeup = self._wake.set
        # per-request explanations (GET /debug/requests/{id}, the log line's `explain`), made as requests finish
        self._explainer = RequestExplainer(engine.step_log)
        self._explanations = ExplanationHistory()
        # profiler by phase (/start_profile, /stop_profile): the profiler lives on the engine thread
        self._profiler_dir: str | None = None
        self._profiler_limits = ProfilerLimits()
        self.after_profile: Callable[[], None] | None = None  # the server's: hand the events' memory back to the OS
        self._profiler: PhaseProfiler | None = None
        self._profile_done: Future[ProfileResult] | None = None  # set while a profile is open
        roof, kv = engine.roofline, engine.kv_transfer
        self.model_info = ModelInfo(
            engine.config.model or engine.model_name, engine.max_model_len, engine.arch.vocab_size,
            engine.arch.hidden_size, str(engine.config.torch_dtype).removeprefix("torch."), engine.kernels,
            engine.config.kv_role, kv.engine_id if kv is not None else None, engine.spec is not None, roof.device,
            roof.peak_flops, stored_types(engine.runner.model), engine.config.kv_storage,
            engine.arch.kv_bytes_per_token(engine.config.kv_storage))

    @classmethod
    def build(cls, config: EngineConfig, engine_thread: EngineThread, device_peaks: DeviceSpec | None = None,
              load_progress: Callable[[float, str], None] | None = None, **kw: Any) -> EngineClient:
        """Build the engine on `engine_thread` (blocking: the weights load) and serve it."""
        engine = engine_thread.call(lambda: LLMEngine(config, device_peaks=device_peaks, load_progress=load_progress))
        return cls(engine, engine_thread=engine_thread, **kw)

    # ---- what the server may know ----------------------------------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        """The engine's options (effective)."""
        return self._engine.config

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer: encode, decode and the chat template (thread-safe; use off the event loop)."""
        return self._engine.tokenizer

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def kv_snapshot(self) -> KVSnapshot:
        """The latest published KV state; safe to read from any thread."""
        return self._kv_snapshot

    @property
    def prefix_summary(self) -> PrefixSummary:
        """The prefix-cache hashes last built (possibly older than the cache); safe to read from any thread."""
        return self._prefix_summary

    async def current_prefix_summary(self, timeout: float = 5.0) -> PrefixSummary:
        """The prefix-cache hashes as of the engine thread's next turn (at most one step away). When the cached set
        has not changed since the last build (an int read, atomic) that build is returned without a round trip; when
        the loop is not running, or does not answer within `timeout`, the last build is."""
        last = self._prefix_summary
        running = self._loop_done is not None and not self._loop_done.done() or self._thread.is_alive()
        if last.version == self._engine.block_manager.cache_version or not running or self.dead is not None:
            return last
        built: Future[PrefixSummary] = Future()
        self._cmds.put(("prefix_summary", built))
        self._wake.set()
        try:
            return await asyncio.wait_for(asyncio.wrap_future(built), timeout)
        except TimeoutError:
            return self._prefix_summary

    def check_json_schema(self, schema: dict[str, Any]) -> str | None:
        """Why `schema` cannot constrain output (structured output), or None."""
        return self._engine.structured.json_schema_error(schema)

    def explanations(self, request_id: str, tenant: str | None = None, any_tenant: bool = True,
                     by_prefix: bool = False) -> list[dict[str, Any]]:
        """The explanation of a finished request, or of each child of API request `request_id` (of `tenant`
        unless `any_tenant`; every id starting with `request_id` with `by_prefix`): ExplanationHistory.get."""
        return self._explanations.get(request_id, tenant, any_tenant, by_prefix)

    @property
    def explanation_history_size(self) -> int:
        return self._explanations.size

    def configure_introspection(self, explain_itl_threshold: str = "2x", history: int = 1000,
                                profiler_dir: str | None = None, profiler_limits: ProfilerLimits | None = None,
                                after_profile: Callable[[], None] | None = None) -> None:
        """Explanations' stall threshold (explain.StallThreshold.parse) and history size; profile traces' dir,
        the profiler's bounds, and what to run on the engine thread after a profile stops."""
        self._explainer.threshold = StallThreshold.parse(explain_itl_threshold)
        self._explanations.size = history
        self._profiler_dir = profiler_dir
        self._profiler_limits = profiler_limits or ProfilerLimits()
        self.after_profile = after_profile

    def observe_kv_transfer(self, on_load: Callable[[FinishedLoad], None], on_pin_timeout: Callable[[], None]) -> bool:
        """PD roles: call `on_load` for every KV pull that ends and `on_pin_timeout` for every pin freed unclaimed
        (from the engine or connector threads). False: this engine hands off no KV."""
        kv = self._engine.kv_transfer
        if kv is None:
            return False
        kv.on_load, kv.on_pin_timeout = on_load, on_pin_timeout
        return True

    # ---- inputs (any thread: no engine state touched) ----------------------------------------------------------
    def process_inputs(self, prompts: list[PromptType], params: SamplingParams, parent_id: str,
                       cache_salt: str | None = None, priority: int = 0,
                       kv_transfer_params: dict[str, Any] | None = None,
                       lora_request: LoRARequest | None = None) -> list[EngineRequest]:
        """Tokenize, validate and fan out one API request (InputProcessor.make_requests); RequestRejected when it
        can never be served. Call in a worker thread: tokenizing and grammar compiling take time."""
        return self._engine.input_processor.make_requests(prompts, params, parent_id, cache_salt=cache_salt,
                                                          priority=priority, kv_transfer_params=kv_transfer_params,
                                                          lora_request=lora_request)

    # ---- LoRA adapters (event loop; engine/client_lora.py) -----------------------------------------------------
    def lora_request(self, name: str | None) -> LoRARequest | None:
        """The loaded adapter of that name, or None."""
        return self._loras.by_name.get(name) if name is not None else None

    def loras(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._loras.by_name.values())

    async def add_lora(self, name: str, path: str) -> LoRARequest:
        """Read and check the PEFT adapter at `path` in a worker thread, then register it on the engine thread
        between steps (LoRAExists, LoRAAdapterError; ValueError without --enable-lora)."""
        with self._lock:
            self._loras.reserve(name)
        try:
            lr = LoRARequest(name, next_lora_id(), path)
            prepared = await asyncio.to_thread(self._engine.prepare_lora, lr)
            if self._started:
                done: Future[None] = Future()
                self._cmds.put(("lora_add", (lr, prepared, done)))
                self._wake.set()
                await asyncio.wrap_future(done)
            else:
                self._engine.add_lora(lr, prepared)
            with self._lock:
                self._loras.by_name[name] = lr
            return lr
        finally:
            with self._lock:
                self._loras.loading.discard(name)

    def remove_lora(self, name: str) -> LoRARequest:
        """Unload an adapter (LoRANotLoaded; LoRAInUse while an unfinished request runs with it); its weights are
        dropped on the engine thread before the next step."""
        with self._lock:
            lr = self._loras.take_unused(name, (s.request for s in self._streams.values()))
        if self._started:
            self._cmds.put(("lora_remove", lr.lora_int_id))
            self._wake.set()
        else:
            self._engine.remove_lora(lr.lora_int_id)
        return lr

    def process_embedding_inputs(self, prompts: list[PromptType], parent_id: str,
                                 priority: int = 0) -> list[EngineRequest]:
        """One pooling (embedding) request per prompt (InputProcessor.make_embedding_requests)."""
        return self._engine.input_processor.make_embedding_requests(prompts, parent_id, priority)

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._started = True
        if self._engine_thread is not None:
            self._loop_done = self._engine_thread.submit(self._loop)
        else:
            self._thread.start()

    def close(self) -> None:
        """Release the engine's background parts without a loop ever started (shutdown does it otherwise)."""
        self._engine.close()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort whatever still runs and stop the engine thread."""
        for rid in list(self._streams):
            self.abort(rid)
        self._stop.set()
        self._wake.set()
        if self._loop_done is not None:
            with contextlib.suppress(Exception):
                self._loop_done.result(timeout)
        elif self._thread.is_alive():
            self._thread.join(timeout)
        self._engine.close()

    # ---- requests ------------------------------------------------------------------------------------------
    def add_requests(self, requests: list[Request], on_finished: Callable[[RequestOutput], None] | None = None,
                     tenant: str | None = None) -> list[RequestStream]:
        """Admit an API request's children all or none (raises QueueFull, EngineDead or ShuttingDown before any is
        added), then hand them to the engine. Call on the event loop; read each returned stream with `stream`.
        `on_finished` runs on the engine thread with a child's final output, however it ends; `tenant` is kept
        with the explanations."""
        if self.dead is not None:
            raise EngineDead(f"engine loop died: {self.dead!r}")
        if self.closed:
            raise ShuttingDown("the server is shutting down")
        loop = asyncio.get_running_loop()
        with self._lock:
            waiting = self._num_waiting()
            if self.max_waiting_requests is not None and waiting + len(requests) > self.max_waiting_requests:
                raise QueueFull(f"too many waiting requests ({self.max_waiting_requests}); retry later")
            if dup := [r.request_id for r in requests if r.request_id in self._streams]:
                raise ValueError(f"duplicate request id {dup[0]!r}")
            self._loras.check_admit(requests)
            streams = [RequestStream(loop, asyncio.Queue(), r, on_finished, tenant) for r in requests]
            for st in streams:
                self._streams[st.request.request_id] = st
        for r in requests:
            self._cmds.put(("add", r))
        self._wake.set()
        return streams

    def _num_waiting(self) -> int:
        """Admitted sequences that wait for a seat in the running batch (call under _lock). Sequences not scheduled
        yet take the batch's free seats (max_num_seqs less those scheduled) first: a burst that fits in the batch
        is not refused because the engine thread has not picked it up yet."""
        unscheduled = sum(1 for s in self._streams.values() if s.request.times.first_scheduled is None)
        seats = max(0, self._engine.config.max_num_seqs - (len(self._streams) - unscheduled))
        return max(0, unscheduled - seats)

    async def stream(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """Yield an admitted request's outputs until it finishes. Closing or cancelling the consumer (client
        disconnect) aborts the request."""
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(stream.request_id)

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Admit one request and yield its outputs (`add_requests` + `stream`)."""
        [stream] = self.add_requests([request])
        async for out in self.stream(stream):
            yield out

    def fail_all(self, reason: str) -> None:
        """Shutdown grace ran out: every open stream ends with ShuttingDown, its request is aborted, and new
        requests are refused."""
        self.closed = True
        with self._lock:
            streams = list(self._streams.values())
        for s in streams:
            s.deliver(ShuttingDown(reason))
            self.abort(s.request_id)

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))
        self._wake.set()

    # ---- engine thread -------------------------------------------------------------------------------------
    def _publish(self, eng: LLMEngine) -> None:
        self._kv_snapshot = KVSnapshot.of(eng)

    def _loop(self) -> None:
        eng = self._engine
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if self._profiler is not None and self._profiler.done:  # its steps, or its time, are over
                    self._finish_profile()
                if not eng.has_unfinished_requests():
                    if eng.kv_transfer is not None:
                        eng.kv_transfer.poll_pins()  # free released / expired KV pins while idle
                    self._observe(StepStats(StepKind.IDLE, 0, 0, 0, 0.0))
                    self._publish(eng)
                    more = eng.prefault_kv()  # a few ms of committing KV pages ahead of use, then look again
                    self._wake.wait(0.0 if more else 0.5)
                    self._wake.clear()
                    continue
                result = self._step(eng)
                self._observe(result.stats)
                # published before the outputs: a client that saw its request finish reads a state this new
                self._publish(eng)
                batch = StepDeliveries()
                try:
                    for out in result.outputs:
                        self._dispatch(out, batch)
                finally:  # what was dispatched reaches its consumer even if a later output's dispatch raised
                    batch.flush()
            self._abort_open()
        except BaseException as exc:  # a bug in the engine: fail every open request, refuse new ones
            logger.exception("engine loop died")
            self.dead = exc
            with self._lock:
                streams = list(self._streams.values())
                self._streams.clear()
            for s in streams:
                s.deliver(EngineDead(f"engine loop died: {exc!r}"))

    def _abort_open(self) -> None:
        """The loop stops (shutdown): every request still open gets its final (aborted) output, so each one's
        on_finished runs (its request-log line) even when its abort was queued too late for the loop."""
        self._drain_commands()  # requests still queued for the engine join it first, then abort with the rest
        with self._lock:
            open_ids = list(self._streams)
        for rid in open_ids:
            for out in self._engine.abort_request(rid):
                self._dispatch(out)
            with self._lock:
                self._streams.pop(rid, None)

    def _drain_commands(self) -> None:
        eng = self._engine
        while True:
            try:
                kind, arg = self._cmds.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                assert isinstance(arg, Request)
                if arg.request_id in self._streams:  # not aborted while queued
                    eng.add_request(arg)
            elif kind == "profile_start":
                assert isinstance(arg, int | None)
                self._begin_profile(arg)
            elif kind == "profile_stop":
                self._finish_profile()
            elif kind == "prefix_summary":  # a router asked (GET /kv/prefix_hashes): built only now
                assert isinstance(arg, Future)
                self._prefix_summary = PrefixSummary.of(eng, self._prefix_summary)
                if not arg.done():
                    arg.set_result(self._prefix_summary)
            elif kind == "lora_add":  # (LoRARequest, PreparedAdapter, Future): an error goes to the admin call
                lr, prepared, done = cast(tuple[LoRARequest, Any, Future[None]], arg)
                try:
                    eng.add_lora(lr, prepared)
                    done.set_result(None)
                except Exception as exc:  # noqa: BLE001 - e.g. --max-loras reached; the loop goes on
                    done.set_exception(exc)
            elif kind == "lora_remove":
                assert isinstance(arg, int)
                eng.remove_lora(arg)
            else:
                assert isinstance(arg, str)
                for out in eng.abort_request(arg):
                    self._dispatch(out)
                with self._lock:
                    self._streams.pop(arg, None)

    def _dispatch(self, out: RequestOutput, batch: StepDeliveries | None = None) -> None:
        with self._lock:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
        if stream is None:
            return
        if out.finished:
            self._explain(stream.request, out, stream.tenant)
            if stream.on_finished is not None:
                try:
                    stream.on_finished(out)
                except Exception:  # a logging callback never takes the engine loop down
                    logger.exception("on_finished callback failed")
        if self.stat_logger is not None:
            self.stat_logger.observe_output(out)
        if batch is None:
            stream.deliver(out)
        else:
            batch.add(stream, out)

    def _step(self, eng: LLMEngine) -> StepResult:
        """One engine step: under the server's step turns when several models share it, profiled when asked."""
        if self.step_turns is None:
            return eng.step() if self._profiler is None else self._profiler.step(eng.step)
        with self.step_turns:
            return eng.step() if self._profiler is None else self._profiler.step(eng.step)

    def _observe(self, stats: StepStats) -> None:
        """Record a step (an idle one records nothing but refreshes the gauges, which aborts change)."""
        if self.stat_logger is None:
            return
        eng = self._engine
        bm, sched = eng.block_manager, eng.scheduler
        self.stat_logger.observe_step(stats, SchedulerStats(
            sched.num_running, sched.num_waiting, bm.usage, bm.stats.queries, bm.stats.hits, sched.num_preemptions,
            eng.spec.stats if eng.spec is not None else None, eng.lora_stats() if eng.lora is not None else None,
            eng.kv_offload.stats if eng.kv_offload is not None else None, bm.num_window_freed,
            sched.num_prefix_waits))

    def _explain(self, req: Request, out: RequestOutput, tenant: str | None) -> None:
        """Keep a finished request's explanation (engine thread; never takes the loop down)."""
        try:
            reason = out.outputs[0].finish_reason
            self._explanations.add(out.request_id, {
                "request_id": out.request_id, "parent_id": req.parent_id, "tenant": tenant, "finish_reason": reason,
                **self._explainer.explain(out.request_id, out.metrics, reason, out.kv_transfer_result)})
        except Exception:
            logger.exception("explaining request %s failed", out.request_id)

    # ---- profiler by phase ---------------------------------------------------------------------------------
    def start_profile(self, num_steps: int | None) -> None:
        """Profile the next `num_steps` steps (None: until stop_profile). Call on the event loop."""
        if self._profile_done is not None:
            raise ProfilerState("a profile is already running; POST /stop_profile first")
        self._profile_done = Future()
        self._cmds.put(("profile_start", num_steps))
        self._wake.set()

    async def stop_profile(self, wait_s: float = 0.0) -> ProfileResult:
        """Wait up to `wait_s` for the profile's steps to be done, stop it, and return its report."""
        done = self._profile_done
        if done is None:
            raise ProfilerState("no profile is running; POST /start_profile first")
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(done)), wait_s) if wait_s > 0 \
                else await self._stop_now(done)
        except TimeoutError:
            return await self._stop_now(done)
        finally:
            if done.done():
                self._profile_done = None

    async def _stop_now(self, done: Future[ProfileResult]) -> ProfileResult:
        self._cmds.put(("profile_stop", None))
        self._wake.set()
        return await asyncio.wrap_future(done)

    def _begin_profile(self, num_steps: int | None) -> None:
        assert self._profile_done is not None
        try:
            self._profiler = PhaseProfiler(num_steps, self._profiler_dir, self._engine.roofline.device,
                                           self._engine.config.torch_dtype, self._profiler_limits)
        except Exception as exc:  # e.g. a bad step count: the waiting /stop_profile gets it
            self._profile_done.set_exception(exc)

    def _finish_profile(self) -> None:
        prof, done = self._profiler, self._profile_done
        self._profiler = None
        if prof is None or done is None or done.done():
            return
        try:
            result = prof.stop()
        except Exception as exc:
            logger.exception("profiler stop failed")
            done.set_exception(exc)
            return
        del prof  # its events' memory is free now: handed back before /stop_profile answers
        if self.after_profile is not None:
            self.after_profile()
        done.set_result(result)

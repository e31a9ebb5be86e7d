"""AsyncEngine: the engine loop in its own thread, per-request output streams for asyncio handlers.

HTTP work (parsing, JSON, SSE writes) happens on the event-loop thread, tokenizing in worker threads; the engine
thread only drains a command queue (adds, aborts) and steps. An API request's children are admitted all or none
(`add_requests`), before its response starts. Torch kernels release the GIL, so the event loop keeps serving clients
while a step runs. An abort (client gone) is applied before the next step starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from pdserve.engine.engine import LLMEngine, StepResult, StepStats
from pdserve.engine.explain import ExplanationHistory, RequestExplainer
from pdserve.engine.request import Request
from pdserve.engine.scheduler import StepKind
from pdserve.outputs import RequestOutput
from pdserve.profiler import PhaseProfiler, ProfileResult
from pdserve.server.metrics import Metrics

if TYPE_CHECKING:
    from pdserve.server.tracing import RequestTracer
logger = logging.getLogger("pdserve.async_engine")


class QueueFull(RuntimeError):
    pass


class EngineDead(RuntimeError):
    pass


class ShuttingDown(RuntimeError):
    """The shutdown grace ran out: open requests end, new ones are refused."""


class ProfilerState(RuntimeError):
    """/start_profile while a profile runs, or /stop_profile with none started."""


@dataclass(frozen=True)
class KVSnapshot:
    """Block-manager and KV-transfer state as the engine thread last saw it (after a step, or while idle).
    Immutable, so the event loop reads it without racing the engine thread that changes the live state."""

    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_requests_holding_blocks: int
    num_pinned_blocks: int  # PD prefill role: blocks held for decode instances to pull
    num_requests_loading_kv: int  # PD decode role: requests whose prompt KV is being pulled

    @classmethod
    def of(cls, engine: LLMEngine) -> KVSnapshot:
        """Build on the engine thread (or before it starts)."""
        bm, kv = engine.block_manager, engine.kv_transfer
        return cls(bm.num_blocks, bm.num_free_blocks, bm.num_used_blocks, len(bm.cached), len(bm.req_blocks),
                   kv.num_pinned_blocks if kv is not None else 0, kv.num_loading if kv is not None else 0)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class RequestStream:
    """One admitted request's outputs, queued for its consumer's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    request: Request
    on_finished: Callable[[Request], None] | None = None  # runs on the engine thread once, aborts included

    def deliver(self, item: RequestOutput | BaseException) -> None:
        """Hand an item to the consumer's event loop (from the engine thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # that loop is closed: nobody listens any more, and its abort is on the way
            pass


class EngineThread:
    """The one thread that runs torch in a server: it builds the engine, then runs the engine loop.

    Why one thread: PyTorch's OpenMP team belongs to the thread that first runs a parallel op. When the main thread
    loads the model (creating its team) and another thread then steps the engine, every step of the second
    thread's team is ~1.6x slower on this 2-core machine (decode step 26 ms offline vs 43 ms; measured with the
    same engine, main thread vs a second thread). Building and stepping in the same thread avoids it."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            fn, fut = task
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(exc)

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        self._tasks.put((fn, fut))
        return fut

    def call(self, fn: Callable[[], Any]) -> Any:
        return self.submit(fn).result()

    def stop(self, timeout: float = 10.0) -> None:
        """End the thread once the tasks queued before this ran (an unloaded model's thread does not linger)."""
        self._tasks.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)


class StepTurns:
    """Several models in one server take turns at stepping: one engine step runs at a time, granted in arrival
    order (a ticket lock), so k busy models get about 1/k of the steps each and every step has all the CPU threads
    (engines stepping at once would oversubscribe the cores: OpenMP teams spin against each other). An idle model
    takes no turns. Each step is bounded by its engine's token budget (max_num_batched_tokens, max_step_ms)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next_ticket = 0
        self._serving = 0

    def __enter__(self) -> None:
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            while ticket != self._serving:
                self._cond.wait()

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: Metrics | None = None,
                 max_waiting_requests: int | None = None, engine_thread: EngineThread | None = None,
                 step_turns: StepTurns | None = None) -> None:
        self.engine = engine
        self.step_turns = step_turns  # several models: steps take turns across the server
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self._cmds: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()  # guards _streams between the event loop and the engine thread
        self._stop = threading.Event()
        self._engine_thread = engine_thread  # the thread that built the engine runs its loop too
        self._loop_done: Future[Any] | None = None
        self._thread = threading.Thread(target=self._loop, name="pdserve-engine", daemon=True)
        self.dead: BaseException | None = None
        self.draining = False  # set at SIGTERM: /health answers 503 (requests are still served during the grace)
        self.closed = False  # set when the grace ran out: new requests are refused
        self._kv_snapshot = KVSnapshot.of(engine)  # replaced whole (one reference store) by the engine thread
        if engine.kv_transfer is not None:  # PD roles: KV pulls landing and pins released wake the engine loop
            engine.kv_transfer.wakeup = self._wake.set
        # per-request explanations (GET /debug/requests/{id}, the log line's `explain`), made as requests finish
        self.explainer = RequestExplainer(engine.step_log)
        self.explanations = ExplanationHistory()
        # profiler by phase (/start_profile, /stop_profile): the profiler lives on the engine thread
        self.profiler_dir: str | None = None
        self.tracer: RequestTracer | None = None  # OpenTelemetry (--otlp-traces-endpoint), set by the app
        self._profiler: PhaseProfiler | None = None
        self._profile_done: Future[ProfileResult] | None = None  # set while a profile is open

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._engine_thread is not None:
            self._loop_done = self._engine_thread.submit(self._loop)
        else:
            self._thread.start()

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
        self.engine.close()
        if self.tracer is not None:
            self.tracer.shutdown()

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def kv_snapshot(self) -> KVSnapshot:
        """The latest published KV state; safe to read from any thread."""
        return self._kv_snapshot

    # ---- requests ------------------------------------------------------------------------------------------
    def add_requests(self, requests: list[Request],
                     on_finished: Callable[[Request], None] | None = None) -> list[RequestStream]:
        """Admit an API request's children all or none (raises QueueFull, EngineDead or ShuttingDown before any is
        added), then hand them to the engine. Call on the event loop; read each returned stream with `stream`.
        `on_finished` runs on the engine thread when a child finishes, however it ends."""
        if self.dead is not None:
            raise EngineDead(f"engine loop died: {self.dead!r}")
        if self.closed:
            raise ShuttingDown("the server is shutting down")
        loop = asyncio.get_running_loop()
        with self._lock:
            waiting = sum(1 for s in self._streams.values() if s.request.times.first_scheduled is None)
            if self.max_waiting_requests is not None and waiting + len(requests) > self.max_waiting_requests:
                raise QueueFull(f"too many waiting requests ({self.max_waiting_requests}); retry later")
            if dup := [r.request_id for r in requests if r.request_id in self._streams]:
                raise ValueError(f"duplicate request id {dup[0]!r}")
            streams = [RequestStream(loop, asyncio.Queue(), r, on_finished) for r in requests]
            for st in streams:
                self._streams[st.request.request_id] = st
        for r in requests:
            self._cmds.put(("add", r))
        self._wake.set()
        return streams

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
                self.abort(stream.request.request_id)

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
            self.abort(s.request.request_id)

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))
        self._wake.set()

    # ---- engine thread -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if not eng.has_unfinished_requests():
                    if eng.kv_transfer is not None:
                        eng.kv_transfer.poll_pins()  # free released / expired KV pins while idle
                    self._observe(StepStats(StepKind.IDLE, 0, 0, 0, 0.0))
                    self._kv_snapshot = KVSnapshot.of(eng)
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                result = self._step(eng)
                if self._profiler is not None and self._profiler.done:
                    self._finish_profile()
                self._observe(result.stats)
                # published before the outputs: a client that saw its request finish reads a state this new
                self._kv_snapshot = KVSnapshot.of(eng)
                for out in result.outputs:
                    self._dispatch(out)
        except BaseException as exc:  # a bug in the engine: fail every open request, refuse new ones
            logger.exception("engine loop died")
            self.dead = exc
            with self._lock:
                streams = list(self._streams.values())
                self._streams.clear()
            for s in streams:
                s.deliver(EngineDead(f"engine loop died: {exc!r}"))

    def _drain_commands(self) -> None:
        eng = self.engine
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
            else:
                assert isinstance(arg, str)
                for out in eng.abort_request(arg):
                    self._dispatch(out)
                with self._lock:
                    self._streams.pop(arg, None)

    def _dispatch(self, out: RequestOutput) -> None:
        with self._lock:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
        if stream is not None and out.finished:
            self._explain(stream.request)
        if stream is not None and out.finished and stream.on_finished is not None:
            try:
                stream.on_finished(stream.request)
            except Exception:  # a logging callback never takes the engine loop down
                logger.exception("on_finished callback failed")
        if self.metrics is not None and stream is not None:
            req = stream.request
            if out.outputs[0].delta_token_ids:
                self.metrics.observe_token(req, len(out.outputs[0].delta_token_ids))
            if out.finished:
                self.metrics.observe_finished(req)
        if stream is not None:
            stream.deliver(out)

    def _step(self, eng: LLMEngine) -> StepResult:
        """One engine step: under the server's step turns when several models share it, profiled when asked."""
        if self.step_turns is None:
            return eng.step() if self._profiler is None else self._profiler.step(eng.step)
        with self.step_turns:
            return eng.step() if self._profiler is None else self._profiler.step(eng.step)

    def _observe(self, stats: StepStats) -> None:
        """Record a step (an idle one records nothing but refreshes the gauges, which aborts change)."""
        eng, m = self.engine, self.metrics
        if m is None:
            return
        bm = eng.block_manager
        m.observe_step(stats, eng.scheduler.num_running, eng.scheduler.num_waiting, bm.usage,
                       bm.stats.queries, bm.stats.hits, eng.scheduler.num_preemptions)
        if eng.spec is not None:
            m.observe_spec(eng.spec.stats)

    def _explain(self, req: Request) -> None:
        """Keep a finished request's explanation (engine thread; never takes the loop down)."""
        try:
            self.explanations.add(req.request_id, {"request_id": req.request_id, "parent_id": req.parent_id,
                                                   "finish_reason": req.status.finish_reason,
                                                   **self.explainer.explain(req)})
        except Exception:
            logger.exception("explaining request %s failed", req.request_id)

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
            self._profiler = PhaseProfiler(num_steps, self.profiler_dir, self.engine.roofline.device,
                                           self.engine.config.torch_dtype)
        except Exception as exc:  # e.g. a bad step count: the waiting /stop_profile gets it
            self._profile_done.set_exception(exc)

    def _finish_profile(self) -> None:
        prof, done = self._profiler, self._profile_done
        self._profiler = None
        if prof is None or done is None or done.done():
            return
        try:
            done.set_result(prof.stop())
        except Exception as exc:
            logger.exception("profiler stop failed")
            done.set_exception(exc)

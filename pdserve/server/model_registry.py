"""The models one server serves, and their lifecycle: load, unload, sleep, wake, aliases with switch, rollback and
a canary share.

Each served model has its own LLMEngine (weights, KV pool), engine thread, EngineClient, Metrics and serving
objects. Requests route by the body's `model` (an alias resolves to its target; with a canary, to the canary model
with probability `share`); no `model`: the default (the first loaded). A request holds a lease on its model from
routing until it is admitted to the engine; unload and sleep wait until no lease and no admitted request is left
(in-flight requests finish on the version they started on), and new ones are already refused (404
model_not_found, 503 model_sleeping). Aliases move in one step under the registry lock, so a switch drops nothing:
each request is routed once, to the old or the new target. A model that fails to load leaves every alias as it was.

Sleep frees what unload frees (KV pool, weights, threads) but keeps the entry and its config; wake loads it again.
After a load and after a teardown the registry runs gc and glibc's malloc_trim, and `pdserve serve` fixes glibc's
mmap threshold (tune_allocator), so the process's RSS comes back near its level before the load
(tests/test_lifecycle.py and benchmarks/lifecycle.py measure it).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pdserve.api.errors import APIError
from pdserve.config import EngineConfig
from pdserve.engine.client import EngineClient, EngineThread, LLMEngine, StepTurns
from pdserve.kernels import kernels_description, kernels_isa
from pdserve.server.allocator import release_memory
from pdserve.server.audit import AuditEntry, AuditLog
from pdserve.server.metrics import Metrics
from pdserve.server.model_spec import ModelSpec, config_hash, effective_options
from pdserve.server.serving import ServingOptions
from pdserve.server.serving_chat import OpenAIServingChat
from pdserve.server.serving_completion import OpenAIServingCompletion
from pdserve.server.serving_embedding import OpenAIServingEmbedding
from pdserve.server.serving_tokenization import OpenAIServingTokenization
from pdserve.server.tenants import TenantMetrics
from pdserve.server.tracing import RequestTracer

logger = logging.getLogger("pdserve.server")

STATES = ("loading", "loaded", "sleeping", "failed", "unloaded")
DRAIN_TIMEOUT_S = 600.0  # unload/sleep: how long in-flight requests may run before they are aborted


@dataclass
class ServedModel:
    """One model: its spec and effective config (fixed), its state, and while loaded its engine and serving objects.
    `client`, `metrics` and the serving objects are None unless the state is loaded."""

    spec: ModelSpec
    config: EngineConfig
    config_hash: str
    state: str = "loading"
    progress: float = 0.0  # while loading: 0 queued, 0.1 building the engine, 1 ready
    error: str | None = None
    error_is_input: bool = False  # the load failed on what was asked (missing path, bad option): a 400, not a 500
    created: int = field(default_factory=lambda: int(time.time()))
    load_s: float | None = None
    max_model_len: int | None = None
    kernels: str | None = None  # "native (avx2)" | "torch"
    client: EngineClient | None = None
    metrics: Metrics | None = None
    engine_thread: EngineThread | None = None
    tracer: RequestTracer | None = None  # OpenTelemetry, when --otlp-traces-endpoint is set
    serving_completion: Any = None
    serving_chat: Any = None
    serving_tokenization: Any = None
    serving_embedding: Any = None
    leases: int = 0  # API requests routed here and not yet admitted (or answered)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def version(self) -> str | None:
        return self.spec.version

    @property
    def version_tag(self) -> str:
        """NAME@VERSION, the `x-pdserve-model-version` header (`none` when the model has no version label)."""
        return f"{self.name}@{self.version or 'none'}"

    @property
    def options(self) -> dict[str, Any]:
        return effective_options(self.config)


@dataclass
class Alias:
    model: str
    previous: str | None = None
    canary: str | None = None
    share: float = 0.0

    def pick(self) -> str:
        return self.canary if self.canary is not None and random.random() < self.share else self.model


class ModelRegistry:
    """Per-model state the routes use: `get(name)`, `default()`, `lease(name)`; the admin API's operations."""

    def __init__(self, base: EngineConfig, serving_options: ServingOptions, max_waiting_requests: int | None,
                 audit: AuditLog | None = None, tenant_metrics: TenantMetrics | None = None,
                 configure: Callable[[EngineClient, str], RequestTracer | None] | None = None) -> None:
        self.base = base
        # the server's introspection options onto each model's EngineClient; returns the model's tracer, if any
        self.configure = configure
        self.serving_options = serving_options
        self.max_waiting_requests = max_waiting_requests
        self.audit = audit or AuditLog(None)
        self.tenant_metrics = tenant_metrics or TenantMetrics()
        self.step_turns = StepTurns()
        self._models: dict[str, ServedModel] = {}
        self._aliases: dict[str, Alias] = {}
        self._lock = threading.Lock()  # guards the two maps and leases (event loop and loader threads)
        self._started = False
        self.draining = False

    # ---- routing -------------------------------------------------------------------------------------------
    def get(self, name: str | None) -> ServedModel:
        """The loaded model a request for `name` goes to (alias resolved); 404 model_not_found, 503
        model_sleeping / model_loading / model_failed."""
        with self._lock:
            return self._route(name)

    def default(self) -> ServedModel:
        return self.get(None)

    @contextmanager
    def lease(self, name: str | None) -> Iterator[ServedModel]:
        """Route and hold the model until the block ends (the request is admitted or answered by then)."""
        with self._lock:
            served = self._route(name)
            served.leases += 1
        try:
            yield served
        finally:
            with self._lock:
                served.leases -= 1

    def _route(self, name: str | None) -> ServedModel:
        alias = self._aliases.get(name) if name is not None else None
        target = alias.pick() if alias is not None else name or self._default_name()
        served = self._models.get(target) if target is not None else None
        if served is None and name is not None:
            served = self._lora_owner(name)  # a LoRA adapter's name: its base model serves it
        if served is None or served.state == "unloaded":
            served_names = ", ".join(repr(n) for n, m in self._models.items() if m.state != "unloaded")
            raise APIError(404, f"model {name!r} does not exist; this server serves {served_names or 'no model'}",
                           param="model", code="model_not_found", kind="not_found")
        if served.state != "loaded":
            hint = {"sleeping": "wake it with POST /admin/models/{name}/wake",
                    "loading": f"it is loading ({served.progress:.0%})",
                    "failed": f"its load failed: {served.error}"}[served.state]
            raise APIError(503, f"model {served.name!r} is {served.state}; {hint.format(name=served.name)}",
                           "service_unavailable", param="model", code=f"model_{served.state}", kind="not_found")
        return served

    def lora_owner(self, name: str) -> ServedModel | None:
        """The loaded model serving the LoRA adapter `name`, if any."""
        with self._lock:
            return self._lora_owner(name)

    def _lora_owner(self, name: str) -> ServedModel | None:
        return next((m for m in self._models.values() if m.client is not None and m.state == "loaded"
                     and m.client.lora_request(name) is not None), None)

    def name_taken(self, name: str) -> bool:
        """`name` is a model's, an alias's or a LoRA adapter's (served names are one namespace)."""
        with self._lock:
            return name in self._models or name in self._aliases or self._lora_owner(name) is not None

    def _default_name(self) -> str | None:
        return next((n for n, m in self._models.items() if m.state == "loaded"),
                    next(iter(self._models), None))

    def models(self) -> list[ServedModel]:
        with self._lock:
            return [m for m in self._models.values() if m.state != "unloaded"]

    def aliases(self) -> dict[str, Alias]:
        with self._lock:
            return dict(self._aliases)

    def loaded(self) -> list[ServedModel]:
        return [m for m in self.models() if m.state == "loaded"]

    # ---- whole-server lifecycle (the app's lifespan, SIGTERM draining) -----------------------------------------
    def start(self) -> None:
        self._started = True
        for m in self.loaded():
            assert m.client is not None
            m.client.start()

    def shutdown(self) -> None:
        for m in self.models():
            self._teardown(m, "unloaded")

    @property
    def num_unfinished(self) -> int:
        return sum(m.client.num_unfinished for m in self.loaded() if m.client is not None)

    @property
    def dead(self) -> BaseException | None:
        return next((m.client.dead for m in self.loaded() if m.client is not None and m.client.dead), None)

    def set_draining(self) -> None:
        self.draining = True
        for m in self.loaded():
            if m.client is not None:
                m.client.draining = True

    def fail_all(self, reason: str) -> None:
        for m in self.loaded():
            if m.client is not None:
                m.client.fail_all(reason)

    # ---- building and tearing down -----------------------------------------------------------------------------
    def new_entry(self, spec: ModelSpec) -> ServedModel:
        """A ServedModel in state loading for `spec` (ValueError for options the engine rejects)."""
        cfg = spec.engine_config(self.base)
        return ServedModel(spec, cfg, config_hash(effective_options(cfg)))

    def add_engine(self, spec: ModelSpec, engine: LLMEngine, engine_thread: EngineThread | None = None) -> ServedModel:
        """Serve an engine built elsewhere (the single-model `create_app`, `pdserve serve` at start-up)."""
        served = ServedModel(spec, engine.config, config_hash(effective_options(engine.config)))
        with self._lock:
            if spec.name in self._models or spec.name in self._aliases:
                raise ValueError(f"model {spec.name!r} is already served")
            self._models[spec.name] = served
        self._attach(served, EngineClient(engine, None, self.max_waiting_requests, engine_thread, self.step_turns),
                     engine_thread)
        return served

    def build(self, served: ServedModel) -> None:
        """Build the engine on its own engine thread (blocking; a loader thread or start-up) and attach it."""
        from pdserve.roofline import resolve_device_peaks

        t0 = time.monotonic()
        cfg = served.config
        served.progress = 0.1
        thread = EngineThread()  # builds the engine and later runs its loop: one OpenMP team (engine_thread.py)

        def progress(fraction: float, stage: str) -> None:  # the weights' share of the load; /v1/models shows it
            served.progress = max(served.progress, 0.1 + 0.85 * fraction)

        try:
            client = EngineClient.build(cfg, thread, resolve_device_peaks(cfg.device_peaks, cfg.num_threads,
                                                                          cfg.device), progress,
                                        max_waiting_requests=self.max_waiting_requests, step_turns=self.step_turns)
        except BaseException:
            thread.stop()
            raise
        served.load_s = time.monotonic() - t0
        self._attach(served, client, thread)

    def _attach(self, served: ServedModel, client: EngineClient, thread: EngineThread | None) -> None:
        name, opts, info = served.name, self.serving_options, client.model_info
        metrics = Metrics(name)
        metrics.set_kernels(info.kernels, *kernels_isa(info.kernels))
        if (dev := info.device) is not None:
            metrics.set_peaks(info.peak_flops, dev.mem_bandwidth, dev)
        if info.kv_role != "both":  # PD disaggregation role: KV hand-off metrics
            from pdserve.kv_transfer.metrics import KVTransferMetrics

            kv_metrics = KVTransferMetrics(metrics.registry, name, lambda: client.kv_snapshot, metrics.live)
            client.observe_kv_transfer(kv_metrics.observe_load, kv_metrics.pin_timeouts.inc)
        client.stat_logger = metrics
        tracer = self.configure(client, name) if self.configure is not None else None
        client.draining = self.draining
        served.serving_completion = OpenAIServingCompletion(client, name, metrics, opts)
        served.serving_chat = OpenAIServingChat(client, name, metrics, opts)
        served.serving_tokenization = OpenAIServingTokenization(client, name, metrics, opts)
        served.serving_embedding = OpenAIServingEmbedding(client, name, metrics, opts)
        for s in (served.serving_completion, served.serving_chat, served.serving_tokenization,
                  served.serving_embedding):
            s.version, s.config_hash, s.tenant_metrics = served.version, served.config_hash, self.tenant_metrics
            s.tracer = tracer
        served.tracer = tracer
        served.client, served.metrics, served.engine_thread = client, metrics, thread
        served.max_model_len, served.kernels = info.max_model_len, kernels_description(info.kernels)
        if self._started:
            client.start()
        served.progress, served.state, served.error = 1.0, "loaded", None

    def _teardown(self, served: ServedModel, state: str) -> None:
        """Stop the engine loop and thread, drop every reference to the engine, give the memory back."""
        client, thread, tracer = served.client, served.engine_thread, served.tracer
        served.state = state
        served.client = served.metrics = served.engine_thread = served.tracer = None
        served.serving_completion = served.serving_chat = served.serving_tokenization = None
        served.serving_embedding = None
        if client is not None:
            if self._started:
                client.shutdown()
            else:
                client.close()
        if thread is not None:
            thread.stop()
        if tracer is not None:
            tracer.shutdown()
        del client, thread
        release_memory()

    async def drain(self, served: ServedModel, timeout: float = DRAIN_TIMEOUT_S) -> None:
        """Wait until no request holds or runs on the model (new ones are refused already by its state)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                busy = served.leases or (served.client is not None and served.client.num_unfinished)
            if not busy:
                return
            await asyncio.sleep(0.05)
        logger.warning("model %s: requests still running after %.0f s; aborting them", served.name, timeout)

    # ---- audit -------------------------------------------------------------------------------------------------
    def record(self, action: str, model: str, key: str | None, before: ServedModel | None,
               after: ServedModel | None, t0: float, error: str | None = None,
               detail: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.audit.append(AuditEntry(
            action, model, key, before.version if before else None, after.version if after else None,
            before.config_hash if before else None, after.config_hash if after else None,
            "error" if error else "ok", error, time.monotonic() - t0, detail))

    def refused(self, action: str, model: str, key: str | None, error: APIError,
                before: ServedModel | None = None) -> APIError:
        """Audit a refused admin call (one line, like every admin call) and return the error to raise."""
        self.record(action, model, key, before, None, time.monotonic(), f"{error.code or error.status}: {error}")
        return error

    @contextmanager
    def auditing_refusals(self, action: str, model: str, key: str | None) -> Iterator[None]:
        """An APIError raised in the block is audited (`refused`) on its way out."""
        try:
            yield
        except APIError as e:
            raise self.refused(action, model, key, e) from None

    # ---- operations (the admin API, start-up) -----------------------------------------------------------------
    def begin_load(self, spec: ModelSpec, key: str | None = None) -> tuple[ServedModel, ServedModel | None]:
        """Register `spec` as loading (409 when the name is taken by a model that is not unloaded, or by an alias);
        returns the new entry and the one it replaces. A refusal is audited."""
        with self.auditing_refusals("load", spec.name, key):
            return self._begin_load(spec)

    def _begin_load(self, spec: ModelSpec) -> tuple[ServedModel, ServedModel | None]:
        try:
            served = self.new_entry(spec)
        except (ValueError, TypeError) as e:
            raise APIError(400, f"model {spec.name!r}: {e}", param="options", code="invalid_model_spec") from e
        with self._lock:
            old = self._models.get(spec.name)
            if spec.name in self._aliases or self._lora_owner(spec.name) is not None:
                raise APIError(409, f"{spec.name!r} is an alias or a LoRA adapter", param="name", code="model_exists")
            if old is not None and old.state not in ("failed", "unloaded"):
                raise APIError(409, f"model {spec.name!r} is {old.state}; unload it first or choose another name",
                               param="name", code="model_exists")
            self._models.pop(spec.name, None)
            self._models[spec.name] = served  # (re)inserted last: listing order is load order
        return served, old

    def finish_load(self, served: ServedModel, old: ServedModel | None, action: str, key: str | None) -> None:
        """Build the engine (blocking) and audit the outcome. A failed load leaves nothing behind (the audit line
        and the load's answer hold the error); a failed wake leaves the entry `failed` (unload removes it)."""
        t0 = time.monotonic()
        try:
            self.build(served)
        except Exception as e:  # noqa: BLE001 - any load failure is the model's state, not the server's
            logger.exception("model %s: load failed", served.name)
            served.state, served.error = "failed", f"{type(e).__name__}: {e}"
            served.error_is_input = isinstance(e, (ValueError, OSError))
            if action == "load":
                with self._lock:
                    if self._models.get(served.name) is served:
                        del self._models[served.name]
            release_memory()
            self.record(action, served.name, key, old, served, t0, served.error)
            return
        release_memory()  # the load's transient buffers (file reads, fused blocks) go back to the OS
        logger.info("model %s (version %s, config %s) loaded in %.2f s", served.name, served.version,
                    served.config_hash, served.load_s or 0.0)
        self.record(action, served.name, key, old, served, t0)

    def load_in_background(self, spec: ModelSpec, key: str | None) -> tuple[ServedModel, threading.Thread]:
        served, old = self.begin_load(spec, key)
        thread = threading.Thread(target=self.finish_load, args=(served, old, "load", key),
                                  name=f"pdserve-load-{spec.name}", daemon=True)
        thread.start()
        return served, thread

    def _get_entry(self, name: str) -> ServedModel:
        with self._lock:
            served = self._models.get(name)
        if served is None or served.state == "unloaded":
            raise APIError(404, f"model {name!r} does not exist", param="model", code="model_not_found",
                           kind="not_found")
        return served

    def _check_unused(self, name: str) -> None:
        for alias, a in self.aliases().items():
            if name in (a.model, a.canary):
                raise APIError(409, f"alias {alias!r} routes to {name!r}; point it elsewhere first", param="model",
                               code="model_in_use")

    async def unload(self, name: str, key: str | None) -> dict[str, Any]:
        return await self._stop(name, key, "unload", "unloaded")

    async def sleep(self, name: str, key: str | None) -> dict[str, Any]:
        return await self._stop(name, key, "sleep", "sleeping")

    async def _stop(self, name: str, key: str | None, action: str, state: str) -> dict[str, Any]:
        t0 = time.monotonic()
        with self.auditing_refusals(action, name, key):
            served = self._get_entry(name)
            if action == "unload":
                self._check_unused(name)
            with self._lock:
                if served.state not in ("loaded", "failed", "sleeping") or \
                        action == "sleep" and served.state != "loaded":
                    raise APIError(409, f"model {name!r} is {served.state}; cannot {action} it", param="model",
                                   code="invalid_model_state")
                served.state = state  # from here new requests are refused; in-flight ones finish
        await self.drain(served)
        await asyncio.to_thread(self._teardown, served, state)
        if state == "unloaded":
            with self._lock:
                if self._models.get(name) is served:
                    del self._models[name]
        self.record(action, name, key, served, None, t0)
        return {"name": name, "state": state}

    async def wake(self, name: str, key: str | None) -> dict[str, Any]:
        with self.auditing_refusals("wake", name, key):
            served = self._get_entry(name)
            with self._lock:
                if served.state != "sleeping":
                    raise APIError(409, f"model {name!r} is {served.state}, not sleeping", param="model",
                                   code="invalid_model_state")
                served.state, served.progress = "loading", 0.0
        await asyncio.to_thread(self.finish_load, served, served, "wake", key)
        if served.state == "failed":
            raise APIError(500, f"model {name!r} failed to wake: {served.error}", "internal_error",
                           code="model_load_failed", kind="internal")
        return {"name": name, "state": served.state}

    def set_alias(self, alias: str, model: str, canary: dict[str, Any] | None, key: str | None,
                  action: str = "switch") -> dict[str, Any]:
        """Point `alias` at a loaded model (and optionally a canary share at another); one step under the lock."""
        t0 = time.monotonic()
        try:
            with self._lock:
                old = self._aliases.get(alias)
                target = self._alias_target(alias, model)
                canary_model = share = None
                if canary is not None:
                    canary_model, share = canary.get("model"), float(canary.get("share", 0.0))
                    if not 0.0 <= share <= 1.0:
                        raise APIError(400, "canary share must be in [0, 1]", param="canary.share")
                    self._alias_target(alias, str(canary_model))
                previous = old.model if old is not None else None
                self._aliases[alias] = Alias(model, previous, canary_model, share or 0.0)
        except APIError as e:
            self.record(action, alias, key, None, self._models.get(model), t0, e.message, {"target": model})
            raise
        before = self._models.get(previous) if previous is not None else None
        detail = {"previous": previous, "target": model, "canary": canary}
        rec = self.record(action, alias, key, before, target, t0, None, detail)
        logger.info("alias %s: %s -> %s (%s)", alias, previous, model, action)
        return {"alias": alias, "model": model, "previous": previous, "switch_s": rec["duration_s"]}

    def _alias_target(self, alias: str, model: str) -> ServedModel:
        """(Under the lock.) The loaded model an alias may point at."""
        if alias in self._models:
            raise APIError(409, f"{alias!r} is a model name, not an alias", param="alias", code="alias_is_model")
        target = self._models.get(model)
        if target is None or target.state == "unloaded":
            raise APIError(404, f"model {model!r} does not exist", param="model", code="model_not_found",
                           kind="not_found")
        if target.state != "loaded":
            raise APIError(409, f"model {model!r} is {target.state}" + (f": {target.error}" if target.error else ""),
                           param="model", code="model_not_loaded")
        return target

    def rollback(self, alias: str, key: str | None) -> dict[str, Any]:
        with self.auditing_refusals("rollback", alias, key):
            a = self.aliases().get(alias)
            if a is None:
                raise APIError(404, f"alias {alias!r} does not exist", param="alias", code="alias_not_found",
                               kind="not_found")
            if a.previous is None:
                raise APIError(409, f"alias {alias!r} has no previous target", param="alias",
                               code="no_previous_target")
        return self.set_alias(alias, a.previous, None, key, "rollback")  # audits itself

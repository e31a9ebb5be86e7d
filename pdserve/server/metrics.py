"""Prometheus metrics, split by phase, under vLLM's names with a `pdserve:` prefix and a `model_name` label.

Per-request histograms are derived from the request's timestamps when it finishes (queue, prefill, decode, TTFT,
E2E, TPOT) or as tokens arrive (ITL). TPOT is one number per request: (E2E - TTFT) / (output tokens - 1), the mean
decode pace. ITL is one sample per gap between two streamed tokens, so its tail shows decode stalls (a long prefill
chunk in the same step, a preemption) that a request's mean hides.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.metrics_core import Metric

from pdserve.engine.client import KVOffloadStats, LoRAStats, SchedulerStats, SpecDecodeStats, StepStats
from pdserve.outputs import RequestOutput
from pdserve.roofline import DeviceSpec
from pdserve.server.allocator import heap_in_use_bytes
from pdserve.server.stats import LiveStats

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
_STEP = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
LATENCY_BUCKETS, ITL_BUCKETS = _LATENCY, _ITL  # shared with the per-tenant metrics
_UTIL = (0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

PEAKS_INFO_LABELS = ("device", "source", "measured_at", "method", "threads", "load_avg", "cpu_share", "busy",
                     "probe")


def peaks_info_labels(device: DeviceSpec) -> tuple[str, ...]:
    """Label values of `pdserve:device_peaks_info`, in PEAKS_INFO_LABELS order ("" where unknown)."""
    p = device.provenance
    if p is None:
        return device.name, device.source, "", "", "", "", "", "false", ""
    return (device.name, p.source, p.measured_at, p.method, str(p.threads or ""),
            "" if p.load_avg is None else f"{p.load_avg:.2f}", "" if p.cpu_share is None else f"{p.cpu_share:.2f}",
            str(p.busy).lower(), p.probe)


ERROR_KINDS = ("bad_request", "context_length", "not_found", "unauthorized", "rate_limited", "payload_too_large",
               "internal", "engine")


class Metrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, m, lbl = self.registry, model_name, ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"pdserve:{name}", doc, lbl, buckets=buckets, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token (queue + prefill).", _LATENCY)
        self.itl = hist("inter_token_latency_seconds", "Gap between two consecutive output tokens.", _ITL)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Per request: (E2E - TTFT) / (output tokens - 1).", _ITL)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled (waiting).", _LATENCY)
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token (prefill).", _LATENCY)
        self.decode = hist("request_decode_time_seconds", "First token to finish (decode).", _LATENCY)
        self.prompt_hist = hist("request_prompt_tokens", "Prompt tokens per request.", _TOKENS)
        self.gen_hist = hist("request_generation_tokens", "Output tokens per request.", _TOKENS)
        self.iter_tokens = hist("iteration_tokens_total", "Tokens computed per engine step.", _TOKENS)
        self.step_time = Histogram("pdserve:engine_step_time_seconds", "Duration of one engine step by kind.",
                                   ["model_name", "step_kind"], buckets=_STEP, registry=r)
        # live roofline (see roofline.StepCostModel): work each step needed vs this machine's peaks, by step kind
        kind_lbl = ["model_name", "step_kind"]
        self.step_mfu = Histogram("pdserve:step_mfu", "Per step: model FLOPs / model time / peak FLOP/s.", kind_lbl,
                                  buckets=_UTIL, registry=r)
        self.step_mbu = Histogram("pdserve:step_mbu", "Per step: bytes (weights + KV read/written) / model time / "
                                  "memory bandwidth.", kind_lbl, buckets=_UTIL, registry=r)
        self.model_flops = Counter("pdserve:model_flops", "FLOPs the model steps needed (2 x weights x tokens + "
                                   "attention).", kind_lbl, registry=r)
        self.model_bytes = Counter("pdserve:model_bytes", "Bytes the model steps needed to move.", kind_lbl,
                                   registry=r)
        self.model_time = Counter("pdserve:model_time_seconds", "Time in the forward pass and sampling.", kind_lbl,
                                  registry=r)
        self.peak_flops = Gauge("pdserve:device_peak_flops", "Peak FLOP/s that MFU is measured against.", lbl,
                                registry=r)
        self.peak_bandwidth = Gauge("pdserve:device_peak_bandwidth_bytes", "Memory bandwidth (B/s) that MBU is "
                                    "measured against.", lbl, registry=r)
        self.peaks_info = Gauge("pdserve:device_peaks_info", "Where the peaks come from (value 1): source datasheet | "
                                "given | measured | cached, when and how they were measured, load average and CPU "
                                "share while measuring, busy (true: not cached), the start-up probe.",
                                ["model_name", *PEAKS_INFO_LABELS], registry=r)
        self.kernels_info = Gauge("pdserve:kernels_info", "Which kernels run the model (value 1): kernels native | "
                                  "torch; isa the instruction-set path the native kernels use (amx | avx512_bf16 | "
                                  "avx512 | avx2 | generic | none); cpu_isa the widest this CPU has.",
                                  ["model_name", "kernels", "isa", "cpu_isa"], registry=r)
        self.running = Gauge("pdserve:num_requests_running", "Requests in the running batch.", lbl, registry=r)
        self.waiting = Gauge("pdserve:num_requests_waiting", "Requests waiting (incl. preempted).", lbl, registry=r)
        self.kv_usage = Gauge("pdserve:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", lbl, registry=r)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens of finished requests.", lbl, registry=r)
        self.gen_tokens = Counter("pdserve:generation_tokens", "Generated tokens.", lbl, registry=r)
        self.prefix_queries = Counter("pdserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      lbl, registry=r)
        self.prefix_hits = Counter("pdserve:prefix_cache_hits", "Prompt tokens found in the prefix cache.", lbl,
                                   registry=r)
        self._kv_counters(lbl, r)
        self._spec_counters(lbl, r)
        self._last_spec = SpecDecodeStats()
        self._offload_metrics(r)
        self._last_offload = KVOffloadStats()
        self.success = Counter("pdserve:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=r)
        self.errors = Counter("pdserve:request_errors", "Failed requests by kind.", ["model_name", "kind"],
                              registry=r)
        self.model_name, self.live = m, LiveStats(m)  # live: the same events, windowed, for GET /v1/stats
        for kind in ERROR_KINDS:
            self.errors.labels(m, kind)
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(m, reason)
        self._children = {name: getattr(self, name).labels(m) for name in (
            "ttft", "itl", "tpot", "e2e", "queue", "prefill", "decode", "prompt_hist", "gen_hist", "iter_tokens",
            "running", "waiting", "kv_usage", "prompt_tokens", "gen_tokens", "prefix_queries", "prefix_hits",
            "preemptions", "window_freed", "inflight_waits", "spec_drafts", "spec_draft_tokens",
            "spec_accepted_tokens")}
        self._last_prefix = (0, 0)
        self._last_preemptions = self._last_window_freed = self._last_inflight_waits = 0
        self.lora_info = Gauge("pdserve:lora_requests_info", "LoRA adapters of the running and of the waiting "
                               "requests (comma-separated names; value: when they last changed, Unix seconds), as "
                               "vLLM's lora_requests_info.", ["model_name", "running_lora_adapters",
                                                              "waiting_lora_adapters", "max_lora"], registry=r)
        self._last_lora: LoRAStats | None = None

    def observe_step(self, step: StepStats, sched: SchedulerStats) -> None:
        """A step (or an idle tick: only the gauges) and the scheduler's state after it (EngineClient's
        StatLogger)."""
        c = self._children
        num_running, num_waiting, kv_usage = sched.num_running, sched.num_waiting, sched.kv_usage
        prefix_queries, prefix_hits = sched.prefix_cache_queries, sched.prefix_cache_hits
        num_preemptions = sched.num_preemptions
        if step.kind != "idle":
            m, k = self.model_name, step.kind
            self.step_time.labels(m, k).observe(step.duration)
            c["iter_tokens"].observe(step.num_prefill_tokens + step.num_decode_tokens)
            self.model_flops.labels(m, k).inc(step.flops)
            self.model_bytes.labels(m, k).inc(step.bytes)
            self.model_time.labels(m, k).inc(step.model_time)
            if step.mfu or step.mbu:
                self.step_mfu.labels(m, k).observe(step.mfu)
                self.step_mbu.labels(m, k).observe(step.mbu)
        c["running"].set(num_running)
        c["waiting"].set(num_waiting)
        c["kv_usage"].set(kv_usage)
        q0, h0 = self._last_prefix
        c["prefix_queries"].inc(prefix_queries - q0)
        c["prefix_hits"].inc(prefix_hits - h0)
        self._last_prefix = (prefix_queries, prefix_hits)
        c["preemptions"].inc(num_preemptions - self._last_preemptions)
        self._last_preemptions = num_preemptions
        c["window_freed"].inc(sched.kv_window_freed_blocks - self._last_window_freed)
        self._last_window_freed = sched.kv_window_freed_blocks
        c["inflight_waits"].inc(sched.prefix_inflight_waits - self._last_inflight_waits)
        self._last_inflight_waits = sched.prefix_inflight_waits
        self.live.record_step(step, num_running, num_waiting, kv_usage, prefix_queries, prefix_hits,
                              num_preemptions, sched.offload)
        if sched.spec is not None:
            self.observe_spec(sched.spec)
        if sched.offload is not None:
            self.observe_offload(sched.offload)
        if sched.lora is not None and sched.lora != self._last_lora:
            self._last_lora = lora = sched.lora
            self.lora_info.clear()  # one series: the current adapters (vLLM's lora_requests_info), set to now
            self.lora_info.labels(self.model_name, ",".join(lora.running), ",".join(lora.waiting),
                                  str(lora.max_loras)).set(time.time())

    def _kv_counters(self, lbl: list[str], r: CollectorRegistry) -> None:
        self.preemptions = Counter("pdserve:num_preemptions", "Preemptions (recompute).", lbl, registry=r)
        self.window_freed = Counter("pdserve:kv_window_freed_blocks", "KV blocks of sliding-window layer groups "
                                    "returned to the pool because they fell out of the window of every query still "
                                    "to come (models with sliding windows; 0 with one block table).", lbl,
                                    registry=r)
        self.inflight_waits = Counter("pdserve:prefix_cache_inflight_waits", "Requests held in the queue while "
                                      "another request computed the prompt blocks they share (they hit those "
                                      "blocks instead of computing them again).", lbl, registry=r)

    def _spec_counters(self, lbl: list[str], r: CollectorRegistry) -> None:
        # speculative decoding, vLLM's names (fed from the engine's SpecDecodeStats; zero while it is off)
        self.spec_drafts = Counter("pdserve:spec_decode_num_drafts", "Decode rows that carried draft tokens.", lbl,
                                   registry=r)
        self.spec_draft_tokens = Counter("pdserve:spec_decode_num_draft_tokens", "Draft tokens proposed and "
                                         "verified.", lbl, registry=r)
        self.spec_accepted_tokens = Counter("pdserve:spec_decode_num_accepted_tokens", "Draft tokens accepted.", lbl,
                                            registry=r)
        self.spec_accepted_per_pos = Counter("pdserve:spec_decode_num_accepted_tokens_per_pos", "Draft tokens "
                                             "accepted, by position in the draft (0: first).",
                                             ["model_name", "position"], registry=r)
        self.spec_disabled_steps = Counter("pdserve:spec_decode_disabled_steps", "Steps with decoding requests but "
                                           "no drafts, by the policy's reason (batch_size, compute_bound, "
                                           "low_acceptance, prefill_pending, measured_slower).",
                                           ["model_name", "reason"], registry=r)

    def _offload_metrics(self, r: CollectorRegistry) -> None:
        # the prefix cache's disk tier (--kv-offload-dir); memory hits are pdserve:prefix_cache_hits
        lbl = ["model_name", "direction"]
        self.offload_blocks = Counter("pdserve:kv_offload_blocks", "KV blocks the disk tier wrote (direction=saved) "
                                      "and read back (loaded).", lbl, registry=r)
        self.offload_bytes = Counter("pdserve:kv_offload_bytes", "K/V bytes the disk tier wrote (saved) and read "
                                     "back (loaded).", lbl, registry=r)
        self.offload_lookups = Counter("pdserve:kv_offload_lookups", "Prefix blocks looked up on disk after a "
                                       "memory miss.", ["model_name"], registry=r)
        self.offload_hits = Counter("pdserve:kv_offload_hits", "Of those, found on disk and read back.",
                                    ["model_name"], registry=r)
        self.offload_files = Counter("pdserve:kv_offload_files_removed", "Disk-tier files removed: failed a check "
                                     "(reason=rejected) or over the size bound (evicted).", ["model_name", "reason"],
                                     registry=r)
        self.offload_disk = Gauge("pdserve:kv_offload_disk_bytes", "Bytes of the disk tier's files for this model.",
                                  ["model_name"], registry=r)

    def observe_offload(self, stats: KVOffloadStats) -> None:
        """Bring the kv_offload counters up to the engine's totals."""
        m, last = self.model_name, self._last_offload
        self.offload_blocks.labels(m, "saved").inc(stats.blocks_saved - last.blocks_saved)
        self.offload_blocks.labels(m, "loaded").inc(stats.blocks_loaded - last.blocks_loaded)
        self.offload_bytes.labels(m, "saved").inc(stats.bytes_saved - last.bytes_saved)
        self.offload_bytes.labels(m, "loaded").inc(stats.bytes_loaded - last.bytes_loaded)
        self.offload_lookups.labels(m).inc(stats.lookups - last.lookups)
        self.offload_hits.labels(m).inc(stats.hits - last.hits)
        self.offload_files.labels(m, "rejected").inc(stats.rejected - last.rejected)
        self.offload_files.labels(m, "evicted").inc(stats.evicted - last.evicted)
        self.offload_disk.labels(m).set(stats.disk_bytes)
        self._last_offload = dataclasses.replace(stats)

    def observe_spec(self, stats: SpecDecodeStats) -> None:
        """Bring the spec_decode counters up to the engine's totals."""
        c, last = self._children, self._last_spec
        c["spec_drafts"].inc(stats.num_drafts - last.num_drafts)
        c["spec_draft_tokens"].inc(stats.num_draft_tokens - last.num_draft_tokens)
        c["spec_accepted_tokens"].inc(stats.num_accepted_tokens - last.num_accepted_tokens)
        for pos, n in enumerate(stats.accepted_per_pos):
            before = last.accepted_per_pos[pos] if pos < len(last.accepted_per_pos) else 0
            self.spec_accepted_per_pos.labels(self.model_name, str(pos)).inc(n - before)
        for reason, n in stats.disabled_steps.items():
            self.spec_disabled_steps.labels(self.model_name, reason).inc(n - last.disabled_steps.get(reason, 0))
        self._last_spec = SpecDecodeStats(stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                                          list(stats.accepted_per_pos), dict(stats.disabled_steps))

    def set_peaks(self, peak_flops: float, bandwidth: float, device: DeviceSpec | None = None) -> None:
        """The peaks MFU/MBU are measured against; with `device`, also its provenance as info labels."""
        self.peak_flops.labels(self.model_name).set(peak_flops)
        self.peak_bandwidth.labels(self.model_name).set(bandwidth)
        if device is not None:
            self.live.set_peaks(device, peak_flops)
            self.peaks_info.clear()
            self.peaks_info.labels(self.model_name, *peaks_info_labels(device)).set(1)

    def set_kernels(self, kernels: str, isa: str, cpu_isa: str) -> None:
        self.kernels_info.clear()
        self.kernels_info.labels(self.model_name, kernels, isa, cpu_isa).set(1)

    def observe_output(self, out: RequestOutput) -> None:
        """A request's output (EngineClient's StatLogger): its new tokens, and its end once it finished."""
        if n := len(out.outputs[0].delta_token_ids):
            self.observe_token(out, n)
        if out.finished:
            self.observe_finished(out)

    def observe_token(self, out: RequestOutput, num_tokens: int = 1) -> None:
        """An output that delivered `num_tokens` new tokens (several: a speculating step's accepted drafts and
        bonus). ITL is one sample per delivery, as vLLM: the gap since the previous one."""
        c = self._children
        c["gen_tokens"].inc(num_tokens)
        t = out.metrics.token_times
        if len(t) > num_tokens:
            c["itl"].observe(t[-1] - t[-1 - num_tokens])
            self.live.record_itl(t[-1] - t[-1 - num_tokens])

    def observe_finished(self, out: RequestOutput) -> None:
        c, t = self._children, out.metrics
        reason = out.outputs[0].finish_reason or "error"
        num_prompt = len(out.prompt_token_ids)
        self.success.labels(self.model_name, reason).inc()
        c["prompt_tokens"].inc(num_prompt)
        c["prompt_hist"].observe(num_prompt)
        c["gen_hist"].observe(len(out.outputs[0].token_ids))
        for name, value in (("ttft", t.ttft), ("e2e", t.e2e), ("queue", t.queue_time), ("prefill", t.prefill_time),
                            ("decode", t.decode_time), ("tpot", t.tpot)):
            if value is not None:
                c[name].observe(value)
        self.live.record_finished(out)

    def error(self, kind: str) -> None:
        self.errors.labels(self.model_name, kind).inc()
        self.live.record_error(kind)


class MergedCollector:
    """The families of several registries (one per served model, plus the per-tenant one) as one exposition: a
    family that several registries have (every model's `pdserve:time_to_first_token_seconds`) is written once, with
    every registry's samples (they differ by the model_name label)."""

    def __init__(self, registries: Callable[[], list[CollectorRegistry]]) -> None:
        self.registries = registries

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for reg in self.registries():
            for fam in reg.collect():
                if fam.name in families:
                    families[fam.name].samples.extend(fam.samples)
                else:
                    families[fam.name] = fam
        yield from families.values()


def merged_registry(registries: Callable[[], list[CollectorRegistry]]) -> CollectorRegistry:
    """A registry to expose (generate_latest) that reads `registries()` at each scrape."""
    merged = CollectorRegistry(auto_describe=False)
    merged.register(MergedCollector(registries))  # type: ignore[arg-type]
    # the process's own figures (process_resident_memory_bytes, CPU, fds): memory after an unload is evidence
    merged.register(ProcessCollector(registry=None))
    if heap_in_use_bytes() is not None:  # glibc: what is allocated, apart from free memory the arenas keep
        Gauge("pdserve:process_heap_in_use_bytes", "bytes the C allocator has handed out and not freed (glibc "
              "mallinfo2, every arena and mmapped block); unlike RSS, free memory kept by the allocator is not "
              "counted", registry=merged).set_function(lambda: heap_in_use_bytes() or 0)
    return merged

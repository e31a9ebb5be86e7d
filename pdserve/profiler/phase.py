"""PhaseProfiler: torch.profiler around N engine steps, each in a `pdserve.step` frame, then the report.

Start, step and stop on the engine's thread (the server's EngineThread; the offline CLI's main thread): the
profiler then records the thread that runs torch. Memory is bounded by MAX_PROFILE_STEPS and the profile's time by
ProfilerLimits.max_duration_s; the trace directory by its file and byte caps (traces.py). The recorded events are
dropped at stop: what they took is then free memory, which the server hands back to the OS (EngineClient's
after_profile hook, allocator.release_memory) — measured, the heap in use after a stop is back within a few MB of
before the first profile; without the trim RSS stays ~150 MB higher.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from pdserve.profiler.report import STEP_FRAME, build_report, format_table
from pdserve.profiler.traces import ProfilerLimits, new_trace_path, rotate_traces
from pdserve.roofline import DeviceSpec

logger = logging.getLogger("pdserve.profiler")

MAX_PROFILE_STEPS = 2000  # the most steps one profile holds (events are kept in memory until stop)


@dataclass
class ProfileResult:
    report: dict[str, Any]  # build_report's JSON
    table: str  # the Markdown table
    trace_path: str | None  # Chrome trace JSON (opens in Perfetto / chrome://tracing); None: over the byte cap

    def as_dict(self) -> dict[str, Any]:
        return {**self.report, "table": self.table, "trace_path": self.trace_path}


class PhaseProfiler:
    """Profiles the next `num_steps` non-idle steps (None: until stopped, at most MAX_PROFILE_STEPS), for at most
    `limits.max_duration_s` seconds of `clock`."""

    def __init__(self, num_steps: int | None, out_dir: str | None, device: DeviceSpec | None,
                 dtype: torch.dtype, limits: ProfilerLimits | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if num_steps is not None and not 1 <= num_steps <= MAX_PROFILE_STEPS:
            raise ValueError(f"num_steps must be in [1, {MAX_PROFILE_STEPS}]")
        self.num_steps = num_steps or MAX_PROFILE_STEPS
        self.out_dir = out_dir or tempfile.mkdtemp(prefix="pdserve-profile-")
        self.device, self.dtype = device, dtype
        self.stats: list[Any] = []  # StepStats of the profiled non-idle steps, in order
        self.kinds: list[str] = []  # the kind of every `pdserve.step` frame, idle ones included
        self.limits = limits or ProfilerLimits()
        self._clock = clock
        self._deadline = clock() + self.limits.max_duration_s
        self._prof: Any = profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True)
        self._prof.__enter__()

    @property
    def stop_reason(self) -> str | None:
        """Why the profile is over by itself ("num_steps", "max_duration"), or None while it runs."""
        if len(self.stats) >= self.num_steps:
            return "num_steps"
        return "max_duration" if self._clock() >= self._deadline else None

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def step(self, run: Callable[[], Any]) -> Any:
        """Run one engine step (`run` returns a StepResult) in a `pdserve.step` frame; idle steps are not kept."""
        with record_function(STEP_FRAME):
            result = run()
        self.kinds.append(result.stats.kind.value)
        if result.stats.kind.value != "idle":
            self.stats.append(result.stats)
        return result

    def stop(self) -> ProfileResult:
        """End profiling, write the trace (rotating the directory's), build the report (seconds for a long
        profile), and drop the recorded events."""
        reason = self.stop_reason or "stop_profile"
        prof, self._prof = self._prof, None  # the events go with it: nothing of them outlives this call
        prof.__exit__(None, None, None)
        os.makedirs(self.out_dir, exist_ok=True)
        path: str | None = new_trace_path(self.out_dir)
        prof.export_chrome_trace(path)
        if not rotate_traces(self.out_dir, str(path), self.limits):
            logger.warning("profile trace %s is over --profiler-max-trace-bytes by itself: not kept", path)
            path = None
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        report = build_report(list(prof.events()), self.kinds, self.stats, self.device, self.dtype, itemsize)
        del prof
        report["trace_path"], report["stop_reason"] = path, reason
        logger.info("profile of %d steps (%s) written to %s", len(self.stats), reason, path)
        return ProfileResult(report, format_table(report), path)

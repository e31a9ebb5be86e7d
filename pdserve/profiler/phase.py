"""PhaseProfiler: torch.profiler around N engine steps, each in a `pdserve.step` frame, then the report.

Start, step and stop on the engine's thread (the server's EngineThread; the offline CLI's main thread): the
profiler then records the thread that runs torch. Memory is bounded by `max_steps`.
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
from pdserve.roofline import DeviceSpec

logger = logging.getLogger("pdserve.profiler")

MAX_PROFILE_STEPS = 2000  # the most steps one profile holds (events are kept in memory until stop)


@dataclass
class ProfileResult:
    report: dict[str, Any]  # build_report's JSON
    table: str  # the Markdown table
    trace_path: str  # Chrome trace JSON (opens in Perfetto / chrome://tracing)

    def as_dict(self) -> dict[str, Any]:
        return {**self.report, "table": self.table, "trace_path": self.trace_path}


class PhaseProfiler:
    """Profiles the next `num_steps` non-idle steps (None: until stopped, at most MAX_PROFILE_STEPS)."""

    def __init__(self, num_steps: int | None, out_dir: str | None, device: DeviceSpec | None,
                 dtype: torch.dtype) -> None:
        if num_steps is not None and not 1 <= num_steps <= MAX_PROFILE_STEPS:
            raise ValueError(f"num_steps must be in [1, {MAX_PROFILE_STEPS}]")
        self.num_steps = num_steps or MAX_PROFILE_STEPS
        self.out_dir = out_dir or tempfile.mkdtemp(prefix="pdserve-profile-")
        self.device, self.dtype = device, dtype
        self.stats: list[Any] = []  # StepStats of the profiled non-idle steps, in order
        self.kinds: list[str] = []  # the kind of every `pdserve.step` frame, idle ones included
        self._prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True)
        self._prof.__enter__()

    @property
    def done(self) -> bool:
        return len(self.stats) >= self.num_steps

    def step(self, run: Callable[[], Any]) -> Any:
        """Run one engine step (`run` returns a StepResult) in a `pdserve.step` frame; idle steps are not kept."""
        with record_function(STEP_FRAME):
            result = run()
        self.kinds.append(result.stats.kind.value)
        if result.stats.kind.value != "idle":
            self.stats.append(result.stats)
        return result

    def stop(self) -> ProfileResult:
        """End profiling, write the trace, build the report (seconds for a long profile)."""
        self._prof.__exit__(None, None, None)
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f"pdserve-trace-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json")
        self._prof.export_chrome_trace(path)
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        report = build_report(list(self._prof.events()), self.kinds, self.stats, self.device, self.dtype, itemsize)
        report["trace_path"] = path
        logger.info("profile of %d steps written to %s", len(self.stats), path)
        return ProfileResult(report, format_table(report), path)

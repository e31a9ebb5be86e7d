"""The profiler's bounds: how long one profile may run, and how many trace files (and bytes) its directory keeps.

A trace is 6-15 MB per profile of a small model; a server profiled now and then would fill its disk. After each
trace is written the directory's traces (only files named `pdserve-trace-*.json`: nothing else there is touched)
are rotated, oldest first, until at most `max_traces` files of at most `max_bytes` in all are left. A new trace
larger than `max_bytes` by itself is not kept either (its report still comes back, with `trace_path` null).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("pdserve.profiler")

TRACE_PREFIX = "pdserve-trace-"


@dataclass(frozen=True)
class ProfilerLimits:
    max_duration_s: float = 300.0  # a profile stops by itself after this long (--profiler-max-duration)
    max_traces: int = 10  # trace files kept in the profiler directory (--profiler-max-traces)
    max_bytes: int = 512 * 2**20  # their total size (--profiler-max-trace-bytes)

    def __post_init__(self) -> None:
        if not (self.max_duration_s > 0 and self.max_traces >= 1 and self.max_bytes >= 1):
            raise ValueError("profiler limits must be positive (max_duration_s, max_traces, max_bytes)")


def new_trace_path(out_dir: str) -> str:
    """A fresh trace file name: time to the microsecond plus the pid (two profiles never share one)."""
    now = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + f"-{int(now * 1e6) % 10**6:06d}"
    return os.path.join(out_dir, f"{TRACE_PREFIX}{stamp}-{os.getpid()}.json")


def rotate_traces(out_dir: str, newest: str, limits: ProfilerLimits) -> bool:
    """Delete traces, oldest first, until the directory's traces fit `limits`; False when `newest` itself had to
    go (larger than max_bytes alone: then it is the only one removed)."""
    last = Path(newest).resolve()
    if last.stat().st_size > limits.max_bytes:
        last.unlink()
        return False
    traces = sorted((p for p in Path(out_dir).glob(f"{TRACE_PREFIX}*.json") if p.is_file() and p.resolve() != last),
                    key=lambda p: (p.stat().st_mtime_ns, p.name)) + [last]  # the new one last, whatever the clock
    sizes = {p: p.stat().st_size for p in traces}
    total = sum(sizes.values())
    while len(traces) > limits.max_traces or total > limits.max_bytes:
        old = traces.pop(0)
        total -= sizes[old]
        try:
            old.unlink()
        except FileNotFoundError:  # removed meanwhile
            pass
        logger.info("profiler: removed trace %s (keeping at most %d traces, %d bytes)", old, limits.max_traces,
                    limits.max_bytes)
    return True

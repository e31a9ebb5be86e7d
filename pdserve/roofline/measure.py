"""Measuring this machine: best torch.mm FLOP/s per dtype and large-copy bandwidth, each the best of several short
runs, and whether the machine was busy while measuring (then the figures are used but never cached).

Busy means either signal: the 1-minute load average before starting is high for the machine's cores, or the
measurement's threads got too little CPU (CPU time / (wall time x threads) low: other processes held the cores)."""

from __future__ import annotations

import functools
import math
import os
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import torch

from pdserve.roofline.devices import DeviceSpec, PeaksProvenance, cpu_name, memory_total, usable_cores

BUSY_CPU_SHARE = 0.75  # below: other processes took our cores during the measurement
BUSY_LOAD_PER_CORE = 0.75  # 1-minute load average per core above which the machine counts as busy
COPY_BYTES = 256 * 2**20  # well above a last-level cache, so the copy streams from memory


@dataclass
class _CpuClock:
    """CPU time and wall time spent inside timed calls only (allocation and warm-up are single-threaded and would
    make a quiet machine look busy)."""

    cpu_s: float = 0.0
    wall_s: float = 0.0

    def share(self, threads: int) -> float:
        return self.cpu_s / (self.wall_s * threads) if self.wall_s > 0 else 1.0


def _process_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # all threads of this process (torch's OpenMP team included)
    return r.ru_utime + r.ru_stime


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def is_busy(load_avg: float | None, cpu_share: float) -> bool:
    """The verdict on a measurement: see the module docstring."""
    loaded = load_avg is not None and load_avg > BUSY_LOAD_PER_CORE * (os.cpu_count() or 1)
    return loaded or cpu_share < BUSY_CPU_SHARE


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _best_time(fn: Callable[[], Any], repeats: int, budget_s: float, clock: _CpuClock | None = None,
               warm_up: bool = True) -> float:
    """Fastest of up to `repeats` timed calls (after one warm-up call); stops early once `budget_s` is spent."""
    if warm_up:
        fn()
    best, start = math.inf, time.perf_counter()
    for _ in range(max(1, repeats)):
        c0, t0 = _process_cpu_s(), time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
        best = min(best, wall)
        if clock is not None:
            clock.cpu_s += _process_cpu_s() - c0
            clock.wall_s += wall
        if time.perf_counter() - start > budget_s:
            break
    return best


def _matmul(dtype: torch.dtype, max_size: int, min_call_s: float) -> tuple[int, Callable[[], Any]]:
    """(n, one n x n product): the size doubles from 128 until one product takes `min_call_s` or reaches
    `max_size`, so an emulated dtype (bf16 without AVX-512 BF16: ~1 GFLOP/s) stays small and quick while a fast one
    gets a size large enough to approach its peak."""
    n = min(128, max_size)
    while True:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        c = torch.empty(n, n, dtype=dtype)
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        if n * 2 > max_size or time.perf_counter() - t0 >= min_call_s:
            return n, functools.partial(torch.mm, a, b, out=c)
        n *= 2


def _copy(nbytes: int) -> Callable[[], Any]:
    src = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def measure_matmul_flops(dtype: torch.dtype, max_size: int = 2048, repeats: int = 3, min_call_s: float = 0.1,
                         budget_s: float = 1.0) -> float:
    """Best torch.mm FLOP/s (2·n^3 per n x n product) in `dtype` with the current torch thread count."""
    n, fn = _matmul(dtype, max_size, min_call_s)
    return 2 * n**3 / _best_time(fn, repeats, budget_s)


def measure_copy_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 5, budget_s: float = 1.0) -> float:
    """Best `dst.copy_(src)` B/s, counting read + write (2 x nbytes, the STREAM "copy" convention; write-allocate
    traffic is not counted). `nbytes` should be well above the last-level cache."""
    n = max(1, nbytes // 4) * 4
    return 2 * n / _best_time(_copy(nbytes), repeats, budget_s)


def measure_device(threads: int | None = None, dtype: torch.dtype | None = None, *, matmul_size: int = 2048,
                   copy_bytes: int = COPY_BYTES, repeats: int = 3, runs: int = 3, budget_s: float = 1.0) -> DeviceSpec:
    """This machine as a DeviceSpec: peak = best torch.mm FLOP/s in `dtype` (None: float32 and bfloat16, the faster
    wins; both kept in `flops_by_dtype`), bandwidth = best large tensor copy, memory = MemTotal. Each figure is the
    best over `runs` interleaved runs of up to `repeats` calls (a burst of other work spoils only some of them);
    about `budget_s` seconds per figure. `threads` (default: every core this process may use) is set for the
    measurement and restored after. The provenance records when, how, and whether the machine was busy."""
    threads = threads or usable_cores()
    load_avg = load_average()
    clock = _CpuClock()
    with torch_threads(threads):
        dtypes = [dtype] if dtype is not None else [torch.float32, torch.bfloat16]
        kernels: list[tuple[str, float, Callable[[], Any]]] = []
        sizes = []
        for d in dtypes:
            n, fn = _matmul(d, matmul_size, min_call_s=0.1)
            kernels.append((str(d).removeprefix("torch."), 2.0 * n**3, fn))
            sizes.append(f"{str(d).removeprefix('torch.')} n={n}")
        kernels.append(("copy", 2.0 * (max(1, copy_bytes // 4) * 4), _copy(copy_bytes)))
        best = dict.fromkeys((name for name, _, _ in kernels), 0.0)
        for run in range(max(1, runs)):
            for name, work, fn in kernels:
                t = _best_time(fn, repeats, budget_s / max(1, runs), clock, warm_up=run == 0)
                best[name] = max(best[name], work / t)
    # rounded as recorded, and judged on the recorded figures (a reader recomputing the verdict gets the same one)
    share = round(clock.share(min(threads, usable_cores())), 3)
    load_avg = None if load_avg is None else round(load_avg, 2)
    by_dtype = tuple((name, best[name]) for name, _, _ in kernels if name != "copy")
    provenance = PeaksProvenance(
        "measured", datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        f"best of {runs} runs x {repeats} calls: torch.mm {', '.join(sizes)}; copy {copy_bytes / 2**20:.0f} MiB",
        threads, load_avg, share, is_busy(load_avg, share))
    return DeviceSpec(f"this machine ({cpu_name()}, {threads} threads)", max(f for _, f in by_dtype), best["copy"],
                      float(memory_total()), by_dtype, provenance)


def probe_device(threads: int, dtypes: Sequence[str], copy_bytes: int = COPY_BYTES,
                 budget_s: float = 0.2) -> tuple[dict[str, float], float]:
    """Quick figures to re-validate a cached measurement (a few tenths of a second): torch.mm per dtype at most
    1024 x 1024 and one copy of `copy_bytes` (the size the measurement used, so a cache-resident copy cannot beat
    it), best of two calls each. Smaller and shorter than a measurement, so on the same machine it reads at or below
    the full figures: beating a cached figure means that figure was taken under load."""
    with torch_threads(threads):
        flops = {name: measure_matmul_flops(getattr(torch, name), 1024, repeats=2, min_call_s=0.02,
                                            budget_s=budget_s) for name in dtypes}
        bandwidth = measure_copy_bandwidth(copy_bytes, repeats=2, budget_s=budget_s)
    return flops, bandwidth

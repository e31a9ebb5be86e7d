"""Serving benchmark: `pdserve bench` and its API.

    from pdserve.bench import BenchConfig, run_benchmark
    result = asyncio.run(run_benchmark(BenchConfig(base_url=..., num_prompts=32, max_concurrency=4)))
    result.summary()["p99_ttft_ms"]

Modules: config (BenchConfig), datasets (prompts), client (one streamed request), runner (schedule, warm-up,
/metrics), server_metrics (server-side deltas), report (metrics, result block, JSON), plots, cli.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.bench.cli import add_bench_parser, run_bench_cli
from pdserve.bench.config import BenchConfig, BenchError

if TYPE_CHECKING:
    from pdserve.bench.report import BenchResult
    from pdserve.bench.runner import run_benchmark

__all__ = ["BenchConfig", "BenchError", "BenchResult", "add_bench_parser", "run_bench_cli", "run_benchmark"]


def __getattr__(name: str) -> Any:
    """run_benchmark and BenchResult load httpx and numpy; import them only when asked for."""
    if name == "run_benchmark":
        from pdserve.bench.runner import run_benchmark

        return run_benchmark
    if name == "BenchResult":
        from pdserve.bench.report import BenchResult

        return BenchResult
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

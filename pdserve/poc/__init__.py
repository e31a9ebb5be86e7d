"""`pdserve poc`: the production-validation run against a live server, and its evidence report.

    from pdserve.poc import PocConfig, run_poc
    report = asyncio.run(run_poc(PocConfig(base_url=..., profile="quick", out_dir="poc")))
    report.passed, [c.status for c in report.checks]

Modules: config (PocConfig, profiles), target (the server: requests, KV state, admin API), check (CheckResult,
the run's request log, prompts), checks_basic (short, long context, streaming), checks_load (concurrency sweep,
tenants), checks_faults (interruption), checks_admin (switch + rollback, reclaim), evidence (owners.yaml, the
four-part table), report (report.md, report.json, plots), runner (run_poc), cli.
"""

from __future__ import annotations

from typing import Any

from pdserve.poc.cli import add_poc_parser
from pdserve.poc.config import CHECKS, PocConfig

__all__ = ["CHECKS", "CheckResult", "PocConfig", "PocReport", "add_poc_parser", "run_poc"]


def __getattr__(name: str) -> Any:
    """The run's modules load on first use: `pdserve serve` parses its command line without them."""
    if name == "run_poc":
        from pdserve.poc.runner import run_poc

        return run_poc
    if name == "PocReport":
        from pdserve.poc.report import PocReport

        return PocReport
    if name == "CheckResult":
        from pdserve.poc.check import CheckResult

        return CheckResult
    raise AttributeError(name)

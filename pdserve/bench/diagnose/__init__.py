"""`pdserve diagnose`: run three ablations against a server and say which phase limits it.

    from pdserve.bench.diagnose import DiagnoseConfig, diagnose
    result = asyncio.run(diagnose(DiagnoseConfig(base_url=..., scale=0.25)))
    result.verdict, result.knee_concurrency, result.findings

Modules: config (DiagnoseConfig), experiments (the prompt-shape, output-length and concurrency-sweep ablations and
`diagnose`), stats (RunStats: one run's numbers), rules (thresholds, knee detection, findings, the verdict; their
documentation), report (DiagnoseResult, report.md, plots, diagnose.json), cli.
"""

from __future__ import annotations

from pdserve.bench.diagnose.cli import add_diagnose_parser, config_from_args, run_diagnose_cli
from pdserve.bench.diagnose.config import EXPERIMENTS, DiagnoseConfig
from pdserve.bench.diagnose.experiments import diagnose
from pdserve.bench.diagnose.report import DiagnoseResult, write_report
from pdserve.bench.diagnose.rules import (
    Finding,
    Thresholds,
    Verdict,
    analyze,
    analyze_window,
    find_knee,
    knee_points,
)
from pdserve.bench.diagnose.stats import RunStats

__all__ = ["EXPERIMENTS", "DiagnoseConfig", "DiagnoseResult", "Finding", "RunStats", "Thresholds", "Verdict",
           "add_diagnose_parser", "analyze", "analyze_window", "config_from_args", "diagnose", "find_knee",
           "knee_points", "run_diagnose_cli", "write_report"]

"""Profiler by phase: torch.profiler over N engine steps, operators ranked per step kind against the roofs.

    phase   PhaseProfiler: wraps engine steps (in the engine's own thread), writes the Chrome/Perfetto trace
    report  per step kind: top operators by self time, FLOPs, bytes, achieved rates, the reading
    cli     `pdserve profile`: against a server (/start_profile, /stop_profile) or offline on a workload

The names below load on first use, so that the command line (which lists `profile` among its commands) does not
import torch for commands that never run a model (`pdserve router`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.profiler.phase import PhaseProfiler, ProfileResult
    from pdserve.profiler.report import build_report, format_table

__all__ = ["PhaseProfiler", "ProfileResult", "build_report", "format_table"]
_EXPORTS = {"PhaseProfiler": "pdserve.profiler.phase", "ProfileResult": "pdserve.profiler.phase",
            "build_report": "pdserve.profiler.report", "format_table": "pdserve.profiler.report"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pdserve.profiler' has no attribute {name!r}")

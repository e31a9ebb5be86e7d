"""Profiler by phase: torch.profiler over N engine steps, operators ranked per step kind against the roofs.

    phase   PhaseProfiler: wraps engine steps (in the engine's own thread), writes the Chrome/Perfetto trace
    report  per step kind: top operators by self time, FLOPs, bytes, achieved rates, the reading
    cli     `pdserve profile`: against a server (/start_profile, /stop_profile) or offline on a workload
"""

from pdserve.profiler.phase import PhaseProfiler, ProfileResult
from pdserve.profiler.report import build_report, format_table

__all__ = ["PhaseProfiler", "ProfileResult", "build_report", "format_table"]

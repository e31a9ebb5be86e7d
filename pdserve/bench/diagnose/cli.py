"""`pdserve diagnose`: its options and the command's entry point."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from typing import Any

from pdserve.bench.config import BenchError
from pdserve.bench.diagnose.config import DiagnoseConfig
from pdserve.bench.diagnose.experiments import diagnose

DESCRIPTION = """Run three ablations against a running server — (a) prompt shape: the same prompt tokens as 1/2/4
prompts, (b) output length 128/512/2048, (c) a concurrency sweep with knee detection — and write a Markdown report
with plots ending in a verdict: prefill-bound, decode-bound, kv-capacity-bound, queueing, or healthy."""


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_diagnose_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("diagnose", help="find what limits a running server (prefill, decode, KV, queue)",
                              description=DESCRIPTION)
    d = DiagnoseConfig()
    p.add_argument("--base-url", default=d.base_url)
    p.add_argument("--endpoint", default=d.endpoint, choices=["/v1/completions", "/v1/chat/completions"],
                   help="completions sends token ids (exact lengths); chat sends random text")
    p.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    p.add_argument("--tokenizer", default=None, help="for the random prompts (default: the served model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--scale", type=float, default=d.scale,
                   help="multiply every prompt/output length (e.g. 0.25 on a small CPU machine)")
    p.add_argument("--experiments", type=_names, default=d.experiments,
                   help="subset of a,b,c: a prompt shapes, b output lengths, c concurrency sweep (default: all)")
    p.add_argument("--concurrency-levels", type=_ints, default=d.concurrency_levels,
                   help="sweep levels, e.g. 1,2,4,8 (default 1,2,4,8,16,32)")
    p.add_argument("--out", dest="out_dir", default=None, help="report directory (default ./diagnose-<date>)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT above this is high")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT above this is high")
    p.add_argument("--handoff-gbps", type=float, default=d.handoff_gbps,
                   help="KV hand-off rate (GB/s) the PD-or-colocated advice assumes when the server has measured "
                        "none (a PD decode instance reports its own)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout)
    p.set_defaults(func=run_diagnose_cli)
    return p


def config_from_args(args: argparse.Namespace) -> DiagnoseConfig:
    names = {f.name for f in dataclasses.fields(DiagnoseConfig)}
    return DiagnoseConfig(**{k: v for k, v in vars(args).items() if k in names})


def run_diagnose_cli(args: argparse.Namespace) -> int:
    """0 with a verdict, 2 when the diagnosis could not run."""
    from pdserve.bench.datasets import DatasetError

    try:
        result = asyncio.run(diagnose(config_from_args(args)))
    except (BenchError, DatasetError) as e:
        print(f"pdserve diagnose: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(result.verdict_lines()))
    if result.deployment is not None:
        print(f"Deployment: {result.deployment.text}")
    print(f"report: {result.report_path}", flush=True)
    return 0

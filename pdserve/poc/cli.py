"""`pdserve poc`: its options and the command's entry point."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from pdserve.bench.config import BenchError
from pdserve.poc.config import CHECKS, PROFILES, PocConfig

DESCRIPTION = """Validate a running OpenAI-compatible server before production: short requests, long context, a
concurrency sweep up to the knee, streaming, abnormal interruption (disconnects, aborts, a burst past the admission
limit, then KV back to baseline), model switch + rollback and resource reclaim (admin API), per-tenant numbers.
Writes report.md, report.json and plots with the four-part evidence: configuration, run, responsibility, review.
Exit code 0 when no check failed, 1 when one did, 2 when the run could not start."""


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_poc_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("poc", help="validate a running server and write an evidence report",
                              description=DESCRIPTION)
    d = PocConfig()
    p.add_argument("--base-url", default=d.base_url)
    p.add_argument("--api-key", default=None, help="the server's API key (Authorization: Bearer)")
    p.add_argument("--admin-api-key", default=None,
                   help="the server's admin key: enables the switch/rollback and reclaim checks and the audit log")
    p.add_argument("--model", default=None, help="the model (or alias) under test (default: first of /v1/models)")
    p.add_argument("--switch-to", default=None, help="switch the alias to this model, then roll it back")
    p.add_argument("--tenants", type=_names, default=d.tenants,
                   help="tenant ids (comma-separated), sent as the body's user and, when ASCII, as X-Tenant")
    p.add_argument("--owners", default=None, help="owners.yaml: owner, approver, on_call per model")
    p.add_argument("--out", dest="out_dir", default=d.out_dir, help="report directory")
    p.add_argument("--profile", choices=sorted(PROFILES), default=d.profile,
                   help="check sizes: quick (tests, seconds) or default (a few minutes on a small CPU)")
    p.add_argument("--quick", dest="profile", action="store_const", const="quick", help="same as --profile quick")
    p.add_argument("--checks", type=_names, default=d.checks, help=f"subset of {','.join(CHECKS)} (default: all)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout,
                   help="seconds without a byte before a request fails (a hung stream fails the check)")
    p.set_defaults(func=run_poc_cli)
    return p


def run_poc_cli(args: argparse.Namespace) -> int:
    from pdserve.poc.runner import run_poc

    try:
        cfg = PocConfig(base_url=args.base_url, api_key=args.api_key, admin_api_key=args.admin_api_key,
                        model=args.model, switch_to=args.switch_to, tenants=args.tenants, owners=args.owners,
                        out_dir=args.out_dir, profile=args.profile, checks=args.checks, seed=args.seed,
                        request_timeout=args.request_timeout)
        rep = asyncio.run(run_poc(cfg))
    except BenchError as e:
        print(f"pdserve poc: error: {e}", file=sys.stderr)
        return 2
    print(f"pdserve poc: {'PASSED' if rep.passed else 'FAILED'} {rep.counts()}; report: {rep.path}", flush=True)
    return 0 if rep.passed else 1

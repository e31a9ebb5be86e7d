"""`pdserve profile`: the profiler by phase, against a running server or offline on a synthetic workload.

  pdserve profile --base-url http://127.0.0.1:8000 --steps 50 [--out DIR]   (/start_profile, /stop_profile)
  pdserve profile --model M --workload decode|prefill|mixed --steps 50 [--out DIR] [engine options]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Any

from pdserve.profiler.workload import WORKLOADS


def add_profile_parser(subparsers: Any, add_engine_args: Any, engine_config_from_args: Any) -> argparse.ArgumentParser:
    """The `profile` subcommand; the engine-option helpers come from pdserve.cli (which imports this module)."""
    p = subparsers.add_parser("profile", help="profile N engine steps: top operators per step kind vs the roofs",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("--base-url", default=None, help="profile this running server (else: offline, in-process)")
    p.add_argument("--api-key", default=None, help="the server's --api-key")
    p.add_argument("--steps", type=int, default=50, help="engine steps to profile")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="server: seconds to wait for the steps (traffic must be running), then stop anyway")
    p.add_argument("--workload", choices=WORKLOADS, default="decode", help="offline: which phase to drive")
    p.add_argument("--batch", type=int, default=8, help="offline: decoding requests (decode, mixed)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="offline: tokens of each long prompt")
    p.add_argument("--out", default=None, help="write profile.md, profile.json and the trace here")
    p.set_defaults(func=_cmd_profile, engine_config_from_args=engine_config_from_args)
    return p


def _remote(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.base_url, headers=headers, timeout=args.timeout + 60) as client:
        r = client.post("/start_profile", json={"num_steps": args.steps})
        r.raise_for_status()
        r = client.post("/stop_profile", json={"wait_s": args.timeout})
        r.raise_for_status()
        result: dict[str, Any] = r.json()
        return result


def _offline(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.engine.engine import LLMEngine
    from pdserve.profiler.workload import profile_workload
    from pdserve.roofline import resolve_device_peaks

    cfg = args.engine_config_from_args(args)
    engine = LLMEngine(cfg, device_peaks=resolve_device_peaks(cfg.device_peaks, cfg.num_threads, cfg.device))
    result = profile_workload(engine, args.workload, args.steps, args.out, args.batch, args.prompt_tokens)
    return result.as_dict()


def _cmd_profile(args: argparse.Namespace) -> int:
    result = _remote(args) if args.base_url else _offline(args)
    print(result["table"])
    print(f"trace: {result['trace_path']} (open in https://ui.perfetto.dev or chrome://tracing)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "profile.md"), "w", encoding="utf-8") as f:
            f.write(result["table"])
        with open(os.path.join(args.out, "profile.json"), "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1, ensure_ascii=False)
        trace = result["trace_path"]
        if trace and os.path.exists(trace) and os.path.dirname(os.path.abspath(trace)) != os.path.abspath(args.out):
            shutil.copy(trace, args.out)  # a server on this machine: bring its trace along
    return 0

"""Run the checklist against a server, collect the configuration evidence around it, and write the report."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

from pdserve.poc.check import CheckResult, RunLog, timed
from pdserve.poc.checks_admin import check_reclaim, check_switch_rollback
from pdserve.poc.checks_basic import check_long_context, check_short, check_streaming
from pdserve.poc.checks_faults import check_interruption
from pdserve.poc.checks_load import check_concurrency, check_tenants, tenant_metrics, tenant_table
from pdserve.poc.config import PocConfig
from pdserve.poc.evidence import Evidence, load_owners, responsibility, review
from pdserve.poc.report import PocReport, write_report
from pdserve.poc.target import PocTarget

CheckFn = Callable[[PocTarget, PocConfig, RunLog, CheckResult], Awaitable[None]]
# in run order: the disruptive checks (interruption, switch, reclaim) come after the measurements
CHECKLIST: list[tuple[str, str, CheckFn]] = [
    ("short", "Short requests", check_short),
    ("long_context", "Long context near max_model_len", check_long_context),
    ("streaming", "Streaming well-formed, equal to non-streamed", check_streaming),
    ("concurrency", "Concurrency sweep up to the knee", check_concurrency),
    ("tenants", "Per-tenant traffic", check_tenants),
    ("interruption", "Abnormal interruption, back to baseline", check_interruption),
    ("switch_rollback", "Model switch and rollback under load", check_switch_rollback),
    ("reclaim", "Resource reclaim after unload", check_reclaim),
]


async def _audit(t: PocTarget) -> list[dict[str, Any]] | None:
    if not t.admin_api_key:
        return None
    status, body = await t.admin("GET", "/admin/audit?limit=500")
    return list(body.get("entries", [])) if status == 200 else None


async def _configuration(t: PocTarget, audit_before: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Versions, models with their version/config hash, effective options, the audit entries the run added."""
    after = await _audit(t)
    seen = {json.dumps(e, sort_keys=True) for e in audit_before or []}
    new = None if after is None else [e for e in after if json.dumps(e, sort_keys=True) not in seen]
    models = (await t.get_json("/v1/models") or {}).get("data", [])
    return {"version": await t.get_json("/version"), "config": await t.get_json("/v1/config"),
            "models": [{k: m.get(k) for k in ("id", "version", "config_hash", "state", "alias_of")} for m in models],
            "audit_entries": new}


async def run_poc(cfg: PocConfig, echo: Callable[[str], None] | None = None) -> PocReport:
    """Run the selected checks in CHECKLIST order and write report.md/report.json/plots to cfg.out_dir."""
    say = echo or (lambda s: print(s, file=sys.stderr, flush=True))
    owners = load_owners(cfg.owners)  # a broken owners file fails before any traffic
    t = PocTarget(cfg.base_url, cfg.api_key, cfg.admin_api_key, cfg.request_timeout)
    log = RunLog()
    t0 = time.perf_counter()
    try:
        await t.discover(cfg.model)
        audit_before = await _audit(t)
        checks = []
        for name, title, fn in CHECKLIST:
            if name not in cfg.checks:
                continue
            say(f"pdserve poc: {title} ...")
            res = await timed(CheckResult(name, title), lambda r, fn=fn: fn(t, cfg, log, r))  # type: ignore[misc]
            say(f"pdserve poc: {title}: {res.status.upper()} — {res.summary}")
            checks.append(res)
        server_tenants = await tenant_metrics(t)
        configuration = await _configuration(t, audit_before)
    finally:
        await t.close()
    duration = round(time.perf_counter() - t0, 1)
    tenants = tenant_table(log, cfg.tenants, server_tenants)
    served = sorted({m["id"] for m in configuration["models"] if not m.get("alias_of")} or {t.model})
    evidence = Evidence(configuration,
                        {"requests": len(log.requests), "failed": sum(not r.record.success for r in log.requests),
                         "duration_s": duration, "tenants": tenants},
                        responsibility(owners, served), review(checks))
    target = {"base_url": cfg.base_url, "model": t.model, "max_model_len": t.max_model_len, "profile": cfg.profile,
              "date": datetime.now().isoformat(timespec="seconds"), "duration_s": duration, **cfg.extra}
    rep = PocReport(target, checks, tenants, evidence)
    write_report(rep, log, cfg.out_dir)
    return rep

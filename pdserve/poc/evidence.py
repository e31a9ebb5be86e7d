"""The four-part evidence of a validation run: configuration (what ran), run (what it did, per tenant),
responsibility (who owns, approves and answers for each model, from owners.yaml), review (what degraded, whether
rollback worked, the bottleneck verdict, next actions).

owners.yaml, either shape:

    models:                      # or the model names at the top level
      chat: {owner: alice, approver: bob, on_call: ops-pager}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.bench.config import BenchError
from pdserve.poc.check import FAIL, PASS, CheckResult

ROLES = ("owner", "approver", "on_call")


def load_owners(path: str | None) -> dict[str, dict[str, str]] | None:
    """{model: {role: who}} from owners.yaml; None without a file. Raises BenchError for an unreadable file."""
    if path is None:
        return None
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as e:
        raise BenchError(f"--owners {path}: {e}") from None
    models = data.get("models", data) if isinstance(data, dict) else None
    if not isinstance(models, dict):
        raise BenchError(f"--owners {path}: expected a mapping of model names to owner/approver/on_call")
    return {str(k): {r: str(v[r]) for r in ROLES if isinstance(v, dict) and v.get(r)} for k, v in models.items()}


def responsibility(owners: dict[str, dict[str, str]] | None, models: list[str]) -> dict[str, Any]:
    """Per model the three roles, and what is missing (no file, a model not listed, a role not named)."""
    if owners is None:
        return {"rows": [], "missing": ["no --owners file: nobody is named as owner, approver or on-call"]}
    rows, missing = [], []
    for m in models:
        entry = owners.get(m)
        if entry is None:
            missing.append(f"{m}: not in the owners file")
            entry = {}
        gaps = [r for r in ROLES if r not in entry]
        if gaps and m in owners:
            missing.append(f"{m}: no {', '.join(gaps)}")
        rows.append({"model": m, **{r: entry.get(r) for r in ROLES}})
    return {"rows": rows, "missing": missing}


@dataclass
class Evidence:
    configuration: dict[str, Any] = field(default_factory=dict)
    run: dict[str, Any] = field(default_factory=dict)
    responsibility: dict[str, Any] = field(default_factory=dict)
    review: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"configuration": self.configuration, "run": self.run, "responsibility": self.responsibility,
                "review": self.review}


def review(checks: list[CheckResult]) -> dict[str, Any]:
    """What degraded (failed checks), whether rollback was exercised and worked, the bottleneck verdict, and the
    next actions that follow from them."""
    by = {c.name: c for c in checks}
    failed = [c for c in checks if c.status == FAIL]
    sw = by.get("switch_rollback")
    if sw is None or sw.status not in (PASS, FAIL):
        rollback = "not exercised: " + (sw.summary if sw is not None else "the switch check was not selected")
    else:
        rollback = "exercised and worked" if sw.status == PASS else "exercised and FAILED: " + sw.summary
    sweep = by.get("concurrency")
    verdict = sweep.evidence.get("verdict") if sweep is not None else None
    knee = sweep.evidence.get("knee_concurrency") if sweep is not None else None
    actions = [f"fix '{c.title}': {c.summary}" for c in failed]
    if sw is None or sw.status not in (PASS, FAIL):
        actions.append("exercise a switch and rollback (run with --admin-api-key and --switch-to)")
    if verdict and verdict != "healthy":
        actions.append(f"capacity: the sweep reads '{verdict}'"
                       + (f" from concurrency {knee}: cap admission below it or add capacity" if knee else
                          "; see the concurrency findings"))
    skipped = [c.name for c in checks if c.status not in (PASS, FAIL)]
    if skipped:
        actions.append(f"run the skipped checks where the server allows: {', '.join(skipped)}")
    return {"degraded": [f"{c.title}: {c.summary}" for c in failed] or ["nothing: every check that ran passed"],
            "rollback": rollback, "bottleneck": verdict, "knee_concurrency": knee,
            "findings": sweep.evidence.get("findings", []) if sweep is not None else [],
            "next_actions": actions or ["none: keep this report as the baseline for the next change"]}

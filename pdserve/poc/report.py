"""The validation run's output: report.md (checklist, per-tenant table, the four-part evidence), report.json
(every number) and plots (the bench plots of the tenant traffic, diagnose's sweep plot, per-tenant latency)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.bench.config import BenchConfig
from pdserve.bench.diagnose.report import md_table, plot_sweep
from pdserve.bench.plots import write_plots
from pdserve.bench.report import BenchResult
from pdserve.poc.check import FAIL, PASS, CheckResult, RunLog
from pdserve.poc.evidence import Evidence

ICONS = {PASS: "PASS", FAIL: "FAIL"}
CJK_FONTS = ("Noto Sans CJK SC", "Noto Sans SC", "WenQuanYi Zen Hei", "Source Han Sans SC", "SimHei",
             "Droid Sans Fallback")


@dataclass
class PocReport:
    target: dict[str, Any]  # base_url, model, max_model_len, date, profile, duration_s
    checks: list[CheckResult]
    tenants: list[dict[str, Any]]
    evidence: Evidence
    plots: list[str] = field(default_factory=list)
    path: Path | None = None

    @property
    def passed(self) -> bool:
        """No check failed (skipped ones do not count against the run; the report lists them)."""
        return not any(c.status == FAIL for c in self.checks)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.checks:
            out[c.status] = out.get(c.status, 0) + 1
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"target": self.target, "passed": self.passed, "counts": self.counts(),
                "checks": [c.as_dict() for c in self.checks], "tenants": self.tenants,
                "evidence": self.evidence.as_dict(), "plots": self.plots}


def _labels(names: list[str]) -> list[str]:
    """Tick labels: the names when a font can draw them; else non-ASCII names (CJK without a CJK font) become
    `#k`, their row number in the report's per-tenant table."""
    from matplotlib import font_manager

    cjk = any(f.name in CJK_FONTS for f in font_manager.fontManager.ttflist)
    return [n if cjk or n.isascii() else f"#{k + 1}" for k, n in enumerate(names)]


def _plot_tenants(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib.pyplot as plt

    plt.rcParams["font.sans-serif"] = [*CJK_FONTS, *plt.rcParams["font.sans-serif"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = list(range(len(rows)))
    for k, (key, label) in enumerate((("ttft_50_ms", "TTFT p50"), ("ttft_99_ms", "TTFT p99"),
                                      ("itl_50_ms", "ITL p50"), ("itl_99_ms", "ITL p99"))):
        ax.bar([i + 0.2 * k for i in x], [r[key] for r in rows], width=0.2, label=label)
    ax.set_xticks([i + 0.3 for i in x], _labels([r["tenant"] for r in rows]))
    ax.set(title="Latency per tenant (whole run)", ylabel="ms")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots_of(log: RunLog, tenants: list[dict[str, Any]], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    names: list[str] = []
    recs = log.records("tenants") or log.records()
    if recs:  # the tenant check's requests share one clock: TTFT, ITL and a timeline of concurrent traffic
        res = BenchResult(BenchConfig(), "", None, recs, max((r.send + r.e2el for r in recs), default=0.0))
        names += [p.name for p in write_plots(res, out)]
    if log.sweep:
        names.append(plot_sweep(log.sweep, log.knee, out / "concurrency.png").name)
    if tenants:
        names.append(_plot_tenants(tenants, out / "tenants.png").name)
    return names


def _model_line(m: dict[str, Any]) -> str:
    facts = [f"{k} {m[k]}" for k in ("version", "config_hash", "state", "alias_of") if m.get(k) is not None]
    return f"{m.get('id')} ({', '.join(facts) or 'no version or config hash listed'})"


def _evidence_md(ev: Evidence) -> list[str]:
    c, r, resp, rv = ev.configuration, ev.run, ev.responsibility, ev.review
    audit = c.get("audit_entries")
    lines = ["## Evidence", "", "### 1. Configuration", "",
             "- server version: " + (f"`{json.dumps(c['version'], ensure_ascii=False)}`" if c.get("version")
                                     else "not exported (no GET /version)"),
             "- models: " + (", ".join(_model_line(m) for m in c.get("models", [])) or "n/a"),
             f"- effective options (GET /v1/config): {'see report.json' if c.get('config') else 'not exported'}",
             "- audit entries during the run: " + (
                 "the server has no audit log (no admin API or key)" if audit is None else f"{len(audit)}")]
    lines += [f"  - `{json.dumps(e, ensure_ascii=False)[:200]}`" for e in (audit or [])[:20]]
    lines += ["", "### 2. Run", "",
              f"- {r.get('requests', 0)} timed requests, {r.get('failed', 0)} failed; duration {r.get('duration_s')} s",
              "- per tenant: the table above; every request's numbers are in report.json", "",
              "### 3. Responsibility", ""]
    if resp.get("rows"):
        lines.append(md_table(["model", "owner", "approver", "on-call"],
                              [[x["model"], x["owner"], x["approver"], x["on_call"]] for x in resp["rows"]]))
    lines += [f"- missing: {m}" for m in resp.get("missing", [])] or ["- nothing missing"]
    lines += ["", "### 4. Review", "", "- degraded:", *[f"  - {d}" for d in rv.get("degraded", [])],
              f"- rollback: {rv.get('rollback')}",
              f"- bottleneck (diagnose rules): {rv.get('bottleneck') or 'not measured'}"
              + (f", knee at concurrency {rv['knee_concurrency']}" if rv.get("knee_concurrency") else ""),
              *[f"  - {f}" for f in rv.get("findings", [])], "- next actions:",
              *[f"  - {a}" for a in rv.get("next_actions", [])]]
    return lines


def report_markdown(rep: PocReport) -> str:
    t = rep.target
    verdict = "PASSED" if rep.passed else "FAILED"
    lines = [f"# pdserve poc: {verdict}", "",
             f"{t.get('base_url')} · model `{t.get('model')}` (max_model_len {t.get('max_model_len')}) · "
             f"{t.get('date')} · profile {t.get('profile')} · {t.get('duration_s')} s · {rep.counts()}", "",
             "## Checklist", "",
             md_table(["check", "status", "evidence"],
                      [[c.title, ICONS.get(c.status, c.status), c.summary.replace("|", "/")] for c in rep.checks]),
             "", "## Per tenant", "",
             md_table(["tenant", "requests", "errors", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50",
                       "ITL p99", "output tokens", "queue share", "server count"],
                      [[r["tenant"], r["requests"], r["errors"], r["ttft_50_ms"], r["ttft_99_ms"], r["tpot_50_ms"],
                        r["tpot_99_ms"], r["itl_50_ms"], r["itl_99_ms"], r["output_tokens"], r["queue_share"],
                        r["server_requests"]] for r in rep.tenants]),
             "", "Latencies in ms (client side); queue share and server count from `pdserve:tenant_*` metrics. The "
             "first tenant also carries the single-tenant checks (short, long context, streaming, the sweep).", ""]
    lines += _evidence_md(rep.evidence)
    lines += ["", "## Check details", ""]
    for c in rep.checks:
        lines += [f"### {c.title}: {ICONS.get(c.status, c.status)}", "", c.summary, "", "```json",
                  json.dumps(c.evidence, ensure_ascii=False, indent=1, default=str)[:4000], "```", ""]
    if rep.plots:
        lines += ["## Plots", "", *[f"![{p}]({p})" for p in rep.plots]]
    return "\n".join(lines) + "\n"


def write_report(rep: PocReport, log: RunLog, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rep.plots = write_plots_of(log, rep.tenants, out)
    requests = [{"check": r.check, "tenant": r.tenant, "version": r.version, **r.record.as_dict()}
                for r in log.requests]
    (out / "report.json").write_text(json.dumps({**rep.as_dict(), "requests": requests}, ensure_ascii=False,
                                                indent=1, default=str), encoding="utf-8")
    rep.path = out / "report.md"
    rep.path.write_text(report_markdown(rep), encoding="utf-8")
    return rep.path

"""The diagnosis's output: `DiagnoseResult`, report.md with its plots, and diagnose.json with every number."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from pdserve.bench.diagnose.deployment import PDAdvice
from pdserve.bench.diagnose.rules import Thresholds, Verdict, analyze, fmt_ms, ttft_limit_ms
from pdserve.bench.diagnose.stats import RunStats


@dataclass
class DiagnoseResult:
    """The verdict, its findings as text, and the evidence (every number, as diagnose.json holds it)."""

    verdict: Verdict
    knee_concurrency: int | None
    findings: list[str]
    evidence: dict[str, Any]
    shapes: list[RunStats] = field(default_factory=list)  # (a)
    output_lengths: list[RunStats] = field(default_factory=list)  # (b)
    sweep: list[RunStats] = field(default_factory=list)  # (c)
    deployment: PDAdvice | None = None  # PD or colocated (needs the sweep)
    report_path: Path | None = None

    def verdict_lines(self) -> list[str]:
        head = f"Verdict: {self.verdict.value}"
        if self.knee_concurrency is not None:
            head += f" (knee at concurrency {self.knee_concurrency})"
        return [head, *(f"  - {f}" for f in self.findings)]


def build_result(a: list[RunStats], b: list[RunStats], c: list[RunStats], th: Thresholds,
                 target: dict[str, Any], deployment: PDAdvice | None = None) -> DiagnoseResult:
    """Judge the runs of (a), (b) and (c); `target` (model, base_url, max_model_len, scale, duration_s) heads the
    evidence."""
    verdict, knee, findings, itl_ref = analyze(a, b, c, th)
    evidence = {
        **target, "date": datetime.now().isoformat(timespec="seconds"),
        "itl_ref_ms": itl_ref, "ttft_limit_ms": ttft_limit_ms(itl_ref, th), "thresholds": dataclasses.asdict(th),
        "findings": [{"kind": f.kind.value if f.kind else None, "experiment": f.experiment, "text": f.text,
                      "knee_concurrency": f.knee_concurrency} for f in findings],
        "a": [dataclasses.asdict(r) for r in a], "b": [dataclasses.asdict(r) for r in b],
        "c": [dataclasses.asdict(r) for r in c],
        "deployment": None if deployment is None else {"verdict": deployment.verdict.value, "text": deployment.text,
                                                       **deployment.numbers},
    }
    return DiagnoseResult(verdict, knee, [str(f) for f in findings], evidence, a, b, c, deployment)


def _plot_shapes(runs: Sequence[RunStats], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    x = list(range(len(runs)))
    queue = [r.server_queue_ms or 0.0 for r in runs]
    prefill = [r.server_prefill_ms or 0.0 for r in runs]
    ax.bar(x, queue, width=0.35, color="#bbbbbb", label="server queue (mean)")
    ax.bar(x, prefill, width=0.35, bottom=queue, color="#f28e2b", label="server prefill (mean)")
    ax.plot([i + 0.3 for i in x], [r.mean_ttft_ms for r in runs], "o", color="#4e79a7", label="client TTFT mean")
    ax.plot([i + 0.3 for i in x], [r.max_ttft_ms for r in runs], "^", color="#e15759", label="client TTFT max")
    ax.set_xticks(x, [r.label.removeprefix("(a) ") for r in runs])
    ax.set(title="(a) same total prompt tokens, different shapes", ylabel="ms")
    ax.legend(fontsize="small")
    return _save(fig, path)


def _plot_output_lengths(runs: Sequence[RunStats], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    runs = sorted(runs, key=lambda r: r.output_len)  # the repeated shortest output sits next to the first
    x = [r.output_len for r in runs]
    ax.plot(x, [r.median_tpot_ms for r in runs], "o-", label="TPOT (median)")
    ax.plot(x, [r.median_itl_ms for r in runs], "s--", label="ITL (median)")
    ax.plot(x, [r.p99_itl_ms for r in runs], "^:", label="ITL (p99)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(x)), [str(v) for v in sorted(set(x))])
    ax.set_ylim(bottom=0)
    ax.set(title="(b) single stream: decode pace vs output length", xlabel="output tokens", ylabel="ms")
    ax.legend(fontsize="small")
    return _save(fig, path)


def plot_sweep(runs: Sequence[RunStats], knee: dict[str, Any] | None, path: Path) -> Path:
    """`knee`: the knee finding (evidence form); red when it has a verdict, grey when it is an unexplained jump."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = [r.concurrency or 0 for r in runs]
    for attr, style, label in (("median_ttft_ms", "o-", "TTFT p50"), ("p99_ttft_ms", "o:", "TTFT p99"),
                               ("median_e2el_ms", "s-", "E2EL p50"), ("median_itl_ms", "^-", "ITL p50"),
                               ("p99_itl_ms", "^:", "ITL p99")):
        ax1.plot(x, [getattr(r, attr) for r in runs], style, label=label)
    ax2.plot(x, [r.output_throughput for r in runs], "o-", color="#59a14f", label="output tok/s")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(v) for v in x])
        if knee is not None:
            c, kind = knee["knee_concurrency"], knee["kind"]
            ax.axvline(c, color="#e15759" if kind else "#999999", linestyle="--",
                       label=f"knee (c={c}): {kind}" if kind else f"jump (c={c}), unexplained")
        ax.set_xlabel("concurrency")
        ax.legend(fontsize="small")
    ax1.set_yscale("log")
    ax1.set(title="(c) latency vs concurrency", ylabel="ms")
    ax2.set(title="(c) throughput vs concurrency", ylabel="output tokens/s")
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "n/a"
        if isinstance(v, float):
            return f"{v:.1f}" if math.isfinite(v) else str(v)
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _kv(v: float | None) -> float | None:
    return None if v is None else 100 * v


def report_markdown(res: DiagnoseResult, plots: dict[str, str]) -> str:
    ev = res.evidence
    lines = [f"# pdserve diagnose: {ev.get('model')}", "",
             f"Server {ev.get('base_url')}, max_model_len {ev.get('max_model_len')}, scale {ev.get('scale')}, "
             f"{ev.get('date')}, {ev.get('duration_s', 0):.0f} s. ITL_ref (unloaded decode step) "
             f"{fmt_ms(ev.get('itl_ref_ms'))}; TTFT counts as high above {fmt_ms(ev.get('ttft_limit_ms'))}.", "",
             f"Verdict: **{res.verdict.value}** (its evidence is at the end).", ""]
    if res.shapes:
        lines += ["## (a) Same total prompt tokens: 1 long, 2 medium, 4 short", "",
                  md_table(["shape", "ok/failed", "TTFT mean", "TTFT max", "server queue", "server prefill",
                          "prefill share %", "ITL p50", "out tok/s"],
                         [[r.label.removeprefix("(a) "), f"{r.completed}/{r.failed}", r.mean_ttft_ms, r.max_ttft_ms,
                           r.server_queue_ms, r.server_prefill_ms, _kv(r.prefill_share), r.median_itl_ms,
                           r.output_throughput] for r in res.shapes]), "", f"![TTFT per shape]({plots['a']})", ""]
    if res.output_lengths:
        lines += ["## (b) Output length, one stream", "",
                  md_table(["output tokens", "ok/failed", "TTFT", "TPOT p50", "ITL p50", "ITL p99", "E2EL",
                          "out tok/s"],
                         [[r.label.removeprefix("(b) output "), f"{r.completed}/{r.failed}", r.median_ttft_ms,
                           r.median_tpot_ms,
                           r.median_itl_ms, r.p99_itl_ms, r.median_e2el_ms, r.output_throughput]
                          for r in res.output_lengths]), "", f"![TPOT vs output length]({plots['b']})", ""]
    if res.sweep:
        r0 = res.sweep[0]
        lines += [f"## (c) Concurrency sweep (prompt {r0.prompt_len}, output {r0.output_len})", "",
                  md_table(["concurrency", "requests", "ok/failed", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
                          "E2EL p50", "out tok/s", "queue mean", "preemptions", "KV peak %", "waiting peak"],
                         [[r.concurrency, r.num_requests, f"{r.completed}/{r.failed}", r.median_ttft_ms,
                           r.p99_ttft_ms, r.median_itl_ms, r.p99_itl_ms, r.median_e2el_ms, r.output_throughput,
                           r.server_queue_ms, r.preemptions, _kv(r.kv_usage_peak), r.waiting_peak]
                          for r in res.sweep]), "",
                  f"Knee: {_knee_text(res)}.",
                  "", f"![latency and throughput vs concurrency]({plots['c']})", ""]
    lines += ["## Verdict", "", f"**{res.verdict.value}**"
              + (f" — knee at concurrency {res.knee_concurrency}" if res.knee_concurrency is not None else ""), ""]
    lines += [f"- {f}" for f in res.findings]
    if res.deployment is not None:
        lines += ["", "## Deployment: PD disaggregation or colocated", "",
                  f"**{res.deployment.verdict.value}**: {res.deployment.text}"]
    lines += ["", "Thresholds: " + ", ".join(f"{k}={v}" for k, v in ev.get("thresholds", {}).items()), ""]
    return "\n".join(lines)


def _knee(res: DiagnoseResult) -> dict[str, Any] | None:
    """The sweep's knee finding (evidence form), if any."""
    return next((f for f in res.evidence.get("findings", []) if f.get("knee_concurrency")), None)


def _knee_text(res: DiagnoseResult) -> str:
    k = _knee(res)
    if k is None:
        return "none (latency grows within its trend)"
    return f"concurrency {k['knee_concurrency']}, read as {k['kind'] or 'unexplained (no verdict)'}"


def write_report(res: DiagnoseResult, out_dir: Path) -> Path:
    """report.md, its PNGs and diagnose.json (every number) in out_dir; returns the report's path."""
    import matplotlib

    matplotlib.use("Agg")
    out_dir.mkdir(parents=True, exist_ok=True)
    plots: dict[str, str] = {}
    if res.shapes:
        plots["a"] = _plot_shapes(res.shapes, out_dir / "a_prompt_shapes.png").name
    if res.output_lengths:
        plots["b"] = _plot_output_lengths(res.output_lengths, out_dir / "b_output_length.png").name
    if res.sweep:
        plots["c"] = plot_sweep(res.sweep, _knee(res), out_dir / "c_concurrency.png").name
    (out_dir / "diagnose.json").write_text(
        json.dumps({"verdict": res.verdict.value, "knee_concurrency": res.knee_concurrency,
                    "findings": res.findings, "evidence": res.evidence}, ensure_ascii=False, indent=2),
        encoding="utf-8")
    path = out_dir / "report.md"
    path.write_text(report_markdown(res, plots), encoding="utf-8")
    return path

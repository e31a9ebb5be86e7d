"""--plot DIR: PNG figures of a run (matplotlib's Agg backend, no display needed).

ttft.png      TTFT distribution of successful requests
itl.png       every inter-token gap (its tail shows decode stalls a request's mean hides)
timeline.png  one bar per request, by arrival: waiting for a concurrency slot, send -> first token, decode;
              failed requests in red
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pdserve.bench.report import BenchResult

COLORS = {"wait": "#bbbbbb", "ttft": "#f28e2b", "decode": "#4e79a7", "failed": "#e15759"}


def _hist(values_ms: list[float], title: str, xlabel: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if values_ms:
        ax.hist(values_ms, bins=min(50, max(5, len(values_ms) // 4)), color=COLORS["decode"])
        for q, style in ((50, "--"), (99, ":")):
            v = float(np.percentile(values_ms, q))  # the report's percentile, same interpolation
            ax.axvline(v, color="black", linestyle=style, label=f"p{q} {v:.1f} ms")
        ax.legend()
    ax.set(title=title, xlabel=xlabel, ylabel="count")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _timeline(res: BenchResult, path: Path) -> Path:
    import matplotlib.pyplot as plt

    recs = sorted(res.records, key=lambda r: (r.arrival, r.index))
    fig, ax = plt.subplots(figsize=(9, max(3.5, min(0.12 * len(recs) + 2.0, 30.0))))
    for y, r in enumerate(recs):
        ax.barh(y, r.send - r.arrival, left=r.arrival, color=COLORS["wait"], height=0.8)
        if r.success:
            ax.barh(y, r.ttft, left=r.send, color=COLORS["ttft"], height=0.8)
            ax.barh(y, r.e2el - r.ttft, left=r.send + r.ttft, color=COLORS["decode"], height=0.8)
        else:
            ax.barh(y, max(r.e2el, 1e-3), left=r.send, color=COLORS["failed"], height=0.8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in ("wait", "ttft", "decode", "failed")]
    ax.legend(handles, ["waiting for a slot", "send -> first token", "decode", "failed"], loc="upper center",
              bbox_to_anchor=(0.5, -0.16), ncol=4, fontsize="small", frameon=False)
    title = f"Request timeline ({len(recs)} requests)"
    ph = res.server.phases if res.server is not None else {}
    queue, prefill = (ph[k].mean_ms if k in ph else None for k in ("queue", "prefill"))
    if queue is not None and prefill is not None:
        title += f"; server mean queue {queue:.1f} ms, prefill {prefill:.1f} ms"
    ax.set(title=title, xlabel="seconds since start", ylabel="request (by arrival)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(res: BenchResult, out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    ok = [r for r in res.records if r.success]
    return [_hist([r.ttft * 1000 for r in ok], "Time to first token", "TTFT (ms)", d / "ttft.png"),
            _hist([g * 1000 for r in ok for g in r.itl], "Inter-token latency", "ITL (ms)", d / "itl.png"),
            _timeline(res, d / "timeline.png")]

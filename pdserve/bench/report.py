"""Benchmark metrics from request records, and their report: vLLM's result block, JSON with vLLM's field names.

Rules (those of `vllm bench serve`): only successful requests enter the latency statistics and token totals;
TPOT = (E2EL − TTFT) / (output tokens − 1) per request with more than one output token (0 for goodput otherwise);
ITL pools every gap of every request; a request is "good" when each SLO given with --goodput holds for it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.client import RequestRecord
from pdserve.bench.config import BenchConfig
from pdserve.bench.server_metrics import ServerStats

LATENCIES = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
             "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}
WIDTH = 50


def pct_key(p: float) -> str:
    """vLLM's spelling of a percentile in field names: 99 -> 'p99', 99.9 -> 'p99.9'."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def latency_stats(name: str, values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    """mean/median/std/pXX of `values_s` (seconds) in ms under vLLM's keys; zeros when empty."""
    ms = np.asarray(values_s, dtype=float) * 1000 if values_s else np.zeros(1)
    out = {f"mean_{name}_ms": float(np.mean(ms)), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(np.std(ms))}
    for p in percentiles:
        out[f"{pct_key(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def is_good(rec: RequestRecord, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": rec.ttft, "tpot": rec.tpot, "e2el": rec.e2el}
    return rec.success and all(values[k] * 1000 <= slo for k, slo in slos_ms.items())


def peak_concurrency(records: list[RequestRecord]) -> int:
    """Most requests in flight at once (send -> end of stream)."""
    events = sorted([(r.send, 1) for r in records] + [(r.send + r.e2el, -1) for r in records],
                    key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    peak = cur = 0
    for _, step in events:
        cur += step
        peak = max(peak, cur)
    return peak


def peak_output_throughput(records: list[RequestRecord]) -> float:
    """Most output tokens in any one-second bin of the run; a chunk's tokens are the request's output tokens
    spread evenly over its text chunks."""
    bins: dict[int, float] = {}
    for r in records:
        if not r.success or not r.num_chunks:
            continue
        per_chunk = r.output_len / r.num_chunks
        t = r.send + r.ttft
        for gap in [0.0, *r.itl]:
            t += gap
            bins[int(t)] = bins.get(int(t), 0.0) + per_chunk
    return max(bins.values(), default=0.0)


def compute_metrics(records: list[RequestRecord], duration: float, goodput: dict[str, float],
                    percentiles: tuple[float, ...]) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len or 0 for r in ok)
    total_out = sum(r.output_len for r in ok)
    dur = duration if duration > 0 else math.nan
    out: dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(records) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "request_goodput": sum(is_good(r, goodput) for r in records) / dur if goodput else None,
        "output_throughput": total_out / dur, "total_token_throughput": (total_in + total_out) / dur,
        "max_output_tokens_per_s": peak_output_throughput(records),
        "max_concurrent_requests": peak_concurrency(records),
    }
    samples = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.output_len > 1],
               "itl": [g for r in ok for g in r.itl], "e2el": [r.e2el for r in ok]}
    for name, values in samples.items():
        out.update(latency_stats(name, values, percentiles))
    return out


def server_summary(server: ServerStats | None) -> dict[str, Any]:
    """The server's deltas flattened under `server_` keys (empty when the server exports no /metrics)."""
    if server is None:
        return {}
    out: dict[str, Any] = {"server_num_requests": server.num_requests, "server_prompt_tokens": server.prompt_tokens,
                           "server_generation_tokens": server.generation_tokens,
                           "server_num_errors": server.num_errors, "server_preemptions": server.preemptions,
                           "server_prefix_cache_hit_rate": server.prefix_cache_hit_rate}
    if server.spec_mean_acceptance_length is not None:
        out["server_spec_mean_acceptance_length"] = server.spec_mean_acceptance_length
    for phase, s in server.phases.items():
        out.update({f"server_mean_{phase}_ms": s.mean_ms, f"server_p50_{phase}_ms": s.p50_ms,
                    f"server_p90_{phase}_ms": s.p90_ms, f"server_p99_{phase}_ms": s.p99_ms})
    return out


@dataclass
class BenchResult:
    config: BenchConfig
    model: str
    tokenizer_id: str | None
    records: list[RequestRecord]  # measured requests in dataset order (warm-ups excluded)
    duration: float  # first scheduled arrival -> last request done
    server: ServerStats | None = None
    date: str = ""
    warmup_errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """vLLM-named scalar metrics (plus `server_*` deltas when the server exports /metrics)."""
        c = self.config
        return {**compute_metrics(self.records, self.duration, c.goodput, c.metric_percentiles),
                **server_summary(self.server)}

    def errors(self) -> Counter[str]:
        return Counter(r.error for r in self.records if not r.success)

    def to_json(self) -> dict[str, Any]:
        """--save-result: vLLM's fields (config echo, summary, per-request lists) plus every request's record."""
        c = self.config
        ok = [r.success for r in self.records]
        return {
            "date": self.date, "backend": "openai-chat" if c.is_chat else "openai", "endpoint": c.endpoint,
            "base_url": c.base_url, "model_id": self.model, "tokenizer_id": self.tokenizer_id,
            "num_prompts": c.num_prompts, "request_rate": c.request_rate if math.isfinite(c.request_rate) else "inf",
            "burstiness": c.burstiness, "max_concurrency": c.max_concurrency, "goodput_slos_ms": c.goodput,
            **self.summary(),
            "input_lens": [r.prompt_len for r in self.records],
            "output_lens": [r.output_len if s else 0 for r, s in zip(self.records, ok)],
            "ttfts": [r.ttft for r in self.records], "itls": [r.itl for r in self.records],
            "generated_texts": [r.generated_text for r in self.records],
            "errors": [r.error for r in self.records],
            "server": self.server.as_dict() if self.server else None,
            "warmup_errors": self.warmup_errors,
            "config": {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))
                       for k, v in dataclasses.asdict(c).items()},
            "per_request": [r.as_dict() for r in self.records],
        }

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_json(), ensure_ascii=False, indent=2), encoding="utf-8")
        return p

    def format(self) -> str:
        return format_result(self)


# ---- the printed block -----------------------------------------------------------------------------------------
def _line(label: str, value: Any) -> str:
    if value is None:
        value = "n/a"
    if isinstance(value, float) and math.isfinite(value):
        return f"{label:<40} {value:<10.2f}".rstrip()
    return f"{label:<40} {value!s:<10}".rstrip()


def _header(title: str, fill: str = "-") -> str:
    return f"{title:{fill}^{WIDTH}}"


def _server_lines(server: ServerStats, client: dict[str, Any]) -> list[str]:
    lines = [_header(f"Server-side ({server.prefix}: /metrics delta)"),
             _line("Requests finished (server):", int(server.num_requests)),
             _line("Prompt tokens (server):", int(server.prompt_tokens)),
             _line("Generation tokens (server):", int(server.generation_tokens))]
    if server.num_errors is not None:
        lines.append(_line("Requests rejected or failed (server):", int(server.num_errors)))
    labels = {"queue": "queue time", "prefill": "prefill time", "ttft": "TTFT (server)"}
    for phase, label in labels.items():
        s = server.phases.get(phase)
        if s is not None:
            lines.append(_line(f"Mean {label} (ms):", s.mean_ms))
            lines.append(_line(f"P99 {label} (ms, from buckets):", s.p99_ms))
    server_ttft = server.phases["ttft"].mean_ms if "ttft" in server.phases else None
    if server_ttft is not None and client["completed"]:
        lines.append(_line("Client overhead in mean TTFT (ms):", client["mean_ttft_ms"] - server_ttft))
    if server.prefix_cache_hit_rate is not None:
        lines.append(_line("Prefix cache hit rate (%):", 100 * server.prefix_cache_hit_rate))
    if server.preemptions is not None:
        lines.append(_line("Preemptions:", int(server.preemptions)))
    if server.spec_mean_acceptance_length is not None:
        lines.append(_line("Spec decode mean acceptance length:", server.spec_mean_acceptance_length))
    return lines


def format_result(res: BenchResult) -> str:
    """The block `vllm bench serve` prints, then the server-side split and the errors of failed requests."""
    c, m = res.config, res.summary()
    lines = [_header(" Serving Benchmark Result ", "="),
             _line("Successful requests:", m["completed"]),
             _line("Failed requests:", m["failed"])]
    if c.max_concurrency is not None:
        lines.append(_line("Maximum request concurrency:", c.max_concurrency))
    lines += [_line("Request rate configured (RPS):", c.request_rate),
              _line("Benchmark duration (s):", m["duration"]),
              _line("Total input tokens:", m["total_input_tokens"]),
              _line("Total generated tokens:", m["total_output_tokens"]),
              _line("Request throughput (req/s):", m["request_throughput"])]
    if c.goodput:
        lines.append(_line("Request goodput (req/s):", m["request_goodput"]))
    lines += [_line("Output token throughput (tok/s):", m["output_throughput"]),
              _line("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"]),
              _line("Peak concurrent requests:", m["max_concurrent_requests"]),
              _line("Total Token throughput (tok/s):", m["total_token_throughput"])]
    for name, (title, short) in LATENCIES.items():
        lines.append(_header(title))
        lines.append(_line(f"Mean {short} (ms):", m[f"mean_{name}_ms"]))
        lines.append(_line(f"Median {short} (ms):", m[f"median_{name}_ms"]))
        for p in c.metric_percentiles:
            lines.append(_line(f"P{pct_key(p)[1:]} {short} (ms):", m[f"{pct_key(p)}_{name}_ms"]))
    if res.server is not None:
        lines += _server_lines(res.server, m)
    errors = res.errors()
    if errors:
        lines.append(_header("Errors of failed requests"))
        lines += [f"{n:>5}x {msg[:200]}" for msg, n in errors.most_common(10)]
        if len(errors) > 10:
            lines.append(f"  ... and {len(errors) - 10} more distinct errors (see --save-result)")
    lines.append("=" * WIDTH)
    return "\n".join(lines)

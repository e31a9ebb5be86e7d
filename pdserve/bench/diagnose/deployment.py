"""Would prefill/decode disaggregation (PD: a prefill instance and a decode instance, KV handed off between them)
pay on the measured server, or does colocated serving win? A pure rule over the sweep's numbers and server facts.

PD removes one cost and adds two. It removes the decode steps that also carry prefill chunks (their ITL tail); it
adds a KV hand-off to every request's TTFT and needs compute for a second instance. It pays when all three hold:
  1. interference: at the sweep's highest level ITL p99 >= interference_ratio x ITL p50 (default 2): mixed steps
     stretch the tail, so a decode pool without prefills has a tail to win back. Below that there is nothing to win.
  2. compute to split: the server's machine has at least split_cores x the compute threads the server runs
     (cpus >= 2 x threads): a second instance gets cores of its own. With fewer, the two instances share the cores,
     each phase runs slower than in one instance, and colocated wins (BENCHMARKS.md: pd_disagg on 2 cores).
  3. hand-off: moving one request's KV (sweep prompt tokens x KV bytes per token / hand-off rate) costs at most
     handoff_share x its prefill time (default 0.25; the server's mean prefill time at the sweep's lowest level,
     else its TTFT p50 there): the hand-off adds to TTFT. The rate is the server's own (its kv_transfer counters,
     when it runs as a PD decode instance), else `--handoff-gbps` (default 1 GB/s: the ZeroMQ hand-off over loopback
     at the 1.7B shape, BENCHMARKS.md).
Any failing -> colocated wins, with the numbers of the one(s) that failed; facts the server does not publish (an
older pdserve, another server) -> undecided, naming what is missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pdserve.bench.diagnose.rules import fmt_ms
from pdserve.bench.diagnose.stats import RunStats


class PDVerdict(StrEnum):
    PAYS = "pd-pays"
    COLOCATED = "colocated-wins"
    UNDECIDED = "undecided"


@dataclass(frozen=True)
class PDRules:
    interference_ratio: float = 2.0  # ITL p99 / ITL p50 at the highest level
    split_cores: float = 2.0  # cpus >= this x the server's threads
    handoff_share: float = 0.25  # hand-off time <= this x prefill time
    handoff_gbps: float = 1.0  # GB/s when the server measured none


@dataclass(frozen=True)
class ServerFacts:
    """What the server publishes that the rule needs (None: not published)."""

    cpus: int | None = None  # CPUs the server process may run on
    threads: int | None = None  # its compute threads
    kv_bytes_per_token: int | None = None
    kv_role: str | None = None  # both | prefill | decode
    handoff_bytes_per_s: float | None = None  # measured by the server's own hand-offs (decode role)


@dataclass(frozen=True)
class PDAdvice:
    verdict: PDVerdict
    text: str
    numbers: dict[str, Any]


def facts_from_server(version: dict[str, Any], model_entry: dict[str, Any],
                      metrics: dict[str, float] | None) -> ServerFacts:
    """ServerFacts from GET /version, the model's GET /v1/models entry and a /metrics scrape's values."""
    machine = version.get("machine") or {}
    kv = model_entry.get("kv_cache") or {}
    rate = None
    if metrics:
        nbytes = metrics.get("pdserve:kv_transfer_bytes_total", 0.0)
        seconds = metrics.get("pdserve:kv_transfer_seconds_sum", 0.0)
        rate = nbytes / seconds if nbytes > 0 and seconds > 0 else None
    return ServerFacts(cpus=machine.get("cpus"), threads=machine.get("threads"),
                       kv_bytes_per_token=kv.get("bytes_per_token"), kv_role=kv.get("role"),
                       handoff_bytes_per_s=rate)


def pd_advice(sweep: Sequence[RunStats], facts: ServerFacts, rules: PDRules = PDRules()) -> PDAdvice:
    """The rule of the module doc over the concurrency sweep (lowest level first) and the server's facts."""
    ok = [r for r in sweep if r.completed]
    missing = [name for name, v in (("the concurrency sweep", ok or None), ("the server's CPU count", facts.cpus),
                                    ("its compute threads", facts.threads),
                                    ("its KV bytes per token", facts.kv_bytes_per_token)) if v is None]
    if missing:
        return PDAdvice(PDVerdict.UNDECIDED, "PD or colocated: undecided, the server does not publish "
                        + ", ".join(missing), {})
    assert facts.cpus is not None and facts.threads is not None and facts.kv_bytes_per_token is not None
    top, low = ok[-1], ok[0]
    ratio = top.p99_itl_ms / top.median_itl_ms if top.median_itl_ms > 0 else 0.0
    rate = facts.handoff_bytes_per_s or rules.handoff_gbps * 1e9
    handoff_ms = 1000.0 * low.prompt_len * facts.kv_bytes_per_token / rate
    prefill_ms = low.server_prefill_ms if low.server_prefill_ms else low.median_ttft_ms
    numbers = {"itl_p99_over_p50": round(ratio, 2), "concurrency": top.concurrency, "cpus": facts.cpus,
               "threads": facts.threads, "handoff_ms": round(handoff_ms, 2), "prefill_ms": round(prefill_ms, 2),
               "handoff_gb_per_s": round(rate / 1e9, 3), "rate_source": "server" if facts.handoff_bytes_per_s
               else "assumed"}
    fails = []
    if ratio < rules.interference_ratio:
        fails.append(f"little to win: ITL p99 is {ratio:.1f}x p50 at concurrency {top.concurrency} (PD pays from "
                     f"{rules.interference_ratio:g}x: mixed steps are not stretching the tail)")
    if facts.cpus < rules.split_cores * facts.threads:
        fails.append(f"no cores to split: {facts.cpus} CPUs for a server of {facts.threads} threads (a second "
                     f"instance needs {rules.split_cores:g}x: the two would share cores and each phase run slower)")
    if handoff_ms > rules.handoff_share * prefill_ms:
        fails.append(f"the hand-off costs too much: {fmt_ms(handoff_ms)} per request ({low.prompt_len} tokens x "
                     f"{facts.kv_bytes_per_token} B at {rate / 1e9:.2f} GB/s) against a prefill of "
                     f"{fmt_ms(prefill_ms)} (PD pays up to {rules.handoff_share:g}x)")
    if fails:
        return PDAdvice(PDVerdict.COLOCATED, "colocated wins: " + "; ".join(fails), numbers)
    return PDAdvice(PDVerdict.PAYS, f"PD pays: ITL p99 is {ratio:.1f}x p50 at concurrency {top.concurrency}, "
                    f"{facts.cpus} CPUs for {facts.threads} threads, a hand-off of {fmt_ms(handoff_ms)} against a "
                    f"prefill of {fmt_ms(prefill_ms)}; try `pdserve serve --role prefill` and `--role decode` "
                    "behind `pdserve router`, each pinned to its own cores", numbers)

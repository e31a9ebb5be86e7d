"""The diagnosis rules: pure functions from the experiments' numbers (`RunStats`) to findings and a verdict.

The usual reading of serving latency: TTFT high + ITL normal -> prefill/queueing; TTFT normal + ITL high ->
decode/scheduling; both high -> capacity; a sudden knee in the concurrency sweep -> KV capacity. Every number is a
`Thresholds` field:
  ITL_ref        the smallest median TPOT of a single-stream run (the output-length ablation, level 1 of the
                 concurrency sweep, the 1×T run of the prompt-shape ablation): the server's unloaded decode step
                 (TPOT, not the median ITL: chunks a busy client reads late and at once leave TPOT as it was).
  TTFT high      > slo_ttft_ms when given, else > max(10 × ITL_ref, 250 ms): the first token costs more than ten
                 decode steps, and is slow enough for a person to notice.
  ITL high       median TPOT > slo_tpot_ms when given, else median ITL > 3 × ITL_ref (not 2×: on a CPU a batch of
                 one decodes on a faster matrix-vector path, so two streams alone can cost 1.7× one; 3× means the
                 streams really slow each other down).
  prefill share  server prefill time / (queue + prefill) time; >= 0.5 means prefill dominates TTFT, else queue.
  (a) prompt shapes. prefill-bound: the 1×T run's TTFT is high, prefill share >= 0.5, ITL not high.
      queueing: the 1×T run's TTFT is high with queue share >= 0.5 (a lone request waited), or the 4×T/4 run's max
      TTFT is >= 1.5 × the 1×T run's, the extra is itself over the TTFT limit, and its queue share is >= 0.5
      (splitting the same tokens into requests costs time: the scheduler serializes them).
  (b) output lengths. decode-bound: median ITL of the longest output >= 1.5 × that of the shortest and >= 5 ms
      more (decode slows as the KV cache grows), or median TPOT > slo_tpot_ms. The shortest runs first and again
      last; the slower of the two is the baseline (a machine that got busier meanwhile is not decode slowing down).
  (c) concurrency sweep. knee: a level where a latency (median TTFT, p99 TTFT, median E2EL, p99 ITL: waiting for
      admission shows in TTFT, a preemption's recompute stall in the ITL tail and E2EL) rises, from the level
      below, by more than 3 × the trend's rise, by more than 50 ms, and to at least 1.5 × the level below. The trend
      is the slope of the segment below (successive slopes; at least 0.05 × y0/level0 against noise), and for the
      second level the proportional slope y0/level0. Growth within the trend is contention, not a knee.
      KV evidence at a level: preemptions > 0, or a /metrics sample with KV usage >= 0.9 and requests waiting.
      The first knee with KV evidence at its level -> kv-capacity-bound, at that concurrency. Else the first knee:
      a TTFT/E2EL knee with queue share >= 0.5 and a queue-time rise >= 0.5 × the latency rise -> queueing
      (slots, not memory); on a server without /metrics -> kv-capacity-bound, unconfirmed (a knee alone is read as
      KV capacity). No knee, but KV evidence at a level whose latency rose >= 1.5 × the level below ->
      kv-capacity-bound from there (a server whose throughput saturated early grows linearly right through its KV
      limit). Then, at the highest level: ITL high -> decode-bound (both high: compute contention); TTFT high only
      -> queueing or prefill-bound by the share.
Primary verdict: the first found of kv-capacity-bound, prefill-bound, queueing, decode-bound; else healthy. Every
finding is listed with the numbers that led to it.
Live (GET /v1/stats, the dashboard): the server's last window is read as one level — KV evidence, then the TTFT/ITL
reading — with ITL_ref the median single-stream decode step it has seen (analyze_window).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from pdserve.bench.diagnose.stats import RunStats


class Verdict(StrEnum):
    KV_CAPACITY = "kv-capacity-bound"
    PREFILL = "prefill-bound"
    QUEUEING = "queueing"
    DECODE = "decode-bound"
    HEALTHY = "healthy"


PRIORITY = (Verdict.KV_CAPACITY, Verdict.PREFILL, Verdict.QUEUEING, Verdict.DECODE)


@dataclass(frozen=True)
class Thresholds:
    """Every number the rules judge by (see the module doc); slo_* override the relative TTFT/ITL limits."""

    ttft_factor: float = 10.0  # TTFT high: > ttft_factor × ITL_ref ...
    ttft_floor_ms: float = 250.0  # ... and > this
    itl_factor: float = 3.0  # ITL high: median ITL > itl_factor × ITL_ref
    share: float = 0.5  # prefill (or queue) share of TTFT that "dominates"
    split_overhead: float = 1.5  # (a): 4 pieces' max TTFT vs 1 piece's
    tpot_growth: float = 1.5  # (b): ITL(longest output) / ITL(shortest)
    tpot_growth_min_ms: float = 5.0
    knee_ratio: float = 3.0  # (c): actual rise / trend-predicted rise
    knee_min_jump_ms: float = 50.0
    knee_min_growth: float = 1.5  # y_knee / y_below
    knee_slope_floor: float = 0.05  # trend slope >= this × y0 / level0
    kv_full: float = 0.9  # KV usage peak that counts as full
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None


@dataclass
class Finding:
    """One observation of one experiment, with the numbers behind it; `kind` is the verdict it supports."""

    kind: Verdict | None  # None: informational
    text: str
    experiment: str  # "a", "b", "c" or "" (overall)
    knee_concurrency: int | None = None

    def __str__(self) -> str:
        return f"[{self.kind.value if self.kind else 'info'}] ({self.experiment or '-'}) {self.text}"


def fmt_ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f} ms" if v >= 100 else f"{v:.1f} ms"


def fmt_pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.0f}%"


def itl_reference(a: Sequence[RunStats], b: Sequence[RunStats], c: Sequence[RunStats]) -> float | None:
    """The unloaded decode step: the smallest median TPOT of the single-stream runs. TPOT spans the whole stream:
    a client that reads chunks late, several at once (a busy client host), sees gaps of ~0 and then a long one,
    which drag a median of a few ITL gaps toward zero but leave the stream's span, and so TPOT, as it was."""
    single = [r for r in b if r.completed]
    single += [r for r in c if r.concurrency == 1 and r.completed]
    single += [r for r in a if r.num_requests == 1 and r.completed]
    values = [r.median_tpot_ms or r.median_itl_ms for r in single]
    values = [v for v in values if v > 0]
    return min(values) if values else None


def ttft_limit_ms(itl_ref: float | None, th: Thresholds) -> float:
    if th.slo_ttft_ms is not None:
        return th.slo_ttft_ms
    return max(th.ttft_factor * (itl_ref or 0.0), th.ttft_floor_ms)


def ttft_high(ttft_ms: float, itl_ref: float | None, th: Thresholds) -> bool:
    return ttft_ms > ttft_limit_ms(itl_ref, th)


def itl_high(r: RunStats, itl_ref: float | None, th: Thresholds) -> bool:
    if th.slo_tpot_ms is not None:
        return r.median_tpot_ms > th.slo_tpot_ms
    return itl_ref is not None and r.median_itl_ms > th.itl_factor * itl_ref


def _itl_rule(th: Thresholds, itl_ref: float | None) -> str:
    if th.slo_tpot_ms is not None:
        return f"TPOT SLO {fmt_ms(th.slo_tpot_ms)}"
    return f"limit {th.itl_factor:g} × ITL_ref = {fmt_ms(th.itl_factor * itl_ref) if itl_ref else 'n/a'}"


def _ttft_rule(th: Thresholds, itl_ref: float | None) -> str:
    if th.slo_ttft_ms is not None:
        return f"TTFT SLO {fmt_ms(th.slo_ttft_ms)}"
    limit = fmt_ms(ttft_limit_ms(itl_ref, th))
    return f"limit max({th.ttft_factor:g} × ITL_ref, {th.ttft_floor_ms:g} ms) = {limit}"


def knee_points(levels: Sequence[int], values: Sequence[float], th: Thresholds = Thresholds()) -> list[int]:
    """Indices of the levels where `values` jumps above the trend of the levels below (see the module doc); empty
    when growth stays within the trend (linear contention) or there are fewer than two levels."""
    if len(levels) < 2 or levels[0] <= 0 or values[0] <= 0:
        return []
    base_slope = values[0] / levels[0]  # growth proportional to load, from the origin
    slope = base_slope  # the trend the next rise is compared with
    knees = []
    for i in range(1, len(levels)):
        step = levels[i] - levels[i - 1]
        rise = values[i] - values[i - 1]
        if (rise > th.knee_ratio * slope * step and rise > th.knee_min_jump_ms
                and values[i] >= th.knee_min_growth * values[i - 1]):
            knees.append(i)
        slope = max(rise / step, th.knee_slope_floor * base_slope)  # successive slopes, floored against noise
    return knees


def find_knee(levels: Sequence[int], values: Sequence[float], th: Thresholds = Thresholds()) -> int | None:
    """Index of the first knee, or None."""
    knees = knee_points(levels, values, th)
    return knees[0] if knees else None


def analyze_shapes(runs: Sequence[RunStats], itl_ref: float | None, th: Thresholds) -> list[Finding]:
    """(a): is the first token's cost prefill compute (it follows the longest prompt) or waiting (queue)?"""
    ok = sorted((r for r in runs if r.completed), key=lambda r: r.num_requests)
    if not ok:
        return [Finding(None, "no successful run; nothing to judge", "a")]
    one, many = ok[0], ok[-1]
    shapes = ", ".join(f"{r.label}: mean {fmt_ms(r.mean_ttft_ms)} / max {fmt_ms(r.max_ttft_ms)}" for r in ok)
    findings = [Finding(None, f"TTFT per shape — {shapes}", "a")]
    high = ttft_high(one.max_ttft_ms, itl_ref, th)
    decode_high = itl_high(one, itl_ref, th)
    share = one.prefill_share
    split = (f"server queue {fmt_ms(one.server_queue_ms)} + prefill {fmt_ms(one.server_prefill_ms)} "
             f"(prefill share {fmt_pct(share)})")
    numbers = (f"{one.label}: TTFT {fmt_ms(one.max_ttft_ms)} ({_ttft_rule(th, itl_ref)}; ITL_ref "
               f"{fmt_ms(itl_ref)}), {split}; median ITL {fmt_ms(one.median_itl_ms)} ({_itl_rule(th, itl_ref)})")
    if high and decode_high:
        findings.append(Finding(None, f"both TTFT and ITL high → capacity; {numbers}", "a"))
    elif high and (share is None or share >= th.share):
        rate = one.prompt_len / (one.server_prefill_ms / 1000) if one.server_prefill_ms else None
        tps = f"; prefill ≈ {rate:.0f} prompt tok/s" if rate else ""
        findings.append(Finding(Verdict.PREFILL, f"TTFT high, prefill-dominated, ITL normal — {numbers}{tps}",
                                "a"))
    elif high:
        findings.append(Finding(Verdict.QUEUEING, f"a lone request's TTFT is mostly queue time — {numbers}", "a"))
    extra = many.max_ttft_ms - one.max_ttft_ms
    if (many is not one and many.max_ttft_ms >= th.split_overhead * one.max_ttft_ms
            and ttft_high(extra, itl_ref, th) and (many.queue_share or 0.0) >= th.share):
        findings.append(Finding(
            Verdict.QUEUEING,
            f"the same tokens as {many.label} take {many.max_ttft_ms / one.max_ttft_ms:.1f}× the max TTFT of "
            f"{one.label} ({fmt_ms(many.max_ttft_ms)} vs {fmt_ms(one.max_ttft_ms)}; limit {th.split_overhead:g}×, "
            f"and the extra {fmt_ms(extra)} is itself over the TTFT limit {fmt_ms(ttft_limit_ms(itl_ref, th))}), "
            f"queue share {fmt_pct(many.queue_share)}: requests are serialized by the scheduler", "a"))
    return findings


def analyze_output_lengths(runs: Sequence[RunStats], itl_ref: float | None, th: Thresholds) -> list[Finding]:
    """(b): a healthy decoder keeps ITL flat as the output (and its KV cache) grows."""
    ok = sorted((r for r in runs if r.completed and r.output_len > 1), key=lambda r: r.output_len)
    if not ok:
        return [Finding(None, "no successful run; nothing to judge", "b")]
    per = ", ".join(f"{r.output_len} tok{' (again)' if r.label.endswith('again') else ''}: TPOT "
                    f"{fmt_ms(r.median_tpot_ms)}, ITL {fmt_ms(r.median_itl_ms)} (p99 {fmt_ms(r.p99_itl_ms)}), "
                    f"{r.output_throughput:.1f} tok/s" for r in ok)
    findings = [Finding(None, f"single stream — {per}", "b")]
    # the shortest output may run twice (first and last): the slower one is the baseline, so a machine that got
    # busier while the long outputs ran does not read as decode slowing down with its KV cache
    short = max((r for r in ok if r.output_len == ok[0].output_len), key=lambda r: r.median_itl_ms)
    long_ = ok[-1]
    if long_.output_len > short.output_len and short.median_itl_ms > 0:
        growth = long_.median_itl_ms / short.median_itl_ms
        if growth >= th.tpot_growth and long_.median_itl_ms - short.median_itl_ms >= th.tpot_growth_min_ms:
            findings.append(Finding(
                Verdict.DECODE,
                f"ITL grows {growth:.2f}× from {short.output_len} to {long_.output_len} output tokens "
                f"({fmt_ms(short.median_itl_ms)} → {fmt_ms(long_.median_itl_ms)}; limit {th.tpot_growth:g}×): "
                "decode slows as the KV cache it reads grows", "b"))
    if th.slo_tpot_ms is not None:
        over = [r for r in ok if r.median_tpot_ms > th.slo_tpot_ms]
        if over:
            findings.append(Finding(
                Verdict.DECODE, f"single-stream TPOT over the SLO {fmt_ms(th.slo_tpot_ms)}: "
                + ", ".join(f"{r.output_len} tok {fmt_ms(r.median_tpot_ms)}" for r in over), "b"))
    return findings


def kv_evidence(r: RunStats, th: Thresholds) -> str | None:
    """Why this level ran out of KV memory, or None."""
    if r.preemptions:
        return f"{r.preemptions:.0f} preemptions"
    if r.kv_usage_peak is not None and r.kv_usage_peak >= th.kv_full and (r.waiting_when_full or 0) > 0:
        return f"KV usage {fmt_pct(r.kv_usage_peak)} with {r.waiting_when_full:.0f} requests waiting at the same time"
    return None


def _level_line(r: RunStats) -> str:
    return (f"c={r.concurrency}: TTFT p50 {fmt_ms(r.median_ttft_ms)}, E2EL p50 {fmt_ms(r.median_e2el_ms)}, "
            f"ITL p50 {fmt_ms(r.median_itl_ms)}, queue mean {fmt_ms(r.server_queue_ms)}, preemptions "
            f"{'n/a' if r.preemptions is None else f'{r.preemptions:.0f}'}, KV peak {fmt_pct(r.kv_usage_peak)}, "
            f"waiting peak {'n/a' if r.waiting_peak is None else f'{r.waiting_peak:.0f}'}")


# Where a knee shows: waiting for admission lifts TTFT (median, tail); a preempted request stalls for a whole
# recompute, which lifts the ITL tail and E2EL.
KNEE_METRICS = {"median_ttft_ms": "median TTFT", "p99_ttft_ms": "p99 TTFT", "median_e2el_ms": "median E2EL",
                "p99_itl_ms": "p99 ITL"}
WAITING_METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_e2el_ms")  # latencies a queue adds to


def sweep_knees(runs: Sequence[RunStats], th: Thresholds) -> list[tuple[int, str]]:
    """(level index, latency field) of every knee in every KNEE_METRICS series, by level, then KNEE_METRICS order."""
    levels = [r.concurrency or 0 for r in runs]
    series = {attr: [float(getattr(r, attr)) for r in runs] for attr in KNEE_METRICS}
    order = list(KNEE_METRICS)
    hits = [(i, attr) for attr, values in series.items() for i in knee_points(levels, values, th)]
    return sorted(hits, key=lambda h: (h[0], order.index(h[1])))


def _grew(r: RunStats, below: RunStats, th: Thresholds) -> bool:
    """Some latency of KNEE_METRICS at r rose to at least knee_min_growth × the level below."""
    return any(getattr(r, a) >= th.knee_min_growth * getattr(below, a) > 0 for a in KNEE_METRICS)


def analyze_sweep(runs: Sequence[RunStats], itl_ref: float | None, th: Thresholds) -> list[Finding]:
    """(c): linear growth = contention; a knee = capacity: KV memory when the server shows preemption or a full
    pool at that level, request slots when its queue time jumps without them."""
    ok = sorted((r for r in runs if r.completed and r.concurrency), key=lambda r: r.concurrency or 0)
    if len(ok) < 2:
        return [Finding(None, "fewer than two successful levels; no trend to judge", "c")]
    knees = sweep_knees(ok, th)
    # the first knee whose level shows KV evidence; else the first knee, read by queueing or left unexplained
    kv_knee = next(((i, a) for i, a in knees if kv_evidence(ok[i], th)), None)
    if kv_knee is not None or knees:
        i, attr = kv_knee or knees[0]
        knee = _knee_finding(ok, i, attr, th)
        if knee.kind is not None:
            return [knee]
        findings = [knee]
    else:
        first, last = ok[0], ok[-1]
        findings = [Finding(None, f"no knee: latency grows within its trend (contention) — median TTFT "
                            f"{fmt_ms(first.median_ttft_ms)} → {fmt_ms(last.median_ttft_ms)}, median E2EL "
                            f"{fmt_ms(first.median_e2el_ms)} → {fmt_ms(last.median_e2el_ms)}, p99 ITL "
                            f"{fmt_ms(first.p99_itl_ms)} → {fmt_ms(last.p99_itl_ms)} from c={first.concurrency} to "
                            f"c={last.concurrency}", "c")]
    # A server whose throughput saturated early grows linearly right through its KV limit (the waiting requests
    # just continue the line); the server's own evidence still says where memory ran out.
    kv = next(((i, e) for i in range(1, len(ok)) if (e := kv_evidence(ok[i], th)) and _grew(ok[i], ok[i - 1], th)),
              None)
    if kv is not None:
        i, e = kv
        findings.append(Finding(Verdict.KV_CAPACITY,
                                f"KV exhausted from concurrency {ok[i].concurrency} (last level without: "
                                f"{ok[i - 1].concurrency}): {e}, latency ≥ {th.knee_min_growth:g}× the level below;"
                                f" no sharper knee there (latency was already growing with load: compute saturated "
                                f"first); {_level_line(ok[i])}", "c", ok[i].concurrency))
    return findings + level_findings(ok[-1], itl_ref, th)


def _knee_finding(ok: Sequence[RunStats], k: int, attr: str, th: Thresholds) -> Finding:
    """Read the knee at level index k (seen in `attr`) by the server's evidence at that level."""
    knee, below = ok[k], ok[k - 1]
    at = f"knee at concurrency {knee.concurrency} (last level within the trend: {below.concurrency})"
    jump = (f"{KNEE_METRICS[attr]} {fmt_ms(getattr(below, attr))} → {fmt_ms(getattr(knee, attr))} "
            f"(> {th.knee_ratio:g}× the trend's rise)")
    evidence = kv_evidence(knee, th)
    if evidence is not None:
        return Finding(Verdict.KV_CAPACITY, f"{at}: {jump}; KV exhausted there: {evidence}; {_level_line(knee)}",
                       "c", knee.concurrency)
    queue_rise = (knee.server_queue_ms or 0.0) - (below.server_queue_ms or 0.0)
    latency_rise = getattr(knee, attr) - getattr(below, attr)
    if (attr in WAITING_METRICS and (knee.queue_share or 0.0) >= th.share
            and queue_rise >= th.share * latency_rise):
        return Finding(Verdict.QUEUEING, f"{at}: {jump}; queue time rose {fmt_ms(queue_rise)} (queue share "
                       f"{fmt_pct(knee.queue_share)}) without preemption or a full KV pool → request slots or "
                       f"scheduling, not memory; {_level_line(knee)}", "c", knee.concurrency)
    if not knee.has_server_metrics:
        return Finding(Verdict.KV_CAPACITY, f"{at}: {jump}; the server exports no /metrics, so preemption or "
                       "queueing is unconfirmed (a knee alone is read as KV capacity)", "c", knee.concurrency)
    return Finding(None, f"{at}: {jump}, but no preemption, full KV pool or queue-time jump at that level: compute "
                   f"contention or noise (e.g. prefills mixed into decode steps, for an ITL tail); "
                   f"{_level_line(knee)}", "c", knee.concurrency)


def level_findings(r: RunStats, itl_ref: float | None, th: Thresholds) -> list[Finding]:
    """The TTFT/ITL reading (see the module doc) of one load level: the highest level of a sweep without a knee,
    or a live server's window (analyze_window)."""
    t_high, i_high = ttft_high(r.median_ttft_ms, itl_ref, th), itl_high(r, itl_ref, th)
    numbers = (f"at c={r.concurrency}: TTFT p50 {fmt_ms(r.median_ttft_ms)} ({_ttft_rule(th, itl_ref)}), ITL p50 "
               f"{fmt_ms(r.median_itl_ms)} / TPOT p50 {fmt_ms(r.median_tpot_ms)} ({_itl_rule(th, itl_ref)}), "
               f"queue share {fmt_pct(r.queue_share)}")
    if i_high:
        what = "both TTFT and ITL high, growing linearly → compute contention" if t_high else "ITL high, TTFT normal"
        return [Finding(Verdict.DECODE, f"{what} — {numbers}", "c")]
    if t_high and (r.queue_share or 0.0) >= th.share:
        return [Finding(Verdict.QUEUEING, f"TTFT high and mostly queue time, ITL normal — {numbers}", "c")]
    if t_high:
        return [Finding(Verdict.PREFILL, f"TTFT high and mostly prefill, ITL normal — {numbers}", "c")]
    return []


def decide(findings: Sequence[Finding]) -> tuple[Verdict, int | None]:
    """The primary verdict (first of PRIORITY found, else healthy) and the knee's concurrency when KV-bound."""
    for v in PRIORITY:
        hit = next((f for f in findings if f.kind == v), None)
        if hit is not None:
            return v, hit.knee_concurrency
    return Verdict.HEALTHY, None


def healthy_summary(a: Sequence[RunStats], b: Sequence[RunStats], c: Sequence[RunStats], itl_ref: float | None,
                    th: Thresholds) -> str:
    """The numbers behind a healthy verdict: the worst TTFT and ITL seen against their limits."""
    runs = [r for r in (*a, *b, *c) if r.completed]
    if not runs:
        return "no successful request: nothing was measured"
    worst_ttft = max(runs, key=lambda r: r.max_ttft_ms)
    worst_itl = max(runs, key=lambda r: r.median_itl_ms)
    pre = sum(r.preemptions or 0 for r in runs)
    sweep = "no knee with KV or queue evidence, " if c else ""
    return (f"worst TTFT {fmt_ms(worst_ttft.max_ttft_ms)} ({worst_ttft.label}; {_ttft_rule(th, itl_ref)}), worst "
            f"median ITL {fmt_ms(worst_itl.median_itl_ms)} ({worst_itl.label}; ITL_ref {fmt_ms(itl_ref)}, "
            f"{_itl_rule(th, itl_ref)}), {sweep}{pre:.0f} preemptions")


def analyze_window(r: RunStats, itl_ref: float | None, th: Thresholds) -> tuple[Verdict, list[Finding]]:
    """A live server's last window (GET /v1/stats) read as one level of the sweep: KV evidence at this load
    (kv_evidence: preemptions, or a full pool with requests waiting) -> kv-capacity-bound; then the TTFT/ITL reading
    (level_findings); `decide` picks the verdict by the same priority as `diagnose`. Without a sweep there is no
    knee, so KV evidence alone counts. `itl_ref`: the server's unloaded decode step (None: unknown yet)."""
    if not r.completed and not r.preemptions:
        return Verdict.HEALTHY, [Finding(None, f"{r.label}: no request finished, nothing to judge", "")]
    findings: list[Finding] = []
    if (evidence := kv_evidence(r, th)) is not None:
        findings.append(Finding(Verdict.KV_CAPACITY, f"KV exhausted at this load: {evidence}; {_level_line(r)}",
                                "", r.concurrency))
    findings += level_findings(r, itl_ref, th)
    verdict, _ = decide(findings)
    if verdict == Verdict.HEALTHY:
        findings.append(Finding(None, "healthy: " + healthy_summary([r], [], [], itl_ref, th), ""))
    return verdict, findings


def analyze(a: Sequence[RunStats], b: Sequence[RunStats], c: Sequence[RunStats],
            th: Thresholds) -> tuple[Verdict, int | None, list[Finding], float | None]:
    """(verdict, knee concurrency, findings, ITL_ref) from the experiments' numbers."""
    itl_ref = itl_reference(a, b, c)
    findings: list[Finding] = []
    if a:
        findings += analyze_shapes(a, itl_ref, th)
    if b:
        findings += analyze_output_lengths(b, itl_ref, th)
    if c:
        findings += analyze_sweep(c, itl_ref, th)
    failed = sum(r.failed for r in (*a, *b, *c))
    if failed:
        errs = sorted({e for r in (*a, *b, *c) for e in r.errors})
        findings.append(Finding(None, f"{failed} requests failed: {'; '.join(errs)[:300]}", ""))
    verdict, knee = decide(findings)
    if verdict == Verdict.HEALTHY:
        findings.append(Finding(None, "healthy: " + healthy_summary(a, b, c, itl_ref, th), ""))
    return verdict, knee, findings, itl_ref

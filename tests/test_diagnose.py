"""`pdserve diagnose`: the knee and verdict rules on synthetic numbers (fast), the report and CLI wiring (fast), and
planted cases against real `pdserve serve` processes (slow): a tiny KV pool (kv-capacity-bound, with its knee),
long prompts without chunked prefill (prefill-bound), a small load (healthy). The slow tests read only measured
numbers: the diagnosis is never told the server's configuration. They time with the server's CPU clock
(ServerCPUClock), so a busy machine neither plants a problem nor hides one."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench.config import BenchError
from pdserve.bench.diagnose import (
    DiagnoseConfig,
    DiagnoseResult,
    RunStats,
    Thresholds,
    Verdict,
    add_diagnose_parser,
    analyze,
    config_from_args,
    diagnose,
    find_knee,
    write_report,
)
from pdserve.bench.diagnose.deployment import PDRules, PDVerdict, ServerFacts, facts_from_server, pd_advice
from pdserve.launch import ServerProc, start_server

TH = Thresholds()


def level(c: int, ttft: float, e2el: float, itl: float = 20.0, queue: float | None = 1.0, prefill: float = 50.0,
          preempt: float | None = 0.0, kv: float | None = 0.3, waiting: float | None = 0.0,
          itl_p99: float | None = None) -> RunStats:
    return RunStats(f"(c) concurrency {c}", 128, 64, 2 * c, concurrency=c, completed=2 * c, median_ttft_ms=ttft,
                    p99_ttft_ms=ttft * 1.1, max_ttft_ms=ttft * 1.2, median_e2el_ms=e2el, median_itl_ms=itl,
                    p99_itl_ms=itl * 1.5 if itl_p99 is None else itl_p99, median_tpot_ms=itl,
                    server_queue_ms=queue, server_prefill_ms=prefill, preemptions=preempt, kv_usage_peak=kv,
                    waiting_peak=waiting, waiting_when_full=waiting if (kv or 0) >= 0.9 else 0.0,
                    output_throughput=10.0 * c)


def shape(k: int, total: int, ttft_max: float, queue: float, prefill: float, itl: float = 20.0) -> RunStats:
    return RunStats(f"(a) {k}×{total // k}", total // k, 16, k, completed=k, mean_ttft_ms=ttft_max * 0.8,
                    max_ttft_ms=float(ttft_max), median_itl_ms=itl, median_tpot_ms=itl,
                    server_queue_ms=float(queue), server_prefill_ms=float(prefill))


def decode_run(out: int, itl: float) -> RunStats:
    return RunStats(f"(b) output {out}", 32, out, 1, concurrency=1, completed=1, median_ttft_ms=60.0,
                    max_ttft_ms=60.0, median_itl_ms=itl, median_tpot_ms=itl, p99_itl_ms=itl * 1.3,
                    server_queue_ms=1.0, server_prefill_ms=55.0, output_throughput=1000 / itl)


HEALTHY_B = [decode_run(128, 20.0), decode_run(512, 21.0), decode_run(2048, 23.0)]


# ---- PD or colocated --------------------------------------------------------------------------------------------
ROOMY = ServerFacts(cpus=32, threads=8, kv_bytes_per_token=100_000)  # 128 tokens: 12.8 MB, 12.8 ms at 1 GB/s


def test_pd_pays_with_a_stretched_tail_spare_cores_and_a_cheap_handoff() -> None:
    sweep = [level(1, 60.0, 600.0, prefill=100.0), level(32, 200.0, 3000.0, itl=30.0, itl_p99=150.0)]
    adv = pd_advice(sweep, ROOMY)
    assert adv.verdict == PDVerdict.PAYS, adv.text
    assert adv.numbers["itl_p99_over_p50"] == 5.0 and adv.numbers["handoff_ms"] == 12.8
    assert adv.numbers["prefill_ms"] == 100.0 and adv.numbers["rate_source"] == "assumed"


def test_colocated_wins_and_says_which_condition_failed() -> None:
    stretched = [level(1, 60.0, 600.0, prefill=100.0), level(32, 200.0, 3000.0, itl=30.0, itl_p99=150.0)]
    flat = [level(1, 60.0, 600.0, prefill=100.0), level(32, 200.0, 3000.0, itl=30.0, itl_p99=45.0)]
    two_cores = ServerFacts(cpus=2, threads=2, kv_bytes_per_token=100_000)
    big_kv = ServerFacts(cpus=32, threads=8, kv_bytes_per_token=1_000_000)  # 128 ms per hand-off
    cases = [(flat, ROOMY, "little to win"), (stretched, two_cores, "no cores to split"),
             (stretched, big_kv, "the hand-off costs too much")]
    for sweep, facts, reason in cases:
        adv = pd_advice(sweep, facts)
        assert adv.verdict == PDVerdict.COLOCATED and reason in adv.text, adv.text
        assert adv.text.count(";") == 0  # only the failing condition is named
    # a faster hand-off (the server's own measurement, or a better link) turns the last case around
    fast = ServerFacts(cpus=32, threads=8, kv_bytes_per_token=1_000_000, handoff_bytes_per_s=10e9)
    assert pd_advice(stretched, fast).verdict == PDVerdict.PAYS
    assert pd_advice(stretched, big_kv, PDRules(handoff_gbps=10.0)).verdict == PDVerdict.PAYS


def test_pd_advice_undecided_names_what_is_missing() -> None:
    adv = pd_advice([level(1, 60.0, 600.0)], ServerFacts(cpus=4, threads=None, kv_bytes_per_token=None))
    assert adv.verdict == PDVerdict.UNDECIDED
    assert "compute threads" in adv.text and "KV bytes per token" in adv.text and "CPU count" not in adv.text
    assert pd_advice([], ROOMY).verdict == PDVerdict.UNDECIDED


def test_server_facts_from_version_models_and_metrics() -> None:
    facts = facts_from_server({"machine": {"cpus": 16, "threads": 4}},
                              {"kv_cache": {"dtype": "bfloat16", "bytes_per_token": 92160, "role": "decode"}},
                              {"pdserve:kv_transfer_bytes_total": 3e9, "pdserve:kv_transfer_seconds_sum": 2.0})
    assert facts == ServerFacts(16, 4, 92160, "decode", 1.5e9)
    assert facts_from_server({}, {}, None) == ServerFacts()


# ---- knee detection ----------------------------------------------------------------------------------------------
def test_linear_growth_has_no_knee() -> None:
    levels = [1, 2, 4, 8, 16, 32]
    assert find_knee(levels, [100 + 50 * c for c in levels]) is None  # contention: a straight line
    assert find_knee(levels, [100 * c for c in levels]) is None  # proportional (saturated throughput)
    assert find_knee(levels, [200, 205, 198, 210, 215, 220]) is None  # flat with noise
    assert find_knee([1, 2], [200, 230]) is None and find_knee([4], [100]) is None


def test_a_jump_is_a_knee_at_the_right_level() -> None:
    levels = [1, 2, 4, 8, 16, 32]
    flat_then_jump = [200, 210, 220, 240, 2500, 5200]
    assert find_knee(levels, flat_then_jump) == 4  # concurrency 16
    linear_then_jump = [100, 200, 300, 500, 3000, 6000]  # slope 50-100/level, then 312/level
    assert find_knee(levels, linear_then_jump) == 4
    assert find_knee([1, 2, 4, 8], [300, 320, 340, 2000]) == 3
    assert find_knee([1, 2, 4], [100, 900, 950]) == 1  # at the second level already (8x for 2x load)
    # a rise that is large relative to the trend but tiny in absolute terms is noise
    assert find_knee([1, 2, 4, 8], [10, 10.5, 10.6, 40]) is None


# ---- verdicts on synthetic experiments ---------------------------------------------------------------------------
def test_kv_capacity_knee_with_preemptions() -> None:
    sweep = [level(1, 200, 1500), level(2, 210, 1550), level(4, 230, 1650, kv=0.95),
             level(8, 2100, 3900, queue=1800, preempt=6, kv=1.0, waiting=4)]
    verdict, knee, findings, _ = analyze([], HEALTHY_B, sweep, TH)
    assert (verdict, knee) == (Verdict.KV_CAPACITY, 8)
    text = next(f.text for f in findings if f.kind == Verdict.KV_CAPACITY)
    assert "knee at concurrency 8" in text and "6 preemptions" in text and "last level within the trend: 4" in text
    assert "median TTFT 230 ms → 2100 ms" in text


def test_preemption_stalls_show_as_a_knee_in_the_itl_tail() -> None:
    # batch cost flat from 4 to 8 on this machine, so medians barely move; preempted requests stall in the ITL tail
    sweep = [level(1, 120, 1900, itl=57, itl_p99=68), level(2, 170, 3600, itl=112, itl_p99=143),
             level(4, 336, 4036, itl=117, itl_p99=138, kv=0.86),
             level(8, 566, 5548, itl=124, itl_p99=2042, queue=114, preempt=4, kv=1.0, waiting=4)]
    verdict, knee, findings, _ = analyze([], [], sweep, TH)
    assert (verdict, knee) == (Verdict.KV_CAPACITY, 8)
    assert "p99 ITL 138 ms → 2042 ms" in findings[0].text and "4 preemptions" in findings[0].text


def test_an_earlier_noise_knee_does_not_move_the_kv_knee() -> None:
    sweep = [level(1, 200, 1500), level(2, 210, 1550, itl_p99=400), level(4, 230, 1650),
             level(8, 2100, 3900, queue=1800, preempt=6, kv=1.0, waiting=4)]
    verdict, knee, _, _ = analyze([], HEALTHY_B, sweep, TH)
    assert (verdict, knee) == (Verdict.KV_CAPACITY, 8)


def test_kv_full_with_waiting_requests_counts_without_preemption() -> None:
    sweep = [level(1, 200, 1500), level(2, 210, 1550), level(4, 1900, 3300, queue=1700, kv=1.0, waiting=3)]
    verdict, knee, _, _ = analyze([], HEALTHY_B, sweep, TH)
    assert (verdict, knee) == (Verdict.KV_CAPACITY, 4)


def test_kv_limit_inside_linear_growth_is_found_by_the_servers_evidence() -> None:
    # throughput saturated from the start: latency doubles with every doubling, no sharper knee, but the server
    # preempted from concurrency 8 on
    sweep = [level(1, 100, 1000), level(2, 200, 2000), level(4, 400, 4000, kv=0.7),
             level(8, 800, 8000, preempt=3, kv=1.0, waiting=2)]
    verdict, knee, findings, _ = analyze([], [], sweep, TH)
    assert (verdict, knee) == (Verdict.KV_CAPACITY, 8)
    assert any("no sharper knee" in f.text for f in findings)


def test_knee_without_kv_but_with_queueing_is_queueing() -> None:
    # e.g. max_num_seqs = 4: the KV pool is far from full, requests wait for a slot
    sweep = [level(1, 200, 1500, queue=2, prefill=190), level(2, 210, 1550, queue=3, prefill=200),
             level(4, 230, 1650, queue=5, prefill=220), level(8, 1900, 3300, queue=1650, prefill=240)]
    verdict, knee, _, _ = analyze([], HEALTHY_B, sweep, TH)
    assert (verdict, knee) == (Verdict.QUEUEING, 8)


def test_knee_without_any_server_evidence() -> None:
    sweep = [level(1, 200, 1500), level(2, 210, 1550), level(4, 230, 4000)]
    verdict, knee, findings, _ = analyze([], HEALTHY_B, sweep, TH)
    assert (verdict, knee) == (Verdict.HEALTHY, None)  # queue flat, KV fine: noise or compute, not a verdict
    knee_text = next(f.text for f in findings if "knee at" in f.text)
    assert "knee at concurrency 4" in knee_text and "but no preemption" in knee_text
    bare = [level(c, t, e, queue=None, preempt=None, kv=None, waiting=None)
            for c, t, e in ((1, 200, 1500), (2, 210, 1550), (4, 230, 4000))]
    verdict, knee, findings, _ = analyze([], HEALTHY_B, bare, TH)
    assert (verdict, knee) == (Verdict.KV_CAPACITY, 4) and "unconfirmed" in findings[-1].text


def test_prefill_bound_from_prompt_shapes() -> None:
    a = [shape(1, 2048, 9000, queue=3, prefill=8990), shape(2, 2048, 8800, queue=2000, prefill=6500),
         shape(4, 2048, 8700, queue=1900, prefill=6600, itl=26)]
    verdict, knee, findings, itl_ref = analyze(a, [], [], TH)
    assert (verdict, knee, itl_ref) == (Verdict.PREFILL, None, 20.0)
    text = next(f.text for f in findings if f.kind == Verdict.PREFILL)
    assert "9000 ms" in text and "prefill share 100%" in text and "limit max(10 × ITL_ref, 250 ms) = 250 ms" in text


def test_splitting_the_same_tokens_into_queued_requests_is_queueing() -> None:
    a = [shape(1, 256, 120, queue=2, prefill=115), shape(2, 256, 150, queue=20, prefill=110),
         shape(4, 256, 900, queue=700, prefill=150)]
    verdict, _, findings, _ = analyze(a, HEALTHY_B, [], TH)
    assert verdict == Verdict.QUEUEING and any("serialized by the scheduler" in f.text for f in findings)
    # tiny prompts: 4 requests cost a few steps more than 1, but the extra is under the TTFT limit (10 × 53 ms)
    a = [shape(1, 64, 159, queue=1, prefill=155, itl=53), shape(4, 64, 611, queue=270, prefill=273, itl=60)]
    assert analyze(a, [decode_run(128, 53.0)], [], TH)[0] == Verdict.HEALTHY


def test_lone_request_waiting_in_queue_is_queueing() -> None:
    a = [shape(1, 256, 900, queue=800, prefill=100)]
    assert analyze(a, HEALTHY_B, [], TH)[0] == Verdict.QUEUEING


def test_decode_bound_from_output_length_and_from_concurrency() -> None:
    b = [decode_run(128, 20.0), decode_run(512, 26.0), decode_run(2048, 41.0)]
    verdict, _, findings, _ = analyze([], b, [], TH)
    assert verdict == Verdict.DECODE and any("grows 2.05×" in f.text for f in findings)
    # the shortest output runs again last: when it is slower too, the machine got busier, decode did not slow down
    drift = [decode_run(128, 20.0), decode_run(512, 25.0), decode_run(2048, 31.0)]
    assert analyze([], drift, [], TH)[0] == Verdict.DECODE
    assert analyze([], [*drift, decode_run(128, 24.0)], [], TH)[0] == Verdict.HEALTHY
    # concurrency: ITL triples while TTFT stays normal, latency linear (no knee)
    sweep = [level(1, 100, 1300, itl=20), level(2, 110, 2500, itl=38), level(4, 120, 5000, itl=75)]
    verdict, knee, findings, _ = analyze([], [], sweep, TH)
    assert (verdict, knee) == (Verdict.DECODE, None)
    assert any("ITL high, TTFT normal" in f.text for f in findings)


def test_slos_decide_what_is_high() -> None:
    b = [decode_run(128, 20.0), decode_run(512, 21.0)]
    assert analyze([], b, [], TH)[0] == Verdict.HEALTHY
    assert analyze([], b, [], Thresholds(slo_tpot_ms=15.0))[0] == Verdict.DECODE
    a = [shape(1, 512, 180, queue=1, prefill=178)]  # under the 250 ms floor: normal without an SLO
    assert analyze(a, b, [], TH)[0] == Verdict.HEALTHY
    assert analyze(a, b, [], Thresholds(slo_ttft_ms=100.0))[0] == Verdict.PREFILL


def test_healthy_lists_its_numbers_and_priority_order() -> None:
    a = [shape(1, 128, 90, queue=1, prefill=88), shape(4, 128, 100, queue=10, prefill=85)]
    sweep = [level(1, 90, 1400), level(2, 95, 1450, itl=22)]
    verdict, knee, findings, _ = analyze(a, HEALTHY_B, sweep, TH)
    assert (verdict, knee) == (Verdict.HEALTHY, None)
    summary = findings[-1].text
    assert summary.startswith("healthy: worst TTFT 114 ms ((c) concurrency 2") and "0 preemptions" in summary
    # several findings: the KV knee is the primary verdict, prefill is still listed
    a = [shape(1, 2048, 9000, queue=3, prefill=8990)]
    sweep = [level(1, 200, 1500), level(2, 210, 1550), level(4, 2100, 3900, preempt=2, kv=1.0)]
    verdict, knee, findings, _ = analyze(a, HEALTHY_B, sweep, TH)
    assert (verdict, knee) == (Verdict.KV_CAPACITY, 4)
    assert {f.kind for f in findings} >= {Verdict.KV_CAPACITY, Verdict.PREFILL}


def test_failed_requests_are_reported() -> None:
    bad = RunStats("(b) output 2048", 32, 2048, 1, concurrency=1, failed=1,
                   errors=["HTTP 400: prompt + max_tokens 2080 > 2048"])
    _, _, findings, _ = analyze([], [decode_run(128, 20.0), bad], [], TH)
    assert any("1 requests failed" in f.text and "2080" in f.text for f in findings)


# ---- report and CLI ----------------------------------------------------------------------------------------------
def test_report_has_tables_plots_and_verdict(tmp_path: Path) -> None:
    a = [shape(1, 2048, 9000, queue=3, prefill=8990), shape(4, 2048, 8700, queue=1900, prefill=6600)]
    sweep = [level(1, 200, 1500), level(2, 210, 1550), level(4, 2100, 3900, preempt=2, kv=1.0)]
    verdict, knee, findings, itl_ref = analyze(a, HEALTHY_B, sweep, TH)
    res = DiagnoseResult(verdict, knee, [str(f) for f in findings],
                         {"model": "模型-135m", "itl_ref_ms": itl_ref, "findings": [
                             {"kind": f.kind.value if f.kind else None, "knee_concurrency": f.knee_concurrency}
                             for f in findings]}, a, HEALTHY_B, sweep)
    path = write_report(res, tmp_path / "out")
    md = path.read_text(encoding="utf-8")
    for part in ("# pdserve diagnose: 模型-135m", "## (a)", "## (b)", "## (c)", "## Verdict",
                 "**kv-capacity-bound** — knee at concurrency 4", "![TTFT per shape](a_prompt_shapes.png)",
                 "Knee: concurrency 4, read as kv-capacity-bound", "| 1×2048 | 1/0 | 7200.0 | 9000.0 |"):
        assert part in md, part
    for png in ("a_prompt_shapes.png", "b_output_length.png", "c_concurrency.png"):
        assert (tmp_path / "out" / png).stat().st_size > 5000
    raw = json.loads((tmp_path / "out" / "diagnose.json").read_text(encoding="utf-8"))
    assert raw["verdict"] == "kv-capacity-bound" and raw["knee_concurrency"] == 4


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve")
    add_diagnose_parser(p.add_subparsers(dest="cmd", required=True))
    return p.parse_args(["diagnose", *argv])


def test_cli_options() -> None:
    cfg = config_from_args(parse("--scale", "0.25", "--experiments", "a,c", "--concurrency-levels", "8,1,2",
                                 "--slo-ttft-ms", "500", "--out", "x", "--handoff-gbps", "12.5"))
    assert cfg.scale == 0.25 and cfg.experiments == ("a", "c") and cfg.concurrency_levels == (1, 2, 8)
    assert cfg.slo_ttft_ms == 500.0 and cfg.out_dir == "x" and cfg.scaled(2048, 4) == 512
    assert parse().func.__name__ == "run_diagnose_cli"
    assert cfg.pd_rules == PDRules(handoff_gbps=12.5) and config_from_args(parse()).pd_rules == PDRules()
    assert cfg.thresholds == Thresholds(slo_ttft_ms=500.0)
    assert DiagnoseConfig(rules=Thresholds(itl_factor=2.0), slo_tpot_ms=30).thresholds == Thresholds(
        itl_factor=2.0, slo_tpot_ms=30.0)
    for bad in (dict(experiments=("d",)), dict(scale=0.0), dict(concurrency_levels=(0, 2)),
                dict(slo_tpot_ms=-1.0), dict(handoff_gbps=0.0)):
        with pytest.raises(BenchError):
            DiagnoseConfig(**bad)  # type: ignore[arg-type]


def test_cli_registered_and_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.cli import build_parser
    from pdserve.launch import free_port

    args = build_parser().parse_args(["diagnose", "--base-url", f"http://127.0.0.1:{free_port()}"])
    assert args.func(args) == 2
    assert "cannot reach" in capsys.readouterr().err


# ---- planted cases against real servers --------------------------------------------------------------------------
THREADS = ["--num-threads", "2"]  # the servers' compute threads: ServerCPUClock divides by them


class ServerCPUClock:
    """Seconds of CPU the server process's threads have run (/proc/PID/task/*/schedstat, ns), divided by its
    compute threads: about the wall time of an idle machine, where they run side by side. Latencies stamped by it
    count the server's own work (a request queued behind others waits while the server works on them), not the
    time a busy host kept the server off the cores, so a loaded machine cannot plant a problem. It needs idle
    OpenMP threads that sleep (OMP_WAIT_POLICY=PASSIVE, set by conftest): a spinning one would count its waiting.
    A thread that exits keeps its last reading: the clock never goes back."""

    def __init__(self, pid: int, threads: int = 2) -> None:
        self.task_dir = Path(f"/proc/{pid}/task")
        self.threads = threads
        self.per_thread: dict[str, int] = {}

    def __call__(self) -> float:
        for task in self.task_dir.iterdir():
            try:
                ns = int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # exited meanwhile
            self.per_thread[task.name] = max(ns, self.per_thread.get(task.name, 0))
        return sum(self.per_thread.values()) / 1e9 / self.threads


def run_diagnose(srv: ServerProc, out: Path, **kw: Any) -> DiagnoseResult:
    t0 = time.perf_counter()
    res = asyncio.run(diagnose(DiagnoseConfig(base_url=srv.base_url, out_dir=str(out), **kw),
                               ServerCPUClock(srv.proc.pid)))
    print(f"diagnose took {time.perf_counter() - t0:.1f} s", *res.verdict_lines(), sep="\n")
    assert res.report_path is not None and "## Verdict" in res.report_path.read_text(encoding="utf-8")
    return res


@pytest.fixture(scope="module")
def long_prompt_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """No chunked prefill: a 2048-token prompt is one forward pass."""
    srv = start_server(tmp_path_factory.mktemp("diag-prefill"), "--dtype", "float32", "--no-chunked-prefill",
                       "--max-num-batched-tokens", "4096", "--max-model-len", "4096", *THREADS)
    yield srv
    srv.stop()


@pytest.mark.slow
def test_planted_tiny_kv_pool_is_kv_capacity_bound(tmp_path: Path) -> None:
    # 14 blocks of 16 tokens: four sequences of 16 + 32 tokens (3 blocks each) fit, a fifth does not
    srv = start_server(tmp_path, "--dtype", "float32", "--num-kv-blocks", "14", "--max-num-seqs", "32", *THREADS)
    try:
        res = run_diagnose(srv, tmp_path / "kv", experiments=("c",), concurrency_levels=(1, 2, 4, 8),
                           sweep_prompt_len=16, sweep_output_len=32, requests_per_level=1.0)
    finally:
        srv.stop()
    assert res.verdict == Verdict.KV_CAPACITY, res.findings
    assert res.knee_concurrency == 8
    at_knee = res.sweep[-1]
    assert (at_knee.preemptions or 0) > 0 or (at_knee.kv_usage_peak or 0) >= 0.9
    assert all(not r.preemptions for r in res.sweep[:-2])  # 1 and 2 sequences fit easily
    # the PD advice read the real server's facts: its CPUs, its 2 threads, the fp32 KV of the default model
    assert res.deployment is not None and res.deployment.verdict != PDVerdict.UNDECIDED, res.deployment
    n = res.deployment.numbers
    assert n["cpus"] == len(os.sched_getaffinity(0)) and n["threads"] == 2 and n["rate_source"] == "assumed"
    assert res.evidence["deployment"]["verdict"] == res.deployment.verdict.value
    assert "## Deployment: PD disaggregation or colocated" in (res.report_path or Path()).read_text(encoding="utf-8")


@pytest.mark.slow
def test_planted_long_prompts_without_chunking_are_prefill_bound(long_prompt_server: ServerProc,
                                                                  tmp_path: Path) -> None:
    res = run_diagnose(long_prompt_server, tmp_path / "prefill", experiments=("a",), shape_total_tokens=2048,
                       shape_output_len=4)
    assert res.verdict == Verdict.PREFILL, res.findings
    one = res.shapes[0]
    assert one.label == "(a) 1×2048" and one.completed == 1
    assert one.prefill_share is not None and one.prefill_share > 0.9
    assert one.max_ttft_ms > 10 * (res.evidence["itl_ref_ms"] or 0)


@pytest.mark.slow
def test_healthy_small_load(long_prompt_server: ServerProc, tmp_path: Path) -> None:
    res = run_diagnose(long_prompt_server, tmp_path / "healthy", scale=1 / 32, concurrency_levels=(1, 2))
    assert res.verdict == Verdict.HEALTHY, res.findings
    assert res.knee_concurrency is None and res.findings[-1].startswith("[info] (-) healthy: worst TTFT")
    assert [r.label for r in res.output_lengths] == ["(b) output 4", "(b) output 16", "(b) output 64",
                                                      "(b) output 4 again"]
    assert [len(res.shapes), len(res.sweep)] == [3, 2] and all(r.failed == 0 for r in res.sweep)

"""`pdserve bench`: metric rules, arrival schedule, datasets and file encodings, SSE parsing (fast); and against a
real `pdserve serve` (slow): counts equal the server's counters, client TTFT >= server TTFT, failures counted."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench import add_bench_parser
from pdserve.bench.client import RequestRecord, Target, build_body, send_request
from pdserve.bench.config import BenchConfig, BenchError, parse_goodput
from pdserve.bench.datasets import (
    DatasetError,
    SampleRequest,
    load_file,
    parse_sharegpt,
    prefix_repetition_dataset,
    random_dataset,
    read_text,
)
from pdserve.bench.report import BenchResult, compute_metrics, format_result
from pdserve.bench.runner import arrival_times, run_benchmark
from pdserve.bench.server_metrics import histogram_quantile, parse_metrics, server_deltas
from pdserve.launch import ServerProc


def rec(i: int, ttft: float, itl: list[float], e2el: float, out: int, prompt: int = 10, ok: bool = True,
        error: str = "") -> RequestRecord:
    return RequestRecord(i, prompt, out, success=ok, error=error, ttft=ttft, itl=itl, e2el=e2el, output_len=out,
                         num_chunks=len(itl) + 1 if ok else 0)


def parse_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve")
    add_bench_parser(p.add_subparsers(dest="cmd", required=True))
    return p.parse_args(["bench", *argv])


# ---- metrics -----------------------------------------------------------------------------------------------------
def test_tpot_itl_percentiles_and_failures() -> None:
    records = [rec(0, 0.1, [0.02, 0.03, 0.05], 0.2, 4),  # tpot = (0.2-0.1)/3
               rec(1, 0.3, [0.01], 0.5, 2, prompt=20),  # tpot = 0.2
               rec(2, 0.05, [], 0.05, 1),  # one token: no TPOT sample
               rec(3, 0, [], 0.01, 0, ok=False, error="HTTP 400: too long")]
    m = compute_metrics(records, duration=2.0, goodput={}, percentiles=(90.0, 99.0))
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["total_input_tokens"] == 40 and m["total_output_tokens"] == 7
    assert m["request_throughput"] == pytest.approx(1.5) and m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(23.5)
    assert records[0].tpot == pytest.approx(0.1 / 3) and records[2].tpot == 0.0 and records[3].tpot == 0.0
    assert m["mean_tpot_ms"] == pytest.approx((100 / 3 + 200) / 2)
    assert m["mean_ttft_ms"] == pytest.approx(150) and m["median_ttft_ms"] == pytest.approx(100)
    itl_ms = [20, 30, 50, 10]
    assert m["mean_itl_ms"] == pytest.approx(np.mean(itl_ms))
    assert m["p99_itl_ms"] == pytest.approx(np.percentile(itl_ms, 99))
    assert m["p90_e2el_ms"] == pytest.approx(np.percentile([200, 500, 50], 90))
    assert m["request_goodput"] is None and m["max_concurrent_requests"] == 4


def test_goodput_counts_requests_meeting_every_slo() -> None:
    records = [rec(0, 0.1, [0.02] * 3, 0.16, 4), rec(1, 0.6, [0.02], 0.62, 2), rec(2, 0.1, [0.2], 0.3, 2),
               rec(3, 0, [], 0, 0, ok=False, error="x")]
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    m = compute_metrics(records, 1.0, parse_goodput(["ttft:500", "tpot:50"]), (99.0,))
    assert m["request_goodput"] == pytest.approx(1.0)  # only request 0 meets both
    m = compute_metrics(records, 2.0, {"ttft": 500.0}, (99.0,))
    assert m["request_goodput"] == pytest.approx(1.0)  # requests 0 and 2, over 2 s
    for bad in (["ttft"], ["foo:1"], ["ttft:abc"], ["tpot:0"]):
        with pytest.raises(BenchError):
            parse_goodput(bad)


def test_peak_concurrency_and_throughput() -> None:
    a = rec(0, 0.5, [0.25, 0.25], 1.0, 3)
    b = rec(1, 0.1, [], 0.2, 1)
    b.send = 1.05
    c = rec(2, 0.1, [], 0.2, 1)
    c.send = 1.0  # starts exactly when `a` ends: not concurrent with it
    m = compute_metrics([a, b, c], 1.25, {}, (99.0,))
    assert m["max_concurrent_requests"] == 2  # b and c
    assert m["max_output_tokens_per_s"] == pytest.approx(3.0)  # second 1: a's last token, c at 1.1, b at 1.15


def test_result_block_and_json_use_vllm_names(tmp_path: Path) -> None:
    cfg = BenchConfig(max_concurrency=2, goodput={"ttft": 1000.0})
    records = [rec(0, 0.1, [0.02], 0.12, 2), rec(1, 0, [], 0.01, 0, ok=False, error="HTTP 404: model 'x'")]
    records[0].generated_text = "你好，世界"
    res = BenchResult(cfg, "smollm2-135m", "smollm2-135m", records, 1.0, date="20250101-000000")
    text = format_result(res)
    for line in ("Successful requests:                     1", "Failed requests:                         1",
                 "Maximum request concurrency:             2", "Request goodput (req/s):",
                 "Mean TTFT (ms):                          100.00", "P99 ITL (ms):", "Median E2EL (ms):",
                 "-----Time per Output Token (excl. 1st token)------", "    1x HTTP 404: model 'x'"):
        assert line in text, line
    assert text.splitlines()[0] == "============ Serving Benchmark Result ============"
    path = res.save(tmp_path / "r.json")
    raw = path.read_text(encoding="utf-8")
    assert "你好，世界" in raw  # ensure_ascii=False
    d = json.loads(raw)
    for key in ("completed", "failed", "total_input_tokens", "total_output_tokens", "mean_ttft_ms", "p99_itl_ms",
                "median_tpot_ms", "p90_e2el_ms", "request_goodput", "output_throughput", "ttfts", "itls",
                "errors"):
        assert key in d, key
    assert d["request_rate"] == "inf" and d["errors"] == ["", "HTTP 404: model 'x'"]
    assert [r["success"] for r in d["per_request"]] == [True, False]
    assert d["per_request"][0]["tpot"] == pytest.approx(0.02)


# ---- arrival schedule --------------------------------------------------------------------------------------------
def test_arrival_schedule_statistics() -> None:
    assert arrival_times(5, math.inf).tolist() == [0.0] * 5
    t = arrival_times(20000, rate=10.0, burstiness=1.0, seed=1)
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    bursty = np.diff(arrival_times(20000, rate=10.0, burstiness=0.25, seed=1))
    assert bursty.mean() == pytest.approx(0.1, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.07)  # gamma(k): CV 1/sqrt(k)
    assert np.array_equal(arrival_times(50, 3.0, 1.0, seed=7), arrival_times(50, 3.0, 1.0, seed=7))
    assert not np.array_equal(arrival_times(50, 3.0, 1.0, seed=7), arrival_times(50, 3.0, 1.0, seed=8))


# ---- datasets ----------------------------------------------------------------------------------------------------
def test_random_dataset_lengths(tokenizer: Any) -> None:
    ids = random_dataset(tokenizer, 8, 64, 16, seed=0, token_ids=True)
    assert all(len(s.prompt) == s.prompt_len == 64 and s.output_len == 16 for s in ids)
    special = set(tokenizer.all_special_ids)
    assert not any(t in special for s in ids for t in s.prompt)  # type: ignore[union-attr]
    text = random_dataset(tokenizer, 8, 64, 16, range_ratio=0.5, seed=0)
    for s in text:
        assert isinstance(s.prompt, str) and 8 <= s.output_len <= 24
        assert s.prompt_len == len(tokenizer.encode(s.prompt))
        assert 32 - 2 <= s.prompt_len <= 96 + 2
    exact = random_dataset(tokenizer, 8, 100, 4, seed=3)
    assert sum(s.prompt_len == 100 for s in exact) >= 6  # decode -> encode lands on the target length
    assert [s.prompt for s in random_dataset(tokenizer, 3, 20, 4, seed=5)] == [
        s.prompt for s in random_dataset(tokenizer, 3, 20, 4, seed=5)]


def test_prefix_repetition_shares_prefixes(tokenizer: Any) -> None:
    samples = prefix_repetition_dataset(tokenizer, 12, prefix_len=32, suffix_len=8, num_prefixes=3, output_len=5,
                                        seed=0, token_ids=True)
    assert len(samples) == 12 and all(s.prompt_len == 40 and s.output_len == 5 for s in samples)
    by_prefix: dict[int | None, set[tuple[int, ...]]] = {}
    for s in samples:
        by_prefix.setdefault(s.prefix_id, set()).add(tuple(s.prompt[:32]))  # type: ignore[index]
    assert sorted(by_prefix) == [0, 1, 2] and all(len(v) == 1 for v in by_prefix.values())
    assert len({next(iter(v)) for v in by_prefix.values()}) == 3
    text = prefix_repetition_dataset(tokenizer, 6, 32, 8, 2, 5, seed=0)
    firsts = {s.prefix_id: s.prompt for s in text}
    assert all(s.prompt[:20] == firsts[s.prefix_id][:20] for s in text)  # type: ignore[index]


GBK_ROWS = [{"prompt": "用一句话描述春天：", "output_len": 8}, {"prompt": "北京的天气怎么样？"}]


def test_gbk_file_with_encoding_and_offset_error(tmp_path: Path) -> None:
    path = tmp_path / "zh.jsonl"
    data = "\n".join(json.dumps(r, ensure_ascii=False) for r in GBK_ROWS).encode("gbk")
    path.write_bytes(data)
    samples = load_file(path, "file", "gbk", None, None, 3)
    assert [s.prompt for s in samples] == ["用一句话描述春天：", "北京的天气怎么样？", "用一句话描述春天："]
    assert [s.output_len for s in samples] == [8, 128, 8]
    first_bad = next(i for i, b in enumerate(data) if b >= 0x80)
    with pytest.raises(DatasetError) as e:
        read_text(path)
    msg = str(e.value)
    assert f"byte offset {first_bad}" in msg and "line 1" in msg and "--encoding" in msg and str(path) in msg
    assert load_file(path, "jsonl", "gbk", None, 4, 1)[0].output_len == 4  # --output-len overrides rows
    with pytest.raises(DatasetError, match="unknown --encoding"):
        read_text(path, "no-such-codec")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": \n', encoding="utf-8")
    with pytest.raises(DatasetError, match="line 2"):
        load_file(bad, "jsonl", "utf-8", None, None, 1)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": [1, 2, 3]}).encode())
    assert load_file(bom, "file", "utf-8", None, None, 1) == [SampleRequest([1, 2, 3], 3, 128)]
    bom.write_bytes(b"\xef\xbb\xbf" + data)  # offsets count the BOM too
    with pytest.raises(DatasetError, match=f"byte offset {first_bad + 3} "):
        read_text(bom)


def test_sharegpt_parsing(tmp_path: Path, tokenizer: Any) -> None:
    rows = [
        {"id": "a", "conversations": [{"from": "system", "value": "be nice"}, {"from": "human", "value": "Hi there"},
                                      {"from": "gpt", "value": "Hello! How can I help you today?"},
                                      {"from": "human", "value": "later turn"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "no answer"}]},
        {"id": "c", "conversations": [{"from": "gpt", "value": "answer first"}, {"from": "human", "value": "你好"},
                                      {"from": "gpt", "value": "你好！"}]},
        {"id": "d"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    samples = load_file(path, "file", "utf-8", tokenizer, None, 2)
    assert [s.prompt for s in samples] == ["Hi there", "你好"]
    assert samples[0].output_len == len(tokenizer.encode("Hello! How can I help you today?"))
    assert samples[1].prompt_len == len(tokenizer.encode("你好"))
    assert [s.output_len for s in parse_sharegpt(path.read_text(), path, None, 7)] == [7, 7]
    with pytest.raises(DatasetError, match="tokenizer"):
        parse_sharegpt(path.read_text(), path, None, None)
    with pytest.raises(DatasetError, match="no ShareGPT entry"):
        parse_sharegpt(json.dumps([rows[1]]), "x.json", tokenizer, None)


# ---- server metrics ----------------------------------------------------------------------------------------------
PROM = """# TYPE {p}:request_queue_time_seconds histogram
{p}:request_queue_time_seconds_bucket{{le="0.1",model_name="m"}} {a}
{p}:request_queue_time_seconds_bucket{{le="1.0",model_name="m"}} {b}
{p}:request_queue_time_seconds_bucket{{le="+Inf",model_name="m"}} {b}
{p}:request_queue_time_seconds_count{{model_name="m"}} {b}
{p}:request_queue_time_seconds_sum{{model_name="m"}} {s}
# TYPE {p}:prompt_tokens counter
{p}:prompt_tokens_total{{model_name="m"}} {tok}
# TYPE {p}:request_success counter
{p}:request_success_total{{finished_reason="stop",model_name="m"}} {b}
{p}:request_success_total{{finished_reason="length",model_name="m"}} 1
"""


@pytest.mark.parametrize("prefix", ["pdserve", "vllm"])
def test_server_deltas_from_prometheus_text(prefix: str) -> None:
    before = parse_metrics(PROM.format(p=prefix, a=2, b=2, s=0.1, tok=10))
    after = parse_metrics(PROM.format(p=prefix, a=4, b=12, s=5.1, tok=110))
    st = server_deltas(before, after)
    assert st is not None and st.prefix == prefix
    assert st.num_requests == 10 and st.prompt_tokens == 100 and st.generation_tokens == 0
    q = st.phases["queue"]
    assert q.count == 10 and q.mean_ms == pytest.approx(500.0)
    # 2 of 10 under 0.1 s, 8 in (0.1, 1]: the median interpolates to 0.1 + 0.9 * 3/8
    assert q.p50_ms == pytest.approx(1000 * (0.1 + 0.9 * 3 / 8))
    assert histogram_quantile(0.5, {}) is None and histogram_quantile(0.99, {1.0: 0, math.inf: 3}) == 1.0
    assert server_deltas(None, after) is None


# ---- client (SSE parsing against an in-process transport) --------------------------------------------------------
def sse(*objs: Any) -> bytes:
    return b"".join(f"data: {o if isinstance(o, str) else json.dumps(o)}\n\n".encode() for o in objs)


def run_client(handler: Any, chat: bool = False, clock: Any = time.perf_counter) -> RequestRecord:
    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            target = Target("http://x/v1/chat/completions" if chat else "http://x/v1/completions", "m", chat)
            return await send_request(http, target, SampleRequest("hi", 1, 3), RequestRecord(0, 1, 3), 0.0, clock)

    return asyncio.run(go())


def test_client_stamps_latencies_with_the_injected_clock() -> None:
    """A clock that advances one "second" per reading: the send, then one reading per data line (the first text
    chunk, a text chunk, an empty-text chunk, the usage chunk, [DONE]), then the end of the stream."""
    ticks = iter(range(100))
    d = {"id": "c"}
    r = run_client(lambda req: httpx.Response(200, content=sse(
        {**d, "choices": [{"index": 0, "text": "你"}]}, {**d, "choices": [{"index": 0, "text": "好"}]},
        {**d, "choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
        {**d, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}, "[DONE]")),
        clock=lambda: float(next(ticks)))
    assert r.success and (r.ttft, r.itl, r.e2el) == (1.0, [1.0], 6.0) and r.tpot == 5.0


def test_client_streams_chat_and_reads_usage() -> None:
    seen: list[dict[str, Any]] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(json.loads(req.content))
        d = {"id": "chatcmpl-1"}
        return httpx.Response(200, content=sse(
            {**d, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},  # not a token
            {**d, "choices": [{"index": 0, "delta": {"content": "你"}}]},
            {**d, "choices": [{"index": 0, "delta": {"content": "好"}, "finish_reason": None}]},
            {**d, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
            {**d, "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3,
                                           "prompt_tokens_details": {"cached_tokens": 4}}},
            "[DONE]"))

    r = run_client(handler, chat=True)
    assert r.success and r.generated_text == "你好" and r.num_chunks == 2 and len(r.itl) == 1
    assert (r.prompt_len, r.output_len, r.cached_tokens, r.finish_reason) == (9, 3, 4, "length")
    assert r.request_id == "chatcmpl-1" and 0 < r.ttft <= r.e2el
    body = seen[0]
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["max_completion_tokens"] == 3
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert "top_p" not in body  # sent only when below 1
    target = Target("http://x/v1/completions", "m", False, 0.8, top_p=0.95)
    assert build_body(target, SampleRequest("hi", 1, 3))["top_p"] == 0.95


def test_client_records_errors() -> None:
    r = run_client(lambda req: httpx.Response(400, json={"error": {"message": "prompt too long (2048)"}}))
    assert not r.success and r.status_code == 400 and r.error == "HTTP 400: prompt too long (2048)"
    r = run_client(lambda req: httpx.Response(200, content=sse(
        {"id": "c", "choices": [{"index": 0, "text": "a"}]}, {"error": {"message": "engine died"}}, "[DONE]")))
    assert not r.success and r.error == "stream error: engine died"
    r = run_client(lambda req: httpx.Response(200, content=sse("[DONE]")))
    assert not r.success and "no text" in r.error

    def refuse(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    r = run_client(refuse)
    assert not r.success and r.error == "ConnectError: connection refused"


def test_cli_options_and_validation() -> None:
    from pdserve.bench.cli import config_from_args

    cfg = config_from_args(parse_args("--request-rate", "inf", "--goodput", "ttft:200", "tpot:30",
                                      "--metric-percentiles", "50,99.9", "--max-concurrency", "4", "--save-result"))
    assert math.isinf(cfg.request_rate) and cfg.goodput == {"ttft": 200.0, "tpot": 30.0}
    assert config_from_args(parse_args("--temperature", "0.8", "--top-p", "0.95")).top_p == 0.95
    assert cfg.metric_percentiles == (50.0, 99.9) and cfg.max_concurrency == 4 and cfg.save_result == ""
    assert cfg.dataset_kind == "random" and BenchConfig(dataset_path="x.jsonl").dataset_kind == "file"
    for bad in (dict(endpoint="/v1/embeddings"), dict(dataset_name="jsonl"), dict(request_rate=0.0),
                dict(prompt_token_ids=True, endpoint="/v1/chat/completions"), dict(max_concurrency=0)):
        with pytest.raises(BenchError):
            BenchConfig(**bad)  # type: ignore[arg-type]


def test_cli_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.launch import free_port

    args = parse_args("--base-url", f"http://127.0.0.1:{free_port()}", "--disable-tqdm")
    assert args.func(args) == 2
    assert "cannot reach" in capsys.readouterr().err


# ---- against a real server ---------------------------------------------------------------------------------------
def server_counters(srv: ServerProc) -> dict[str, float]:
    """/metrics samples summed over labels (other than `le`)."""
    flat: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(srv.base_url + "/metrics").text):
        for s in fam.samples:
            if "le" not in s.labels:
                flat[s.name] = flat.get(s.name, 0.0) + s.value
    return flat


def request_log(srv: ServerProc, ids: set[str], timeout: float = 10.0) -> dict[str, dict[str, Any]]:
    """The server's per-request JSON log lines for response ids `ids` (id `cmpl-x` logs as `cmpl-x-0-0`)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [json.loads(ln.split("pdserve.requests: ", 1)[1]) for ln in srv.log().splitlines()
                 if "pdserve.requests: " in ln]
        found = {rec["request_id"].rsplit("-", 2)[0]: rec for rec in lines}
        if ids <= set(found) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(real_server_fp32: ServerProc) -> ServerProc:
    """The session's fp32 default-model server (conftest), shared with tests/test_client_timings.py: the bench
    reads counter deltas around its own run and finds its requests in the log by id."""
    return real_server_fp32


@pytest.fixture(scope="module")
def random_run(server: ServerProc) -> tuple[BenchResult, dict[str, float]]:
    """12 random prompts (64 in, 16 out, ignore_eos, 4 at a time) and the server's counter deltas around them."""
    cfg = BenchConfig(base_url=server.base_url, num_prompts=12, random_input_len=64, random_output_len=16,
                      ignore_eos=True, max_concurrency=4, disable_tqdm=True, seed=1)
    before = server_counters(server)
    res = asyncio.run(run_benchmark(cfg))
    after = server_counters(server)
    return res, {k: after[k] - before.get(k, 0.0) for k in after}


@pytest.mark.slow
def test_counts_equal_server_counters(random_run: tuple[BenchResult, dict[str, float]]) -> None:
    res, delta = random_run
    m = res.summary()
    assert (m["completed"], m["failed"]) == (12, 0), res.errors()
    assert m["total_output_tokens"] == 12 * 16 == delta["pdserve:generation_tokens_total"]
    assert m["total_input_tokens"] == delta["pdserve:prompt_tokens_total"]
    assert abs(m["total_input_tokens"] - 12 * 64) <= 12  # re-encoded random text lands on (about) 64 tokens
    assert m["completed"] == delta["pdserve:request_success_total"]
    # the bench's own reading of /metrics says the same
    assert (m["server_num_requests"], m["server_prompt_tokens"], m["server_generation_tokens"]) == (
        12, m["total_input_tokens"], m["total_output_tokens"])
    assert m["server_num_errors"] == 0 and m["max_concurrent_requests"] == 4
    assert all(r.output_len_source == "usage" and r.finish_reason == "length" for r in res.records)
    assert all(len(r.itl) == r.num_chunks - 1 and r.ttft <= r.e2el for r in res.records)


@pytest.mark.slow
def test_client_ttft_never_below_server(server: ServerProc, random_run: tuple[BenchResult, dict[str, float]]) -> None:
    res, _ = random_run
    ids = {r.request_id for r in res.records if r.request_id}
    assert len(ids) == 12
    logged = request_log(server, ids)
    for r in res.records:
        srv = logged[r.request_id]  # type: ignore[index]
        assert r.ttft >= srv["ttft_s"], (r.request_id, r.ttft, srv)
        assert r.e2el >= srv["e2e_s"] and r.prompt_len == srv["prompt_tokens"]
    m = res.summary()
    assert m["mean_ttft_ms"] >= m["server_mean_ttft_ms"]
    assert m["server_mean_ttft_ms"] == pytest.approx(m["server_mean_queue_ms"] + m["server_mean_prefill_ms"],
                                                     abs=1e-3)


@pytest.mark.slow
def test_failures_counted_with_their_errors(server: ServerProc, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"prompt": "用一句话描述春天："}, {"prompt": "hello " * 2100}, {"prompt": "北京在哪里？"},
            {"prompt": "你好" * 2100}]
    data = tmp_path / "mixed.jsonl"
    data.write_bytes("\n".join(json.dumps(r, ensure_ascii=False) for r in rows).encode("gbk"))
    out = tmp_path / "out"
    args = parse_args("--base-url", server.base_url, "--endpoint", "/v1/chat/completions", "--dataset-path",
                      str(data), "--encoding", "gbk", "--num-prompts", "4", "--output-len", "6", "--ignore-eos",
                      "--num-warmups", "1", "--disable-tqdm", "--save-result", str(out / "r.json"), "--plot",
                      str(out))
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "Successful requests:                     2" in printed
    assert "Failed requests:                         2" in printed and "2048" in printed
    d = json.loads((out / "r.json").read_text(encoding="utf-8"))
    assert (d["completed"], d["failed"], d["total_output_tokens"]) == (2, 2, 12)
    failed = [r for r in d["per_request"] if not r["success"]]
    assert [r["index"] for r in failed] == [1, 3]
    assert all(r["status_code"] == 400 and r["error"].startswith("HTTP 400: ") and "2048" in r["error"]
               for r in failed)
    # the warm-up ran before the "before" read: the server saw exactly the measured requests
    assert (d["server_num_requests"], d["server_num_errors"]) == (2, 2)
    assert all((out / f).stat().st_size > 1000 for f in ("ttft.png", "itl.png", "timeline.png"))


@pytest.mark.slow
def test_wrong_model_fails_every_request(server: ServerProc, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args("--base-url", server.base_url, "--model", "gpt-9", "--num-prompts", "3",
                      "--random-input-len", "8", "--random-output-len", "2", "--tokenizer", "smollm2-135m",
                      "--disable-tqdm")
    assert args.func(args) == 1
    printed = capsys.readouterr().out
    assert "Failed requests:                         3" in printed and "3x HTTP 404: model 'gpt-9'" in printed

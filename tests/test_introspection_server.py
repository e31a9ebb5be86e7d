"""Profiler by phase, per-request explanations and OpenTelemetry traces over real HTTP: the app under uvicorn in a
thread on a tiny in-memory model (in-process, so the SDK's in-memory span exporter sees the spans)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pdserve.config import EngineConfig
from pdserve.engine import explain
from pdserve.engine.engine import LLMEngine
from pdserve.server.app import ServerConfig, create_app

from conftest import loaded_from_hf, serve_app

otel = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter",
                           reason="the otel extra is not installed (pip install 'pdserve[otel]')")
KEY = "secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_hf_model: Any, tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from pdserve.server.tracing import RequestTracer

    engine = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=256, max_model_len=1024,
                                    max_num_batched_tokens=32, max_step_ms=0), model=loaded_from_hf(tiny_hf_model),
                       tokenizer=tokenizer)
    prof_dir = tmp_path_factory.mktemp("profiles")
    app = create_app(engine, ServerConfig(served_model_name="tiny", api_key=KEY, explain_itl_threshold="1e-9",
                                          profiler_dir=str(prof_dir)))
    exporter = otel.InMemorySpanExporter()
    tracer = RequestTracer(None, "tiny", exporter=exporter)
    served = app.state.registry.default()
    for serving in (served.serving_completion, served.serving_chat, served.serving_embedding):
        serving.tracer = tracer
    base, stop = serve_app(app)
    yield base, exporter, prof_dir
    stop()


def at_baseline(base: str) -> None:
    deadline = time.monotonic() + 30
    while (kv := httpx.get(base + "/debug/kv", headers=AUTH).json())["num_used_blocks"] or kv["open_requests"]:
        assert time.monotonic() < deadline, kv
        time.sleep(0.05)


def test_routes_need_the_key_and_check_state(server: Any) -> None:
    base = server[0]
    for path in ("/start_profile", "/stop_profile"):
        assert httpx.post(base + path).status_code == 401
    assert httpx.get(base + "/debug/requests/x").status_code == 401
    r = httpx.post(base + "/stop_profile", headers=AUTH)
    assert r.status_code == 409 and r.json()["error"]["code"] == "profiler_state"
    r = httpx.post(base + "/start_profile", headers=AUTH, json={"num_steps": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "num_steps"
    r = httpx.get(base + "/debug/requests/nope", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found"


def test_profile_ranks_ops_per_step_kind_and_writes_a_trace(server: Any, tokenizer: Any) -> None:
    base, _, prof_dir = server
    prompt = "你好，世界 " * 8
    steps = -(-len(tokenizer.encode(prompt)) // 32) + 3  # its 32-token prefill chunks, then 3 decodes
    r = httpx.post(base + "/start_profile", headers=AUTH, json={"num_steps": steps})
    assert r.json() == {"status": "started", "num_steps": steps}
    assert httpx.post(base + "/start_profile", headers=AUTH).status_code == 409
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)
    client.completions.create(model="tiny", prompt=prompt, max_tokens=8, extra_body={"ignore_eos": True})
    r = httpx.post(base + "/stop_profile", headers=AUTH, json={"wait_s": 30}, timeout=60)
    assert r.status_code == 200
    rep = r.json()
    assert rep["num_steps"] == steps and set(rep["kinds"]) == {"prefill", "decode"}
    assert rep["kinds"]["decode"]["steps"] == 3
    dec = rep["kinds"]["decode"]
    assert dec["top_ops"] and dec["top_ops"][0]["self_ms"] > 0 and dec["ops_per_step"] > 0
    assert sum(k["steps"] for k in rep["kinds"].values()) == steps
    assert "Reading: decode:" in rep["table"] and "| op |" in rep["table"]
    trace = Path(rep["trace_path"])
    assert trace.parent == prof_dir
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert "pdserve.step" in names and "pdserve.forward.decode" in names
    at_baseline(base)


def test_a_stalled_request_names_the_prefill_that_stalled_it(server: Any, caplog: pytest.LogCaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A streams; B's long prompt arrives mid-stream and its 32-token chunks share A's steps: A's explanation
    (endpoint and log line) names B's sequence and the chunk sizes. Both requests are traced; A under the caller's
    traceparent. Every gap is explained here (no MAX_STALLS cut): on a shared machine the largest of A's ~1000 gaps
    can be the host's hiccups rather than B's small chunks; which gaps rank first is test_explain.py's matter."""
    monkeypatch.setattr(explain, "MAX_STALLS", 100_000)
    base, exporter, _ = server
    exporter.clear()
    parent_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {**AUTH, "traceparent": f"00-{parent_trace}-00f067aa0ba902b7-01"}
    ids: dict[str, str] = {}
    b_done = threading.Event()

    def send_b() -> None:
        r = httpx.post(base + "/v1/completions", headers=AUTH, timeout=120,
                       json={"model": "tiny", "prompt": "长的提示 " * 120, "max_tokens": 2})
        ids["B"] = r.json()["id"]
        b_done.set()

    caplog.set_level(logging.INFO, logger="pdserve.requests")
    with httpx.stream("POST", base + "/v1/completions", headers=headers, timeout=120,
                      # long enough that B arrives while A decodes, even on a loaded machine (max_model_len 1024)
                      json={"model": "tiny", "prompt": "hello", "max_tokens": 1000, "ignore_eos": True,
                            "stream": True}) as resp:
        for n, line in enumerate(resp.iter_lines()):
            if line.startswith("data: {"):
                ids["A"] = json.loads(line[6:])["id"]
                if n == 4:
                    threading.Thread(target=send_b, daemon=True).start()
    assert b_done.wait(120)
    r = httpx.get(base + f"/debug/requests/{ids['A']}", headers=AUTH)
    [a] = r.json()["data"]
    assert a["request_id"] == f"{ids['A']}-0-0" and a["finish_reason"] == "length"
    chunks = [c for s in a["stalls"] for c in s["causes"] if c["cause"] == "prefill_chunk"]
    assert chunks and {c["request_id"] for c in chunks} == {f"{ids['B']}-0-0"}
    assert all(0 < c["tokens"] <= 32 for c in chunks)
    [b] = httpx.get(base + f"/debug/requests/{ids['B']}-0-0", headers=AUTH).json()["data"]
    assert sum(e["tokens"] for e in b["timeline"] if e["event"] == "prefill_chunk") > 100
    logged = [json.loads(r.getMessage()) for r in caplog.records if r.name == "pdserve.requests"]
    [line] = [x for x in logged if x["request_id"] == f"{ids['A']}-0-0"]
    assert line["explain"]["stalls"] == a["stalls"]
    spans = exporter.get_finished_spans()
    roots = {s.attributes["gen_ai.request.id"]: s for s in spans if s.name == "llm_request"}
    root_a = roots[f"{ids['A']}-0-0"]
    assert format(root_a.context.trace_id, "032x") == parent_trace
    kids = {s.name for s in spans if s.parent is not None and s.parent.span_id == root_a.context.span_id}
    assert kids == {"queue", "prefill", "decode"}
    assert roots[f"{ids['B']}-0-0"].attributes["gen_ai.usage.completion_tokens"] == 2
    at_baseline(base)


def test_profile_command_against_the_server(server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`pdserve profile --base-url` starts, waits for its steps under traffic, and writes the report files."""
    from pdserve.cli import main

    base = server[0]
    traffic = threading.Thread(target=lambda: httpx.post(
        base + "/v1/completions", headers=AUTH, timeout=120,
        json={"model": "tiny", "prompt": "hello", "max_tokens": 400, "ignore_eos": True}))
    traffic.start()  # decoding while the command profiles
    rc = [main(["profile", "--base-url", base, "--api-key", KEY, "--steps", "4", "--timeout", "60",
                "--out", str(tmp_path)])]
    traffic.join(120)
    assert rc == [0]
    report = json.loads((tmp_path / "profile.json").read_text())
    assert report["num_steps"] == 4 and "Reading:" in (tmp_path / "profile.md").read_text()
    assert list(tmp_path.glob("pdserve-trace-*.json"))  # same machine: the trace is copied along
    assert "| op |" in capsys.readouterr().out

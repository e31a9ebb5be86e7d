"""Faults inside the engine fail the affected requests (500 with an OpenAI error body), never the server.
Runs the real app under uvicorn in a thread, on a tiny in-memory model, so faults can be injected."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.server.app import ServerConfig, create_app

from conftest import loaded_from_hf, serve_app


@pytest.fixture(scope="module")
def app_server(tiny_hf_model: Any, tokenizer: Any) -> Iterator[tuple[str, LLMEngine]]:
    engine = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=128), model=loaded_from_hf(tiny_hf_model),
                       tokenizer=tokenizer)
    app = create_app(engine, ServerConfig(served_model_name="tiny"))
    base, stop = serve_app(app)
    yield base, engine
    stop()


def _poison(engine: LLMEngine, marker: str) -> None:
    """Requests whose prompt contains `marker` blow up in postprocess (their detokenizer, in the output
    processor)."""
    processor = engine.output_processor
    original = processor.add_request

    def add_request(req: Any) -> None:
        original(req)
        if req.prompt is not None and marker in req.prompt:
            def boom(*_: Any, **__: Any) -> None:
                raise RuntimeError("poisoned request")
            processor.states[req.request_id].detokenizer.update = boom  # type: ignore[method-assign]

    processor.add_request = add_request  # type: ignore[method-assign]


def test_request_failure_is_isolated(app_server: tuple[str, LLMEngine]) -> None:
    base, engine = app_server
    _poison(engine, "FAIL_ME")
    r = httpx.post(base + "/v1/completions", json={"prompt": "FAIL_ME please", "max_tokens": 5}, timeout=30)
    assert r.status_code == 500
    assert "poisoned" in r.json()["error"]["message"] and r.json()["error"]["type"] == "internal_error"
    assert r.json()["error"]["code"] == "postprocess_failed"  # the child's ErrorCode, for clients and the router
    with httpx.stream("POST", base + "/v1/completions", json={"prompt": "FAIL_ME", "max_tokens": 5, "stream": True},
                      timeout=30) as resp:
        events = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert [e["code"] for e in errors] == ["postprocess_failed"]
    ok = httpx.post(base + "/v1/completions", json={"prompt": "fine", "max_tokens": 5, "ignore_eos": True},
                    timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
    assert engine.block_manager.is_at_baseline()


def test_failed_model_step_fails_its_requests_only(app_server: tuple[str, LLMEngine]) -> None:
    base, engine = app_server
    real_execute = engine.runner.execute
    calls = {"n": 0}

    def flaky(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel failure")
        return real_execute(*args)

    engine.runner.execute = flaky  # type: ignore[method-assign]
    try:
        r = httpx.post(base + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=30)
        assert r.status_code == 500 and "simulated kernel failure" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "model_step_failed"
        r = httpx.post(base + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200
    finally:
        engine.runner.execute = real_execute  # type: ignore[method-assign]
    assert httpx.get(base + "/health").status_code == 200
    assert engine.block_manager.is_at_baseline()
    metrics = httpx.get(base + "/metrics").text
    assert 'pdserve:request_success_total{finished_reason="error",model_name="tiny"} 3.0' in metrics


def test_responses_failure_mid_stream_is_an_error_event(app_server: tuple[str, LLMEngine]) -> None:
    """POST /v1/responses: a failed request is a 500 with the child's code; streamed, an `error` event then
    response.failed (typed events, no [DONE]); nothing is stored and the pool is back at its baseline."""
    base, engine = app_server
    _poison(engine, "FAIL_RESPONSE")
    r = httpx.post(base + "/v1/responses", json={"input": "FAIL_RESPONSE", "max_output_tokens": 5}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["code"] == "postprocess_failed"
    with httpx.stream("POST", base + "/v1/responses", json={"input": "FAIL_RESPONSE", "max_output_tokens": 5,
                                                             "stream": True}, timeout=30) as resp:
        lines = [ln for ln in resp.iter_lines() if ln]
    names = [ln[7:] for ln in lines if ln.startswith("event: ")]
    data = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]
    assert names == [d["type"] for d in data] and names[:2] == ["response.created", "response.in_progress"]
    assert names[-2:] == ["error", "response.failed"] and data[-2]["code"] == "postprocess_failed"
    failed = data[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "postprocess_failed"
    assert httpx.get(f"{base}/v1/responses/{failed['id']}").status_code == 404
    assert engine.block_manager.is_at_baseline()

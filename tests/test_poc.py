"""`pdserve poc` against real pdserve servers: a healthy one passes every check it can run (the admin checks are
skipped, saying why), and planted faults fail the right checks with the evidence in the report — a server that
leaks KV blocks when a client disconnects, and one whose streams hang after two chunks."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.poc import PocConfig, run_poc
from pdserve.server.app import ServerConfig, create_app

from conftest import loaded_from_hf, serve_app

ADMIN_CHECKS = {"switch_rollback", "reclaim"}


@pytest.fixture
def make_server(tiny_hf_model: Any, tokenizer: Any) -> Iterator[Callable[..., tuple[str, LLMEngine, Any]]]:
    """A pdserve app on the tiny model under uvicorn; `wrap` puts ASGI middleware (a fault) in front of it."""
    stops: list[Callable[[], None]] = []

    def factory(wrap: Callable[[Any], Any] | None = None, max_waiting: int = 3) -> tuple[str, LLMEngine, Any]:
        engine = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=256, max_num_seqs=2, device_peaks="off",
                                        max_step_ms=0), model=loaded_from_hf(tiny_hf_model), tokenizer=tokenizer)
        app = create_app(engine, ServerConfig(served_model_name="tiny", max_waiting_requests=max_waiting))
        base, stop = serve_app(wrap(app) if wrap else app)
        stops.append(stop)
        return base, engine, app

    yield factory
    for stop in stops:
        stop()


def _poc(base: str, out: Path, **kw: Any) -> Any:
    cfg = PocConfig(base_url=base, profile="quick", out_dir=str(out), tenants=("团队-甲", "team-b"),
                    request_timeout=kw.pop("request_timeout", 30.0), **kw)
    return asyncio.run(run_poc(cfg, echo=lambda s: None))


def test_poc_passes_against_a_healthy_server(make_server: Any, tmp_path: Path) -> None:
    base, engine, _ = make_server()
    owners = tmp_path / "owners.yaml"
    owners.write_text("models:\n  tiny: {owner: alice, approver: 王伟}\n", encoding="utf-8")
    rep = _poc(base, tmp_path / "out", owners=str(owners), admin_api_key="k")
    status = {c.name: c.status for c in rep.checks}
    assert {n: s for n, s in status.items() if n not in ADMIN_CHECKS} == {
        "short": "pass", "long_context": "pass", "streaming": "pass", "concurrency": "pass", "tenants": "pass",
        "interruption": "pass"}, json.dumps([c.as_dict() for c in rep.checks if c.status not in ("pass", "skipped")],
                                            ensure_ascii=False, default=str)
    by = {c.name: c for c in rep.checks}
    # this server has no admin API yet: the checks say so instead of failing
    assert {status[n] for n in ADMIN_CHECKS} == {"skipped"} and "404" in by["reclaim"].summary
    assert rep.passed and engine.block_manager.is_at_baseline()
    inter = by["interruption"].evidence
    assert inter["back_to_baseline"] and inter["burst"]["saw_429"] and inter["burst"]["429_bodies_well_formed"]
    assert inter["aborted_while_queued"]["aborted_before_first_token"]
    assert by["long_context"].evidence["over_limit"]["status"] == 400
    assert by["long_context"].evidence["prompt_tokens"] > 900
    # per tenant: client counts, and the CJK tenant id survives headers, JSON and the report
    rows = {r["tenant"]: r for r in rep.tenants}
    assert set(rows) == {"团队-甲", "team-b"} and all(r["requests"] > 0 and r["errors"] == 0 for r in rows.values())
    md = (tmp_path / "out" / "report.md").read_text(encoding="utf-8")
    assert "# pdserve poc: PASSED" in md and "团队-甲" in md and "王伟" in md
    assert "tiny: no on_call" in md  # responsibility: what is missing is said
    data = json.loads((tmp_path / "out" / "report.json").read_text(encoding="utf-8"))
    assert data["passed"] and {c["name"] for c in data["checks"]} == set(status)
    assert any("请" in r["generated_text"] or r["check"] for r in data["requests"])
    for png in ("ttft.png", "itl.png", "timeline.png", "concurrency.png", "tenants.png"):
        assert (tmp_path / "out" / png).stat().st_size > 1000, png


def _leak_kv_on_abort(engine: LLMEngine) -> None:
    """Planted fault: an aborted request's blocks are detached before the scheduler frees them (never returned)."""
    original = engine.abort_request
    leaked: dict[str, Any] = {}

    def abort_request(request_ids: Any) -> Any:
        for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            leaked[rid] = engine.block_manager.req_blocks.pop(rid, [])
        return original(request_ids)

    engine.abort_request = abort_request  # type: ignore[method-assign]


def test_poc_fails_interruption_on_a_server_that_leaks_kv(make_server: Any, tmp_path: Path) -> None:
    base, engine, _ = make_server()
    _leak_kv_on_abort(engine)
    rep = _poc(base, tmp_path / "out", checks=("short", "interruption"))
    by = {c.name: c for c in rep.checks}
    assert by["short"].status == "pass"  # plain requests are fine: only the disconnect path leaks
    inter = by["interruption"]
    assert inter.status == "fail" and "leaked" in inter.summary, inter.summary
    ev = inter.evidence
    assert not ev["back_to_baseline"] and ev["after"]["used_blocks"] > ev["baseline"]["used_blocks"]
    assert ev["after"]["kv_usage"] > 0
    assert not rep.passed
    md = (tmp_path / "out" / "report.md").read_text(encoding="utf-8")
    assert "# pdserve poc: FAILED" in md and "Abnormal interruption" in md and "leaked" in md


class HangStreams:
    """Planted fault (ASGI middleware): a streamed completion sends two `data:` events, then nothing, forever."""

    def __init__(self, app: Any, after: int = 2) -> None:
        self.app, self.after = app, after

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            return await self.app(scope, receive, send)
        events = 0

        async def hanging_send(message: Any) -> None:
            nonlocal events
            if message["type"] == "http.response.body" and message.get("body", b"").startswith(b"data:"):
                events += 1
                if events > self.after:
                    await asyncio.Event().wait()  # until the client gives up and the server cancels us
            await send(message)

        await self.app(scope, receive, hanging_send)


def test_poc_fails_streaming_on_a_server_whose_streams_hang(make_server: Any, tmp_path: Path) -> None:
    base, engine, _ = make_server(wrap=HangStreams)
    rep = _poc(base, tmp_path / "out", checks=("streaming", "interruption"), request_timeout=3.0)
    by = {c.name: c for c in rep.checks}
    assert by["streaming"].status == "fail" and "hung stream" in by["streaming"].summary, by["streaming"].summary
    # the hung streams were dropped by the client: the server aborted them, so KV is back (nothing leaks)
    assert by["interruption"].status == "pass", by["interruption"].summary
    md = (tmp_path / "out" / "report.md").read_text(encoding="utf-8")
    assert "hung stream" in md
    deadline = time.monotonic() + 10
    while not engine.block_manager.is_at_baseline() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.block_manager.is_at_baseline()


@pytest.mark.slow
def test_pdserve_poc_command_against_pdserveserve_app(tmp_path: Path) -> None:
    """The command line end to end: `pdserve serve` (default model) and `pdserve poc --quick` as processes."""
    import subprocess
    import sys

    from pdserve.launch import start_server

    srv = start_server(tmp_path, "--max-waiting-requests", "4", "--max-num-seqs", "2", "--max-model-len", "1024")
    try:
        out = tmp_path / "report"
        proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "poc", "--base-url", srv.base_url, "--quick",
                               "--out", str(out), "--tenants", "a,b,租户c"], capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "PASSED" in proc.stdout and (out / "report.md").is_file()
        assert json.loads((out / "report.json").read_text(encoding="utf-8"))["passed"]
    finally:
        srv.stop()


def _contract_server() -> Any:
    """The lifecycle contract's admin API (README "Model lifecycle") in a few lines, serving canned streams: enough
    to run the admin checks' client side (switch + rollback under load, load/unload) until the real one lands."""
    app = FastAPI()
    models = {"m@v1": "v1", "m@v2": "v2"}
    aliases: dict[str, list[str]] = {"chat": ["m@v1"]}
    audit: list[dict[str, Any]] = []

    def admin_ok(req: Request) -> bool:
        return req.headers.get("authorization") == "Bearer adm"

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        data = [{"id": n, "object": "model", "version": v, "config_hash": "0" * 12, "max_model_len": 512,
                 "state": "loaded"} for n, v in models.items()]
        data += [{"id": a, "object": "model", "alias_of": t[-1], "max_model_len": 512} for a, t in aliases.items()]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def complete(req: Request) -> Any:
        body = await req.json()
        name = aliases.get(body["model"], [body["model"]])[-1]
        if name not in models:
            return JSONResponse({"error": {"message": "no such model", "type": "invalid_request_error",
                                           "code": "model_not_found"}}, 404)
        header = {"x-pdserve-model-version": f"{name}@{models[name]}"}

        async def events() -> Any:
            for i in range(3):
                await asyncio.sleep(0.05)
                yield f'data: {json.dumps({"id": "x", "object": "text_completion", "choices": [{"text": str(i), "finish_reason": "length" if i == 2 else None}]})}\n\n'  # noqa: E501
            yield "data: [DONE]\n\n"
        if body.get("stream"):
            return StreamingResponse(events(), media_type="text/event-stream", headers=header)
        return JSONResponse({"choices": [{"text": "012"}]}, headers=header)

    @app.api_route("/admin/{path:path}", methods=["GET", "PUT", "POST", "DELETE"])
    async def admin(path: str, req: Request) -> Any:
        if not admin_ok(req):
            return JSONResponse({"error": {"message": "bad key", "type": "authentication_error"}}, 401)
        parts = path.split("/")
        if parts == ["audit"]:
            return {"entries": audit}
        if parts[0] == "aliases":
            hist = aliases.setdefault(parts[1], [])
            if parts[-1] == "rollback":
                hist.pop()
            else:
                hist.append((await req.json())["model"])
            audit.append({"action": parts[-1], "alias": parts[1], "model": hist[-1]})
            return {"alias": parts[1], "model": hist[-1], "previous": hist[-2] if len(hist) > 1 else None,
                    "switch_s": 0.001}
        if parts == ["models"]:
            body = await req.json()
            models[body["name"]] = body.get("version") or "v"
            return {"name": body["name"], "state": "loaded"}
        models.pop(parts[1], None)
        return {"name": parts[1], "state": "unloaded"}

    @app.get("/metrics")
    async def metrics() -> Any:
        return PlainTextResponse("process_resident_memory_bytes 1e9\n")

    return app


def test_admin_checks_follow_the_lifecycle_contract(tmp_path: Path) -> None:
    base, stop = serve_app(_contract_server())
    try:
        rep = _poc(base, tmp_path / "out", checks=("switch_rollback", "reclaim"), admin_api_key="adm",
                   model="chat", switch_to="m@v2")
        wrong = _poc(base, tmp_path / "out2", checks=("reclaim",), admin_api_key="nope")
    finally:
        stop()
    by = {c.name: c for c in rep.checks}
    sw = by["switch_rollback"]
    assert sw.status == "pass", sw.summary
    assert set(sw.evidence["served_by"]) <= {"m@v1@v1", "m@v2@v2"} and sw.evidence["alias_after"] == "m@v1"
    assert sw.evidence["rollback"]["model"] == "m@v1" and all(r["ok"] for r in sw.evidence["requests"])
    assert by["reclaim"].status == "pass" and by["reclaim"].evidence["status_after_unload"] == 404
    audit = rep.evidence.configuration["audit_entries"]
    assert [e["action"] for e in audit] == ["chat", "rollback"]  # the switch and the rollback, as the server logged
    assert "exercised and worked" in rep.evidence.review["rollback"]
    assert wrong.checks[0].status == "skipped" and "401" in wrong.checks[0].summary

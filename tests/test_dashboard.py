"""GET /v1/stats and /dashboard on real servers (tiny model) behind --api-key: a colocated server, and a PD deployment
behind `pdserve router` whose /v1/stats puts the instances side by side. Figures are checked against the same
server's Prometheus text; the Grafana dashboard's metrics must all exist there."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.diagnose import Verdict
from pdserve.launch import ServerProc, free_port, start_pdserve, start_server

from conftest import start_all

KEY = "sk-dash"
AUTH = {"Authorization": f"Bearer {KEY}"}
TINY = ["--dtype", "float32", "--num-kv-blocks", "256", "--max-num-batched-tokens", "32", "--num-threads", "1",
        "--device-peaks", "2e11,2e10", "--api-key", KEY]
ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 3, "你好，世界！请用中文介绍一下你自己。", "Hi"]


def families(srv: ServerProc) -> dict[str, Any]:
    text = httpx.get(srv.base_url + "/metrics", headers=AUTH).text  # behind --api-key (no --metrics-public)
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(fams: dict[str, Any], family: str, suffix: str = "", **labels: str) -> float:
    return sum(s.value for s in fams[family].samples
               if s.name == family + suffix and all(s.labels.get(k) == v for k, v in labels.items()))


def wait_baseline(srv: ServerProc, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        kv = httpx.get(srv.base_url + "/debug/kv", headers=AUTH).json()
        if kv["num_used_blocks"] == 0 and kv["open_requests"] == 0 and kv["num_pinned_blocks"] == 0:
            return
        assert time.monotonic() < deadline, kv
        time.sleep(0.05)


def send_load(base_url: str, n: int = 6) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    for i in range(n):
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            stream = client.completions.create(model=model, prompt=prompt, max_tokens=12, stream=True,
                                               user="团队-a", extra_body={"ignore_eos": True})
            assert "".join(c.choices[0].text for c in stream if c.choices)
        else:
            c = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=12, user="团队-a", extra_body={"ignore_eos": True})
            assert c.usage.completion_tokens == 12


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[ServerProc]:
    srv = start_server(tmp_path_factory.mktemp("dash"), "--model", str(tiny_dir), *TINY)
    yield srv
    assert srv.stop() in (0, -15)


def test_page_and_assets_are_served_without_the_key(server: ServerProc) -> None:
    page = httpx.get(server.base_url + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/dashboard/dashboard.js" in page.text and "http" not in page.text.split("<body>")[1]  # no CDN
    js = httpx.get(server.base_url + "/dashboard/dashboard.js")
    assert js.status_code == 200 and "/v1/stats" in js.text and "Bearer" in js.text
    assert httpx.get(server.base_url + "/dashboard/dashboard.css").status_code == 200
    missing = httpx.get(server.base_url + "/dashboard/secrets.txt")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_stats_needs_the_key_and_checks_the_window(server: ServerProc) -> None:
    r = httpx.get(server.base_url + "/v1/stats")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    for bad in ("0", "-5", "100000", "abc"):
        r = httpx.get(server.base_url + "/v1/stats", params={"window": bad}, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"].endswith("window"), (bad, r.text)


def test_stats_after_load_agree_with_metrics(server: ServerProc) -> None:
    send_load(server.base_url)
    wait_baseline(server)
    body = httpx.get(server.base_url + "/v1/stats", params={"window": 900}, headers=AUTH).json()
    assert body["object"] == "stats" and body["role"] == "server"
    [(name, b)] = body["models"].items()
    fams = families(server)
    ttft = "pdserve:time_to_first_token_seconds"
    # the server is younger than the window: every sample of the histograms is in it
    assert b["latency_ms"]["ttft"]["count"] == sample(fams, ttft, "_count", model_name=name) == 6
    assert b["latency_ms"]["itl"]["count"] == sample(fams, "pdserve:inter_token_latency_seconds", "_count")
    assert b["latency_ms"]["e2e"]["count"] == 6 and b["requests"]["finished"] == 6
    mean_ttft = sample(fams, ttft, "_sum") / 6 * 1000
    assert b["latency_ms"]["ttft"]["mean"] == pytest.approx(mean_ttft, rel=1e-6)
    assert b["requests"]["generation_tokens_per_s"] * b["span_s"] == pytest.approx(
        sample(fams, "pdserve:generation_tokens", "_total"), rel=1e-6)
    assert b["prefix_cache"]["queries"] == sample(fams, "pdserve:prefix_cache_queries", "_total")
    assert b["prefix_cache"]["hits"] == sample(fams, "pdserve:prefix_cache_hits", "_total") > 0  # repeated prompts
    assert b["preemptions"] == sample(fams, "pdserve:num_preemptions", "_total") == 0
    assert b["kv_cache"]["usage"] == 0 and b["kv_cache"]["used_blocks"] == 0 and b["kv_cache"]["num_blocks"] == 256
    assert b["kv_cache"]["watermark"] > 0 and b["load"]["running"] == 0 and b["open_requests"] == 0
    for kind, st in b["steps"]["by_kind"].items():
        assert st["steps"] == sample(fams, "pdserve:engine_step_time_seconds", "_count", step_kind=kind) > 0
        assert st["mfu"] > 0 and st["mbu"] > 0
    assert b["steps"]["peak_flops"] == 2e11 and b["steps"]["peak_bandwidth"] == 2e10
    assert b["tenants"]["团队-a"]["finished"] == 6  # the body's `user` (CJK): every request's tenant
    v = b["verdict"]
    assert v["verdict"] in {x.value for x in Verdict} and v["findings"] and v["numbers"]["ttft_limit_ms"] > 0


@dataclass
class PD:
    prefill: ServerProc
    decode: ServerProc
    router: ServerProc


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[PD]:
    tmp = tmp_path_factory.mktemp("dash-pd")
    m = ["--model", str(tiny_dir), *TINY]
    pre, dec = start_all(lambda: start_server(tmp, *m, "--role", "prefill"),
                         lambda: start_server(tmp, *m, "--role", "decode"))
    port = free_port()
    router = start_pdserve(tmp, "router", ["router", "--port", str(port), "--prefill", pre.base_url, "--decode",
                                           dec.base_url, "--poll-interval", "0.2"], f"http://127.0.0.1:{port}", 60,
                           env={"PDSERVE_INSTANCE_API_KEY": KEY})  # its /metrics polls need the instances' key
    yield PD(pre, dec, router)
    for s in (router, pre, dec):
        s.stop()


def test_router_stats_show_the_instances_side_by_side(pd: PD) -> None:
    assert httpx.get(pd.router.base_url + "/dashboard").status_code == 200
    assert httpx.get(pd.router.base_url + "/v1/stats").status_code == 401  # the instances' key, passed through
    send_load(pd.router.base_url, n=4)
    wait_baseline(pd.prefill)
    wait_baseline(pd.decode)
    body = httpx.get(pd.router.base_url + "/v1/stats", params={"window": 900}, headers=AUTH).json()
    assert body["role"] == "router" and body["healthy"] is True
    rows = {row["role"]: row for row in body["instances"]}
    assert set(rows) == {"prefill", "decode"} and all(r["status"] == 200 for r in rows.values())
    assert rows["prefill"]["stats"]["role"] == "prefill" and rows["decode"]["stats"]["role"] == "decode"
    [dec] = rows["decode"]["stats"]["models"].values()
    [pre] = rows["prefill"]["stats"]["models"].values()
    fams = families(pd.decode)
    assert dec["kv_transfer"]["pulls"] == sample(fams, "pdserve:kv_transfer", "_total", result="ok") == 4
    assert dec["kv_transfer"]["bytes"] == sample(fams, "pdserve:kv_transfer_bytes", "_total") > 0
    assert dec["latency_ms"]["kv_transfer"]["count"] == 4 and dec["kv_transfer"]["requests_loading"] == 0
    assert pre["requests"]["finished"] == 4 and pre["kv_transfer"]["pinned_blocks"] == 0


def grafana_metrics() -> set[str]:
    dash = json.loads((ROOT / "deploy/grafana/pdserve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs.append(dash["templating"]["list"][0]["query"])
    assert len(exprs) > 20
    return {m for e in exprs for m in re.findall(r"pdserve:[a-z_:]+", e)}


def test_grafana_dashboard_metrics_exist(server: ServerProc, pd: PD) -> None:
    """Every series the Grafana dashboard reads is in the /metrics of a real server of the role its row is for
    (colocated, prefill, decode, router): the dashboard cannot rot silently."""
    exposed = set()
    for srv in (server, pd.prefill, pd.decode, pd.router):
        for fam in families(srv).values():
            exposed |= {s.name for s in fam.samples}
    missing = sorted(grafana_metrics() - exposed)
    assert not missing, missing
    dash = json.loads((ROOT / "deploy/grafana/pdserve.json").read_text())
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert rows[1:3] == ["Prefill", "Decode"]
    prom = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    assert {j["job_name"] for j in prom["scrape_configs"]} == {"pdserve", "pdserve-router"}
    assert all(j["metrics_path"] == "/metrics" for j in prom["scrape_configs"])

"""The dashboard in a real browser: headless Debian `chromium` driven by Playwright (the system browser through
`executable_path`, nothing downloaded). A real server behind --api-key gets load; the page must show numbers that
agree with /v1/stats and /metrics, take its key from ?key= or a prompt, and leave a screenshot: docs/dashboard.png
with PDSERVE_UPDATE_SCREENSHOT=1 (the README shows it), else under the test's tmp dir.

Needs `make browser` (apt-get install chromium; pip install the `browser` extra), which `make test` runs. Skips,
saying so, only when chromium or playwright is absent, and fails instead under PDSERVE_REQUIRE_BROWSER=1 (CI)."""

from __future__ import annotations

import math
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_dashboard import AUTH, KEY, PD, TINY, families, pd, sample, send_load, wait_baseline  # noqa: F401 (pd: a fixture)

from pdserve.bench.diagnose import Verdict
from pdserve.launch import ServerProc, start_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
REQUIRED = os.environ.get("PDSERVE_REQUIRE_BROWSER") == "1"


def _absent(what: str) -> None:
    message = f"{what} is not installed: run `make browser`"
    if REQUIRED:
        raise RuntimeError(message + " (PDSERVE_REQUIRE_BROWSER=1: the browser test must run)")
    pytest.skip(message, allow_module_level=True)


if CHROMIUM is None:
    _absent("the system chromium")
try:
    from playwright import sync_api
except ImportError:
    _absent("playwright")
pytestmark = pytest.mark.browser
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[ServerProc]:
    srv = start_server(tmp_path_factory.mktemp("browser"), "--model", str(tiny_dir), *TINY)
    yield srv
    assert srv.stop() in (0, -15)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield b
        b.close()


def stat(page: Any, name: str) -> str:
    return str(page.locator(f'[data-stat="{name}"]').first.get_attribute("data-value"))


def p50_bounds(fams: dict[str, Any], family: str) -> tuple[float, float]:
    """Where the histogram's buckets put the median (ms): the mean of the two middle values (one for odd n) lies
    between the lower edge of the bucket of the lower one and the upper edge of the bucket of the higher one."""
    buckets = sorted((float(s.labels["le"]), s.value) for s in fams[family].samples if s.name == family + "_bucket")
    n = buckets[-1][1]
    lo = max((le for le, cum in buckets if cum < math.ceil(n / 2)), default=0.0)
    hi = min(le for le, cum in buckets if cum >= n // 2 + 1)
    return lo * 1000, hi * 1000


def test_dashboard_in_chromium(server: ServerProc, browser: Any, tmp_path: Path) -> None:
    send_load(server.base_url)
    background = threading.Thread(target=send_load, args=(server.base_url, 6))  # live figures while the page polls
    background.start()
    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    page.goto(server.base_url + f"/dashboard?key={KEY}&window=900")
    assert "key=" not in page.url  # the key left the address bar at once ...
    assert page.evaluate("sessionStorage.getItem('pdserve-api-key')") == KEY  # ... for this tab's storage
    page.wait_for_selector('[data-stat="ttft.p50"][data-value]:not([data-value=""])', timeout=30_000)
    background.join()
    wait_baseline(server)
    page.wait_for_timeout(4500)  # two more polls: the charts have a history, the page has the settled figures
    stats = httpx.get(server.base_url + "/v1/stats", params={"window": 900}, headers=AUTH).json()
    [block] = stats["models"].values()
    fams = families(server)

    finished = sample(fams, "pdserve:request_success", "_total")
    assert int(stat(page, "requests.finished")) == finished == block["requests"]["finished"] == 12
    assert page.locator('[data-stat="requests.finished"]').inner_text() == "12"
    ttft_p50 = float(stat(page, "ttft.p50"))
    assert ttft_p50 == pytest.approx(block["latency_ms"]["ttft"]["p50"])
    lo, hi = p50_bounds(fams, "pdserve:time_to_first_token_seconds")
    assert lo <= ttft_p50 <= hi
    lo, hi = p50_bounds(fams, "pdserve:inter_token_latency_seconds")
    assert lo <= float(stat(page, "itl.p50")) <= hi
    assert float(stat(page, "kv_cache.usage")) == sample(fams, "pdserve:kv_cache_usage_perc") == 0
    assert float(stat(page, "preemptions")) == sample(fams, "pdserve:num_preemptions", "_total")
    assert float(stat(page, "steps.decode.mfu")) > 0
    assert page.locator(".verdict-name").inner_text() in {v.value for v in Verdict}
    assert page.locator(".phase.prefill h3").inner_text() == "Prefill"
    assert page.locator(".phase.decode h3").inner_text() == "Decode"
    assert page.locator(".chart polyline").count() == 5
    shot = ROOT / "docs/dashboard.png" if os.environ.get("PDSERVE_UPDATE_SCREENSHOT") == "1" else \
        tmp_path / "dashboard.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000
    page.close()


def test_the_page_asks_for_the_key(server: ServerProc, browser: Any) -> None:
    """Without ?key= the first poll gets a 401, the page prompts, and polls again with the key typed."""
    page = browser.new_page()
    asked: list[str] = []

    def answer(dialog: Any) -> None:
        asked.append(dialog.type)
        dialog.accept(KEY)

    page.on("dialog", answer)
    page.goto(server.base_url + "/dashboard")
    page.wait_for_selector('[data-stat="requests.finished"]', timeout=30_000)
    assert asked == ["prompt"]
    page.close()
    wrong = browser.new_page()
    wrong.on("dialog", lambda d: d.dismiss())
    wrong.goto(server.base_url + "/dashboard?key=wrong")
    wrong.wait_for_function("document.getElementById('status').textContent.includes('API key needed')")
    assert wrong.locator('[data-stat="requests.finished"]').count() == 0
    wrong.close()


def test_router_page_shows_the_instances_side_by_side(pd: PD, browser: Any) -> None:  # noqa: F811 (fixture)
    send_load(pd.router.base_url, n=2)
    wait_baseline(pd.decode)
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    page.goto(pd.router.base_url + f"/dashboard?key={KEY}&window=900")
    pulls = '.instance[data-role="decode"] [data-stat="kv_transfer.pulls"]'
    page.wait_for_selector(pulls, timeout=30_000)
    assert page.locator("#role").inner_text() == "router"
    assert page.locator('.instance[data-role="prefill"] .phase.prefill').count() == 1
    ok = sample(families(pd.decode), "pdserve:kv_transfer", "_total", result="ok")
    assert float(str(page.locator(pulls).get_attribute("data-value"))) == ok >= 2
    box = {r: page.locator(f'.instance[data-role="{r}"]').bounding_box() for r in ("prefill", "decode")}
    assert box["prefill"] and box["decode"] and box["prefill"]["x"] < box["decode"]["x"]  # side by side
    page.close()

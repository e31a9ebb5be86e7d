"""PD disaggregation end to end: `pdserve serve --role prefill|decode` processes behind `pdserve router`.

Fast tests use a tiny random model saved as a Hugging Face directory (servers start in seconds); the `slow` test
repeats the equality check on the real default model. Killing a decode instance mid-request and the network
namespace test (prefill and decode in two namespaces joined by a veth pair) run real processes too.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.kv_transfer.trust import default_secret, sign_kv_transfer_params
from pdserve.launch import ServerProc, free_port, start_pdserve, start_server

import netns
from conftest import start_all
from netns import sh

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 5,  # several KV blocks
    "你好，世界！请用中文介绍一下你自己，谢谢。" * 2,
    "Hi",
]
# --device-peaks off: no roofline is checked here, and a start on a busy host measures the peaks anew each time
# (about 1.5 s of CPU and 3 s of wall per server: a busy measurement is never cached)
TINY = ["--dtype", "float32", "--num-kv-blocks", "256", "--max-num-batched-tokens", "32", "--num-threads", "1",
        "--device-peaks", "off"]
# Client and router timeouts: far above a request's time even on a busy host. A test that checks how fast a failure
# is noticed compares with them (a closed connection is seen at once, a hung one only after the timeout).
TIMEOUT = 300.0


def start_router(tmp: Path, prefill: list[str], decode: list[str], *args: str, timeout: float = 60.0) -> ServerProc:
    port = free_port()
    pools = ["--prefill", *prefill] if prefill else []  # none: colocated instances (the decode pool)
    return start_pdserve(tmp, f"router-{port}", ["router", "--port", str(port), *pools, "--decode", *decode,
                                                 "--poll-interval", "0.2", *args],
                         f"http://127.0.0.1:{port}", timeout)


@dataclass
class Cluster:
    colo: ServerProc | None  # a colocated server (--role both) for reference outputs
    prefill: ServerProc
    decode: list[ServerProc]
    router: ServerProc

    def stop(self) -> None:
        for s in [self.router, self.colo, self.prefill, *self.decode]:
            if s is not None:
                s.stop()

    @property
    def ref(self) -> str:
        assert self.colo is not None
        return self.colo.base_url


def wait_baseline(srv: ServerProc, timeout: float = 15.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        kv = httpx.get(srv.base_url + "/debug/kv").json()
        if (kv["num_used_blocks"] == 0 and kv["open_requests"] == 0 and kv.get("num_pinned_blocks", 0) == 0) \
                or time.monotonic() > deadline:
            return kv


def complete(base: str, prompt: str, stream: bool, chat: bool = False, **kw: Any) -> str:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True, "stream": stream, **kw}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if not stream:
        r = httpx.post(base + path, json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return str(c["message"]["content"] if chat else c["text"])
    out = []
    with httpx.stream("POST", base + path, json=body, timeout=TIMEOUT) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                out.append((c.get("delta") or {}).get("content") or "" if chat else c.get("text") or "")
    return "".join(out)


def metric(srv: ServerProc, name: str) -> float:
    for line in httpx.get(srv.base_url + "/metrics").text.splitlines():
        if line.startswith(name) and (name.endswith('"') or line[len(name)] in "{ "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


# ---- the real model (first: no tiny deployment of this module idles beside it) ---------------------------------------
@pytest.mark.slow
def test_real_model_router_equals_colocated(tmp_path: Path) -> None:
    m = ["--kv-cache-memory", "128MiB", "--max-model-len", "2048", "--num-threads", "1", "--device-peaks", "off"]
    servers = start_all(*[partial(start_server, tmp_path, *m, *role, timeout=TIMEOUT)
                          for role in ([], ["--role", "prefill"], ["--role", "decode"])])
    colo, pre, dec = servers
    router = start_router(tmp_path, [pre.base_url], [dec.base_url], "--decode-timeout", str(TIMEOUT),
                          "--prefill-timeout", str(TIMEOUT))
    try:
        prompts = [PROMPTS[0], PROMPTS[1], "Explain in one paragraph why the sky is blue. " * 8]
        # Each request its own cache_salt: the prefill server then computes every prompt in passes of the same shape
        # as the colocated one. A prefix hit computes fewer rows, which the default dtype's PyTorch path (bf16 where
        # the CPU has it: not batch-invariant) may round differently (seen on a Zen 5: texts diverged after ~50
        # characters). One routed request per prompt and kind, streamed and not in turn: both modes meet chat and
        # completion (the tiny-model tests below route every combination).
        for chat in (True, False):
            for i, prompt in enumerate(prompts):
                kw: dict[str, Any] = dict(chat=chat, max_tokens=48)
                want = complete(colo.base_url, prompt, stream=False, cache_salt=f"{chat}-{i}-colo", **kw)
                stream = (i + chat) % 2 == 0
                got = complete(router.base_url, prompt, stream=stream, cache_salt=f"{chat}-{i}-pd", **kw)
                assert got == want, (prompt, chat, stream)
        assert metric(dec, "pdserve:kv_transfer_failures_total") == 0
        assert metric(dec, "pdserve:kv_transfer_bytes_total") > 0
        for srv in (pre, dec):
            kv = wait_baseline(srv)
            assert kv["num_used_blocks"] == 0 and kv["num_pinned_blocks"] == 0, kv
    finally:
        router.stop()
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("pd")
    m = ["--model", str(tiny_dir), *TINY]
    colo, pre, dec = start_all(lambda: start_server(tmp, *m),
                               lambda: start_server(tmp, *m, "--role", "prefill", "--kv-transfer-timeout", "4"),
                               lambda: start_server(tmp, *m, "--role", "decode"))
    router = start_router(tmp, [pre.base_url], [dec.base_url])
    c = Cluster(colo, pre, [dec], router)
    yield c
    c.stop()


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_router_output_equals_colocated(cluster: Cluster, stream: bool, chat: bool) -> None:
    before = metric(cluster.decode[0], "pdserve:kv_transfer_bytes_total")
    for prompt in PROMPTS:
        want = complete(cluster.ref, prompt, stream=False, chat=chat)
        got = complete(cluster.router.base_url, prompt, stream=stream, chat=chat)
        assert got == want, prompt
    assert metric(cluster.decode[0], "pdserve:kv_transfer_bytes_total") > before
    assert metric(cluster.decode[0], "pdserve:kv_transfer_failures_total") == 0
    assert wait_baseline(cluster.prefill)["num_used_blocks"] == 0
    assert wait_baseline(cluster.decode[0])["num_used_blocks"] == 0
    assert metric(cluster.prefill, "pdserve:kv_pin_timeouts_total") == 0


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_through_the_router(cluster: Cluster, stream: bool) -> None:
    """A constraint travels with the hand-off: the decode instance's own matcher sees every output token (it
    computes the last prompt token itself), so the routed answer equals the colocated one and obeys the grammar."""
    kw: dict[str, Any] = {"ignore_eos": False, "max_tokens": 48,
                          "structured_outputs": {"choice": ["晴天", "rainy", "cloudy"]}}
    for chat in (False, True):
        want = complete(cluster.ref, PROMPTS[0], stream=False, chat=chat, **kw)
        got = complete(cluster.router.base_url, PROMPTS[0], stream=stream, chat=chat, **kw)
        assert got == want and got in {"晴天", "rainy", "cloudy"}
    assert metric(cluster.decode[0], "pdserve:kv_transfer_failures_total") == 0
    assert wait_baseline(cluster.decode[0])["num_used_blocks"] == 0


def test_router_metrics_and_logs(cluster: Cluster) -> None:
    complete(cluster.router.base_url, PROMPTS[0], stream=True)
    text = httpx.get(cluster.router.base_url + "/metrics").text
    assert "pdserve:router_time_to_first_token_seconds_count" in text
    assert 'pdserve:router_requests_total{outcome="ok"}' in text
    assert "pdserve:kv_transfer_seconds_count" in httpx.get(cluster.decode[0].base_url + "/metrics").text
    time.sleep(0.3)
    router_lines = [json.loads(ln.split("pdserve.requests: ", 1)[1]) for ln in cluster.router.log().splitlines()
                    if "pdserve.requests: " in ln]
    assert router_lines and router_lines[-1]["prefill_engine_id"].startswith("prefill-")
    assert router_lines[-1]["decode_url"] == cluster.decode[0].base_url
    dec_lines = [json.loads(ln.split("pdserve.requests: ", 1)[1]) for ln in cluster.decode[0].log().splitlines()
                 if "pdserve.requests: " in ln]
    kv = dec_lines[-1]["kv_transfer"]
    assert kv["ok"] and kv["bytes"] > 0 and kv["remote_engine_id"] == router_lines[-1]["prefill_engine_id"]
    assert dec_lines[-1]["engine_id"].startswith("decode-")


def test_abort_mid_stream_leaves_both_pools_at_baseline(cluster: Cluster) -> None:
    body = {"prompt": PROMPTS[0], "max_tokens": 1500, "ignore_eos": True, "temperature": 0.0, "stream": True}
    with httpx.stream("POST", cluster.router.base_url + "/v1/completions", json=body, timeout=60) as resp:
        n = 0
        for line in resp.iter_lines():
            if line.startswith("data: "):
                n += 1
            if n >= 5:
                break  # leaving the block closes the connection mid-stream
    for srv in (cluster.prefill, cluster.decode[0]):
        kv = wait_baseline(srv)
        assert kv["num_used_blocks"] == 0 and kv["open_requests"] == 0 and kv["num_pinned_blocks"] == 0, kv
    assert metric(cluster.decode[0], 'pdserve:request_success_total{finished_reason="abort"') >= 1


def test_unclaimed_pin_is_freed_after_the_transfer_timeout(cluster: Cluster) -> None:
    key = default_secret()  # what the router signs with: no secret is configured (tests' session cache dir)
    r = httpx.post(cluster.prefill.base_url + "/v1/completions", json={
        "prompt": PROMPTS[0], "max_tokens": 1,
        "kv_transfer_params": sign_kv_transfer_params({"do_remote_decode": True}, key)})
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_block_ids"] and params["remote_request_id"]
    assert httpx.get(cluster.prefill.base_url + "/debug/kv").json()["num_pinned_blocks"] == len(
        params["remote_block_ids"])
    kv = wait_baseline(cluster.prefill, timeout=10)  # --kv-transfer-timeout 4
    assert kv["num_used_blocks"] == 0 and kv["num_pinned_blocks"] == 0
    assert metric(cluster.prefill, "pdserve:kv_pin_timeouts_total") >= 1
    # a decode instance handed these stale params recomputes the prompt and still answers correctly
    want = complete(cluster.ref, PROMPTS[0], stream=False)
    got = complete(cluster.decode[0].base_url, PROMPTS[0], stream=False,
                   kv_transfer_params=sign_kv_transfer_params(params, key))
    assert got == want
    assert metric(cluster.decode[0], "pdserve:kv_transfer_failures_total") >= 1


def test_prefill_pool_down_decode_recomputes(cluster: Cluster, tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    router = start_router(tmp_path, [dead], [cluster.decode[0].base_url])
    try:
        want = complete(cluster.ref, PROMPTS[1], stream=False)
        assert complete(router.base_url, PROMPTS[1], stream=True) == want
        assert "pdserve:router_recomputes_total 1.0" in httpx.get(router.base_url + "/metrics").text
    finally:
        router.stop()


# ---- killing a decode instance mid-request -----------------------------------------------------------------
@pytest.fixture(scope="module")
def two_decoders_once(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("pd-kill")
    m = ["--model", str(tiny_dir), *TINY]
    pre, *decs = start_all(lambda: start_server(tmp, *m, "--role", "prefill"),
                           *[lambda: start_server(tmp, *m, "--role", "decode")] * 2)
    router = start_router(tmp, [pre.base_url], [d.base_url for d in decs], "--decode-timeout", str(TIMEOUT),
                          "--tokenizer", str(tiny_dir))
    c = Cluster(None, pre, decs, router)
    yield c
    c.stop()


@pytest.fixture
def two_decoders(two_decoders_once: Cluster) -> Cluster:
    """The module's 1P2D deployment with both decode instances up and healthy in the router's eyes: a decode
    instance an earlier test killed is started again on its port (one start instead of the deployment's four)."""
    c = two_decoders_once
    for i, d in enumerate(c.decode):
        if d.proc.poll() is not None:
            port = d.base_url.rsplit(":", 1)[1]
            c.decode[i] = start_pdserve(d.log_path.parent, f"server-{port}-again", [*d.cmd[3:]], d.base_url)
    deadline = time.monotonic() + 30
    while not all(i["healthy"] for i in httpx.get(c.router.base_url + "/health").json()["decode"]):
        assert time.monotonic() < deadline, "the router did not see the restarted decode instance"
        time.sleep(0.1)
    return c


# ---- prefix-aware routing over the two decode instances (before any of them is killed) -----------------------------
SYSTEMS = ["You are the support assistant of a shipping company; answer in two sentences. " * 4,
           "你是一家航运公司的客服助手，请用两句话回答问题。" * 4]


def _route_lines(router: ServerProc) -> list[dict[str, Any]]:
    return [json.loads(ln.split("pdserve.requests: ", 1)[1]) for ln in router.log().splitlines()
            if "pdserve.requests: " in ln]


def _turn(c: Cluster, router: ServerProc, messages: list[dict[str, str]],
          **kw: Any) -> tuple[str, dict[str, Any], dict[str, float]]:
    """One chat turn through `router`: (answer, the router's log line, each decode instance's prefix-hit tokens
    gained, by URL)."""
    before = {d.base_url: metric(d, "pdserve:prefix_cache_hits_total") for d in c.decode}
    n = len(_route_lines(router))
    r = httpx.post(router.base_url + "/v1/chat/completions", timeout=TIMEOUT, json={
        "messages": messages, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, **kw})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10
    while len(lines := _route_lines(router)) == n and time.monotonic() < deadline:
        time.sleep(0.05)
    gained = {d.base_url: metric(d, "pdserve:prefix_cache_hits_total") - before[d.base_url] for d in c.decode}
    return r.json()["choices"][0]["message"]["content"], lines[-1], gained


def _conversation(c: Cluster, router: ServerProc, system: str, **kw: Any) -> list[dict[str, str]]:
    """Turn 1 (nothing cached: least-loaded), then turn 2 lands where turn 1's blocks are, and hits them there."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Where is my parcel?"}]
    answer, first, _ = _turn(c, router, messages, **kw)
    assert first["route"] == "no_match" and first["prefix_hit_tokens"] == 0
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And when will it come?"}]
    _, second, gained = _turn(c, router, messages, **kw)
    assert second["route"] == "prefix" and second["decode_url"] == first["decode_url"], (first, second)
    assert second["prefix_hit_tokens"] >= 48  # the system prompt's blocks at least
    assert gained[first["decode_url"]] >= second["prefix_hit_tokens"]
    return messages


def test_prefix_routing_follows_conversations(two_decoders_once: Cluster, tiny_dir: Path, tmp_path: Path) -> None:
    """Colocated (a router over the two instances, no prefill pool) and PD (the module's 1P2D router): a
    conversation's next turn goes to the instance holding its blocks and hits them there (the instances' own
    metric); a salted request is never routed by another salt's blocks and hits nothing there."""
    c = two_decoders_once
    colo = start_router(tmp_path, [], [d.base_url for d in c.decode], "--tokenizer", str(tiny_dir),
                        "--prefix-load-cost", "4")
    try:
        msgs = _conversation(c, colo, SYSTEMS[0])
        _conversation(c, colo, SYSTEMS[1])
        for salt in ("tenant-b", "tenant-c"):  # the same text under another salt: b's blocks are no use to c
            _, salted, gained = _turn(c, colo, msgs, cache_salt=salt)
            assert salted["route"] == "no_match" and set(gained.values()) == {0.0}
        _conversation(c, colo, "Acme's own assistant. " * 12, cache_salt="tenant-d")  # a salt follows its own
        _, again, _ = _turn(c, colo, msgs)
        assert again["route"] == "prefix"
    finally:
        colo.stop()
    _conversation(c, c.router, "Another company's assistant. " * 10)  # PD: the decode pool routes by prefix
    # what the instances publish: 304 while unchanged
    r = httpx.get(c.decode[0].base_url + "/kv/prefix_hashes")
    assert r.status_code == 200 and r.json()["block_size"] == 16 and r.json()["num_hashes"] > 0
    assert httpx.get(c.decode[0].base_url + "/kv/prefix_hashes",
                     headers={"if-none-match": r.headers["etag"]}).status_code == 304


def _busy_decoder(c: Cluster, timeout: float = 20.0) -> ServerProc:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for d in c.decode:
            if httpx.get(d.base_url + "/debug/kv").json()["open_requests"] > 0:
                return d
        time.sleep(0.02)
    raise AssertionError("no decode instance picked the request up")


def test_killed_decode_instance_is_retried_on_another(two_decoders: Cluster) -> None:
    import concurrent.futures

    c = two_decoders
    body = {"prompt": PROMPTS[0], "max_tokens": 1200, "ignore_eos": True, "temperature": 0.0}
    # without kv_transfer_params a decode instance computes the whole request itself: the colocated reference
    want = httpx.post(c.decode[0].base_url + "/v1/completions", json=body, timeout=TIMEOUT).json()
    retries = metric(c.router, 'pdserve:router_retries_total{stage="decode"}')
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, c.router.base_url + "/v1/completions", json=body, timeout=2 * TIMEOUT)
        victim = _busy_decoder(c)
        victim.proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        r = fut.result(timeout=2 * TIMEOUT)
    assert r.status_code == 200, r.text
    # completed on the survivor (recomputed: the pin was gone), the kill seen at once, not after the decode timeout
    assert r.json()["choices"][0]["text"] == want["choices"][0]["text"]
    assert time.monotonic() - t0 < TIMEOUT
    survivor = next(d for d in c.decode if d is not victim)
    assert wait_baseline(survivor)["num_used_blocks"] == 0
    assert wait_baseline(c.prefill)["num_pinned_blocks"] == 0
    assert metric(c.router, 'pdserve:router_retries_total{stage="decode"}') == retries + 1


def test_killed_decode_mid_stream_ends_with_a_clear_error(two_decoders: Cluster) -> None:
    c = two_decoders
    body = {"prompt": PROMPTS[0], "max_tokens": 1500, "ignore_eos": True, "temperature": 0.0, "stream": True}
    events: list[str] = []
    t0 = time.monotonic()
    with httpx.stream("POST", c.router.base_url + "/v1/completions", json=body, timeout=TIMEOUT) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 5:
                _busy_decoder(c).proc.send_signal(signal.SIGKILL)
    assert events[-1] == "[DONE]" and time.monotonic() - t0 < TIMEOUT  # the kill seen at once
    err = json.loads(events[-2])["error"]
    assert "after tokens were streamed" in err["message"]
    assert wait_baseline(c.prefill)["num_pinned_blocks"] == 0


# ---- across network namespaces -----------------------------------------------------------------------------
@pytest.fixture
def netns_pair() -> Iterator[tuple[str, str, str, str]]:
    """Namespaces (10.77.0.1 and 10.77.0.2) joined by a veth pair. The prefill instance runs in the first, the
    decode instance and the router in the second, so both the HTTP prefill call and the KV pull cross the veth."""
    with netns.netns_pair("pd", "10.77.0") as pair:
        yield pair


def _start_in_ns(ns: str, tmp: Path, cmd: list[str], url: str, name: str, timeout: float = 180.0) -> ServerProc:
    def healthy() -> bool:  # asked from inside the namespace: only its own interfaces reach the server
        # a bare interpreter and urllib: a probe runs every quarter second while the servers start
        probe = (f"import sys, urllib.request\ntry:\n    ok = urllib.request.urlopen('{url}/health', timeout=1).status"
                 " == 200\nexcept OSError:\n    ok = False\nsys.exit(0 if ok else 1)")
        return sh("ip", "netns", "exec", ns, sys.executable, "-I", "-S", "-c", probe).returncode == 0

    # two hosts: hand-offs need the shared secret (without one an instance pulls only from loopback peers)
    env = {"NO_PROXY": "*", "no_proxy": "*", "PDSERVE_KV_TRANSFER_SECRET": "netns-test-secret"}
    return start_pdserve(tmp, name, cmd, url, timeout, prefix=["ip", "netns", "exec", ns], env=env, healthy=healthy)


# skipped before its fixtures run: setting up and tearing down the namespaces for nothing took ~11 s on a busy host
NIXL = pytest.param("nixl", marks=pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None,
                                                     reason="NIXL (nixl-cu12) is not installed"))


@pytest.mark.parametrize("connector", ["zmq", NIXL])
def test_handoff_across_network_namespaces(netns_pair: tuple[str, str, str, str], tmp_path: Path,
                                           tiny_dir: Path, connector: str) -> None:
    if connector == "nixl":
        pytest.importorskip("nixl_cu12", reason="NIXL (nixl-cu12) is not installed")
    ns_p, ns_d, ip_p, ip_d = netns_pair
    m = ["--model", str(tiny_dir), *TINY, "--kv-connector", connector]
    procs: list[ServerProc] = []
    try:
        procs += start_all(
            lambda: _start_in_ns(ns_p, tmp_path, ["serve", *m, "--role", "prefill", "--host", ip_p, "--port", "8100",
                                                  "--kv-host", ip_p, "--kv-port", "5600"], f"http://{ip_p}:8100",
                                 "prefill"),
            lambda: _start_in_ns(ns_d, tmp_path, ["serve", *m, "--role", "decode", "--host", ip_d, "--port", "8200",
                                                  "--kv-host", ip_d, "--kv-port", "5600"], f"http://{ip_d}:8200",
                                 "decode"))
        procs.append(_start_in_ns(ns_d, tmp_path, ["router", "--prefill", f"http://{ip_p}:8100", "--decode",
                                                   f"http://{ip_d}:8200", "--host", ip_d, "--port", "8300"],
                                  f"http://{ip_d}:8300", "router"))
        script = (
            "import httpx, json, sys\n"
            f"prompts = {PROMPTS!r}\n"
            "out = []\n"
            "for p in prompts:\n"
            "    body = {'prompt': p, 'max_tokens': 24, 'temperature': 0.0, 'ignore_eos': True}\n"
            f"    a = httpx.post('http://{ip_d}:8300/v1/completions', json=body, timeout=60).json()\n"
            f"    b = httpx.post('http://{ip_d}:8200/v1/completions', json=body, timeout=60).json()\n"
            "    out.append([a['choices'][0]['text'], b['choices'][0]['text']])\n"
            f"m = httpx.get('http://{ip_d}:8200/metrics').text\n"
            "print(json.dumps({'out': out, 'bytes': [ln for ln in m.splitlines() "
            "if ln.startswith('pdserve:kv_transfer_bytes_total')]}))\n")
        r = sh("ip", "netns", "exec", ns_d, sys.executable, "-c", script)
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout.strip().splitlines()[-1])
        for via_router, direct in res["out"]:  # the direct request to the decode instance computes colocated
            assert via_router == direct
        assert float(res["bytes"][0].rsplit(" ", 1)[1]) > 0  # the KV crossed the veth pair
    finally:
        for p in procs:
            p.stop()


def test_decode_side_disk_tier_skips_the_pull_after_a_restart(tiny_dir: Path, tmp_path: Path) -> None:
    """A decode instance with `--kv-offload-dir` writes the KV it pulled to its disk tier; restarted, it reads a
    known prompt's full blocks from disk before deciding what to pull, and pulls only the rest: of this 51-token
    prompt's 50 pulled tokens (4 blocks of 16), the 3 full blocks come from disk and only the last, partial one
    over the wire (the output is the colocated one both times)."""
    m = ["--model", str(tiny_dir), *TINY]
    prompt = PROMPTS[0]
    kv_dir = tmp_path / "kv"
    colo, pre = start_all(lambda: start_server(tmp_path, *m),
                          lambda: start_server(tmp_path, *m, "--role", "prefill", "--kv-transfer-timeout", "4"))
    try:
        want = complete(colo.base_url, prompt, stream=False)
        pulled, loaded = [], []
        for _ in range(2):  # the second decode instance is the first one restarted on the same directory
            dec = start_server(tmp_path, *m, "--role", "decode", "--kv-offload-dir", str(kv_dir))
            router = start_router(tmp_path, [pre.base_url], [dec.base_url])
            try:
                assert complete(router.base_url, prompt, stream=True) == want
                wait_baseline(dec)
                pulled.append(metric(dec, "pdserve:kv_transfer_bytes_total"))
                loaded.append(metric(dec, 'pdserve:kv_offload_blocks_total{direction="loaded"'))
            finally:
                router.stop()
                assert dec.stop() in (0, -15)  # SIGTERM: the writer finishes the blocks it has
        assert pulled[0] > 0 and loaded[0] == 0  # the first instance pulled 4 blocks and wrote the 3 full ones
        assert loaded[1] == 3 and pulled[1] == pulled[0] / 4  # the restarted one read 3 and pulled the 4th
        assert wait_baseline(pre)["num_used_blocks"] == 0  # the prefill side's pin was released either way
    finally:
        colo.stop()
        pre.stop()

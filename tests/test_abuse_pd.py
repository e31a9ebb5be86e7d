"""Fault and abuse cases against a real 1P1D pair and its router on loopback (tiny model, one deployment for the
module, no configured kv_transfer_secret: the router signs with the per-user default secret): forged hand-off params
sent straight to an instance, a frozen (SIGSTOPped) prefill instance, bodies the router must refuse. Each case
checks the status and body, that a well-behaved request running alongside completes unchanged, and that KV usage
and running requests return to baseline.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.kv_transfer.trust import default_secret
from pdserve.launch import ServerProc, free_port, start_pdserve

from conftest import make_tiny_hf_model, start_all

pytestmark = pytest.mark.slow

TINY = ["--dtype", "float32", "--num-kv-blocks", "256", "--max-num-batched-tokens", "32", "--num-threads", "1",
        "--device-peaks", "off"]  # no roofline here; a busy start would measure the peaks anew
PROMPT = "你好，世界！请用中文介绍一下你自己。The quick brown fox jumps over the lazy dog. " * 2
BODY = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}


@dataclass
class PD:
    prefill: ServerProc
    decode: ServerProc
    router: ServerProc
    reference: str  # BODY's text, computed by the decode instance alone (equal to colocated)


def start(tmp: Path, cmd: str, *args: str) -> ServerProc:
    """`pdserve serve|router` on a free port, without a configured secret (the default: a single-host deployment
    run by one user; the secret file is in the session's cache directory, as conftest sets it)."""
    port = free_port()
    return start_pdserve(tmp, f"{cmd}-{port}", [cmd, "--port", str(port), *args], f"http://127.0.0.1:{port}")


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Iterator[PD]:
    tmp = tmp_path_factory.mktemp("abuse-pd")
    model = tmp / "tiny"
    make_tiny_hf_model().save_pretrained(model, safe_serialization=True)
    tokenizer.save_pretrained(model)
    m = ["--model", str(model), *TINY]
    pre, dec = start_all(lambda: start(tmp, "serve", *m, "--role", "prefill", "--kv-transfer-timeout", "4"),
                         lambda: start(tmp, "serve", *m, "--role", "decode"))
    router = start(tmp, "router", "--prefill", pre.base_url, "--decode", dec.base_url, "--poll-interval", "0.2")
    try:
        ref = httpx.post(dec.base_url + "/v1/completions", json=BODY, timeout=60)
        assert ref.status_code == 200, ref.text
        yield PD(pre, dec, router, ref.json()["choices"][0]["text"])
    finally:
        for s in (router, pre, dec):
            s.stop()
    secret = default_secret()
    assert secret
    for s in (pre, dec, router):
        assert secret not in s.log()  # never logged


def baseline(srv: ServerProc, timeout: float = 15.0) -> dict[str, Any]:
    """/debug/kv once nothing is held (or the last reading after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        kv = httpx.get(srv.base_url + "/debug/kv").json()
        held = kv["num_used_blocks"] or kv["open_requests"] or kv.get("num_pinned_blocks", 0)
        if not held or time.monotonic() > deadline:
            return kv


def metric(srv: ServerProc, name: str) -> float:
    for line in httpx.get(srv.base_url + "/metrics").text.splitlines():
        if line.startswith(name) and line[len(name)] in "{ ":
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def running(srv: ServerProc) -> float:
    return metric(srv, "pdserve:num_requests_running")


def assert_baseline(pd: PD) -> None:
    for srv in (pd.prefill, pd.decode):
        kv = baseline(srv)
        assert kv["num_used_blocks"] == 0 and kv["open_requests"] == 0, kv
        assert kv.get("num_pinned_blocks", 0) == 0 and running(srv) == 0, kv


def routed_text(pd: PD, stream: bool) -> str:
    """BODY through the router: the well-behaved neighbour."""
    if not stream:
        r = httpx.post(pd.router.base_url + "/v1/completions", json=BODY, timeout=60)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])
    out = []
    with httpx.stream("POST", pd.router.base_url + "/v1/completions", json={**BODY, "stream": True},
                      timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                out += [c.get("text") or "" for c in chunk["choices"]]
    return "".join(out)


class ConnectRecorder:
    """A listening socket that records every connection made to it (the forged `remote_host:port`)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def forged_bodies(port: int) -> list[dict[str, Any]]:
    """The tester's SSRF body and variants: unsigned, a made-up signature, a signed body's signature re-used."""
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "x",
              "remote_host": "127.0.0.1", "remote_port": port, "remote_request_id": "victim",
              "remote_block_ids": list(range(64))}
    return [{**BODY, "kv_transfer_params": p} for p in (
        params, {**params, "signature": "0" * 64}, {**params, "remote_host": "169.254.169.254", "signature": "x"},
        {**params, "remote_host": "localhost"})]


def test_forged_handoff_never_connects_and_neighbours_are_unaffected(pd: PD) -> None:
    rec = ConnectRecorder()
    try:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            forged = [pool.submit(httpx.post, pd.decode.base_url + "/v1/completions", json=b, timeout=60)
                      for b in forged_bodies(rec.port)]
            neighbours = [pool.submit(routed_text, pd, s) for s in (False, True)]
            answers = [f.result(timeout=90) for f in forged]
            assert [n.result(timeout=90) for n in neighbours] == [pd.reference] * 2  # a real hand-off, unchanged
        for r in answers:
            # 400 once the server verifies the params before queueing; meanwhile the engine refuses them and
            # computes the prompt locally. Either way nothing was contacted.
            assert r.status_code in (200, 400), r.text
            if r.status_code == 200:
                assert r.json()["choices"][0]["text"] == pd.reference
        time.sleep(0.3)
        assert rec.conns == []
    finally:
        rec.close()
    assert_baseline(pd)


def test_unsigned_remote_decode_pins_nothing(pd: PD) -> None:
    """Only the router may ask a prefill instance to keep KV for a decode instance: a client's own
    do_remote_decode (sent straight to the prefill instance, a flood of them) is a coded 400 and pins nothing,
    while routed requests, signed with the per-user default secret, still hand their KV over."""
    body = {**BODY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    moved = metric(pd.decode, "pdserve:kv_transfer_bytes_total")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        neighbours = [pool.submit(routed_text, pd, s) for s in (False, True)]
        forged = [pool.submit(httpx.post, pd.prefill.base_url + "/v1/completions", json=b, timeout=60)
                  for b in [body, *[{**body, "kv_transfer_params": {**body["kv_transfer_params"],
                                                                     "signature": "0" * 64}}] * 15]]
        for f in forged:
            r = f.result(timeout=90)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "kv_transfer_params_rejected"
        assert [n.result(timeout=90) for n in neighbours] == [pd.reference] * 2
    assert metric(pd.decode, "pdserve:kv_transfer_bytes_total") > moved  # the router is still trusted
    assert metric(pd.prefill, "pdserve:kv_pin_timeouts_total") == 0
    assert_baseline(pd)


def test_forged_handoff_is_a_400(pd: PD) -> None:
    rec = ConnectRecorder()
    try:
        for body in forged_bodies(rec.port):
            r = httpx.post(pd.decode.base_url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "kv_transfer_params_rejected" and err["param"] == "kv_transfer_params"
            assert err["type"] == "invalid_request_error"
        assert rec.conns == []
    finally:
        rec.close()
    assert_baseline(pd)


def test_frozen_prefill_instance_does_not_hang_clients(pd: PD) -> None:
    pd.prefill.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert routed_text(pd, stream=True) == pd.reference  # the decode instance computed the prompt
        assert routed_text(pd, stream=False) == pd.reference
        assert time.monotonic() - t0 < 20
        health = httpx.get(pd.router.base_url + "/health").json()
        assert health["status"] == "ok" and not health["prefill"][0]["healthy"]
    finally:
        pd.prefill.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 15
    while not httpx.get(pd.router.base_url + "/health").json()["prefill"][0]["healthy"]:
        assert time.monotonic() < deadline, "the router did not see the prefill instance again"
        time.sleep(0.1)
    assert routed_text(pd, stream=False) == pd.reference  # hand-offs resume
    assert_baseline(pd)


def test_router_refuses_bad_bodies(pd: PD) -> None:
    url = pd.router.base_url + "/v1/completions"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        neighbour = pool.submit(routed_text, pd, True)
        for body, param in [({**BODY, "n": "abc"}, "n"), ({**BODY, "stream": {"x": 1}}, "stream"),
                            ({"prompt": None}, "prompt")]:
            r = httpx.post(url, json=body, timeout=30)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"].startswith(param), err
        for raw in (b"{not json", b"[1, 2]", "{\"prompt\": \"\xff\"}".encode("latin-1")):
            r = httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        big = b'{"prompt": "' + b"x" * (9 * 2**20) + b'"}'
        r = httpx.post(url, content=big, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
        assert neighbour.result(timeout=60) == pd.reference
    # the dashboard's ?key= never reaches the router's access log
    assert httpx.get(pd.router.base_url + "/dashboard", params={"key": "sk-router-0b5e"}).status_code == 200
    time.sleep(0.2)
    assert "sk-router-0b5e" not in pd.router.log() and "/dashboard?key=***" in pd.router.log()
    assert_baseline(pd)

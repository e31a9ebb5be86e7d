"""Abusive sampling values against a real `pdserve serve` (the outside tester's probes): each is refused with a
400 and an OpenAI error body naming the field, while well-behaved requests sent at the same time complete with
the same greedy output as alone, and KV blocks and running requests return to baseline.

The server runs a tiny random model saved as a Hugging Face directory (starts in seconds). `logit_bias` is not in
the request protocol yet (the server's part), so it is tested at the sampler and engine level
(tests/test_sampling.py).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from pdserve.launch import ServerProc

pytestmark = pytest.mark.slow
VOCAB = 49152  # the tiny model's vocabulary (SmolLM2's)
GOOD = ["The quick brown fox jumps over the lazy dog.", "你好，世界！请用中文介绍一下你自己。", "Once upon a time,"]


@pytest.fixture(scope="module")
def server(tiny_server: ServerProc) -> ServerProc:
    """The session's tiny server (conftest): this module only sends requests and checks its own answers and the
    pool back at baseline."""
    return tiny_server


def _good_body(prompt: str) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _post(server: ServerProc, body: dict[str, Any] | str, path: str = "/v1/completions") -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(server.base_url + path, content=content, headers={"content-type": "application/json"},
                      timeout=60)


@pytest.fixture(scope="module")
def alone(server: ServerProc) -> list[str]:
    outs = [_post(server, _good_body(p)) for p in GOOD]
    assert all(r.status_code == 200 for r in outs)
    return [r.json()["choices"][0]["text"] for r in outs]


def _raw(body: dict[str, Any], field: str, literal: str) -> str:
    """A JSON body whose `field` is a literal json.dumps cannot write (1e309, NaN)."""
    return json.dumps({**body, field: "@@"}).replace('"@@"', literal)


def _baseline(server: ServerProc, timeout: float = 15.0) -> tuple[dict[str, Any], float]:
    deadline = time.monotonic() + timeout
    while True:
        kv = httpx.get(server.base_url + "/debug/kv").json()
        running = next(float(ln.split()[-1]) for ln in httpx.get(server.base_url + "/metrics").text.splitlines()
                       if ln.startswith("pdserve:num_requests_running"))
        if (kv["num_used_blocks"] == 0 and kv["open_requests"] == 0 and running == 0) or time.monotonic() > deadline:
            return kv, running
        time.sleep(0.05)


BASE = {"prompt": "你好，世界", "max_tokens": 8}
BAD: list[tuple[str, dict[str, Any] | str, str]] = [
    ("top_k_2_63", {**BASE, "top_k": 2**63}, "top_k"),
    ("min_tokens_stop_id_outside_vocab", {**BASE, "min_tokens": 1, "stop_token_ids": [VOCAB + 5]}, "stop_token_ids"),
    ("temperature_1e309", _raw(BASE, "temperature", "1e309"), "temperature"),
    ("temperature_infinity", _raw(BASE, "temperature", "Infinity"), "temperature"),
    ("temperature_nan", _raw(BASE, "temperature", "NaN"), "temperature"),
    ("seed_2_70", {**BASE, "seed": 2**70}, "seed"),
    ("seed_plus_n_overflows", {**BASE, "seed": 2**63 - 1, "n": 2}, "seed"),
    ("stop_strings_100000", {**BASE, "stop": [f"停{i}" for i in range(100_000)]}, "stop"),
    ("stop_string_too_long", {**BASE, "stop": ["停" * 1025]}, "stop"),
]


@pytest.mark.parametrize("name, body, field", BAD, ids=[b[0] for b in BAD])
def test_bad_sampling_value_is_refused_and_neighbours_unaffected(server: ServerProc, alone: list[str], name: str,
                                                                body: dict[str, Any] | str, field: str) -> None:
    with ThreadPoolExecutor(len(GOOD) + 1) as pool:
        good = [pool.submit(_post, server, _good_body(p)) for p in GOOD]
        bad = pool.submit(_post, server, body).result()
        good_texts = [f.result() for f in good]
    assert bad.status_code == 400, bad.text  # 100,000 stop strings (1.5 MB) fit the default 8 MiB body limit
    err = bad.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert field in err["message"]
    assert [r.status_code for r in good_texts] == [200] * len(GOOD)
    assert [r.json()["choices"][0]["text"] for r in good_texts] == alone
    kv, running = _baseline(server)
    assert kv["num_used_blocks"] == 0 and kv["open_requests"] == 0 and running == 0


def test_chat_refuses_bad_values_too(server: ServerProc) -> None:
    body = {"messages": [{"role": "user", "content": "你好"}], "max_tokens": 4, "top_k": 2**63}
    r = _post(server, body, "/v1/chat/completions")
    assert r.status_code == 400 and "top_k" in r.json()["error"]["message"]
    ok = _post(server, {**body, "top_k": 5, "stop": ["。"] * 64, "seed": 2**63 - 1}, "/v1/chat/completions")
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
    kv, running = _baseline(server)
    assert kv["num_used_blocks"] == 0 and kv["open_requests"] == 0 and running == 0

"""Third-party clients' timings agree with the server's own (issue 13).

A real `pdserve serve` is streamed by (1) httpx, parsing as vLLM's `bench serve` does (its
`async_request_openai_chat_completions`: TTFT = arrival of the first `data:` chunk that has choices, each later
one an inter-token gap), and (2) the official `openai` client, plain `create(stream=True)` and the
`chat.completions.stream(...)` helper. Each request asks for `return_timings`, so the stream's last chunk carries
the server's per-choice `pdserve_timings`. A client's TTFT spans the server's (arrival -> first token) plus the
HTTP legs, so it must not come out smaller: a first chunk sent before prefill (the bug) would make it tiny.
Prompts are long enough for prefill to take measurable time and differ from the first token, so the prefix cache
cannot skip it.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest

from pdserve.launch import ServerProc

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
MAX_TOKENS = 4
LOWER = 0.8  # client TTFT >= LOWER * server TTFT (it is >= 1x in exact arithmetic; margin for clock reads)
SLACK_S = 3.0  # client TTFT <= server TTFT + SLACK_S: HTTP, JSON and a loaded 2-core machine's scheduling


@pytest.fixture(scope="module")
def server(real_server_fp32: ServerProc) -> ServerProc:
    """The session's fp32 default-model server (conftest), shared with tests/test_bench.py: these tests compare
    each request's client timings with its own server timings."""
    return real_server_fp32


def long_prompt(tag: int) -> str:
    """~150 tokens that start differently per tag (no prefix-cache hits between requests)."""
    return f"Request {tag}. " + " ".join(f"Item {tag * 1000 + k} is a line of a long inventory list." for k in
                                         range(10))


def chat_body(tag: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": long_prompt(tag)}], "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True, "return_timings": True, **extra}


def check_ttft(client_ttft: float, server: dict[str, Any], who: str) -> None:
    assert server["prefill_time"] > 0, server
    assert client_ttft >= LOWER * server["ttft"], f"{who}: first chunk {client_ttft:.4f}s before first token {server}"
    assert client_ttft >= LOWER * server["prefill_time"], f"{who}: first chunk before prefill ran {server}"
    assert client_ttft <= server["ttft"] + SLACK_S, f"{who}: client TTFT {client_ttft:.3f}s vs {server}"


async def vllm_style_stream(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM bench's parsing rule per choice index: the first chunk with that choice -> TTFT, later ones -> ITL.
    Returns {"ttft": {index: s}, "itl": {index: [s]}, "text": {index: str}, "timings": [...], "roles": {...}}."""
    ttft: dict[int, float] = {}
    itl: dict[int, list[float]] = {}
    text: dict[int, str] = {}
    roles: dict[int, int] = {}
    last: dict[int, float] = {}
    timings: list[dict[str, Any]] = []
    st = time.perf_counter()
    async with http.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            line = line.strip()
            if not line or line.startswith(":"):
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                break
            now = time.perf_counter()
            data = json.loads(payload)
            timings = data.get("pdserve_timings", timings)
            for ch in data.get("choices") or []:
                i = ch["index"]
                delta = ch.get("delta", {"content": ch.get("text")})
                if i not in ttft:
                    ttft[i] = now - st
                else:
                    itl.setdefault(i, []).append(now - last[i])
                last[i] = now
                roles[i] = roles.get(i, 0) + ("role" in delta)
                text[i] = text.get(i, "") + (delta.get("content") or "")
    return {"ttft": ttft, "itl": itl, "text": text, "timings": timings, "roles": roles}


def test_vllm_bench_parsing_chat(server: ServerProc) -> None:
    """Two concurrent requests (queueing counts on both sides), one with n=2: every choice's first chunk comes
    after its own prefill."""
    url = server.base_url + "/v1/chat/completions"
    bodies = [chat_body(1), chat_body(2, n=2, seed=7, temperature=1.0)]

    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.gather(*[vllm_style_stream(http, url, b) for b in bodies])

    results = asyncio.run(run())
    for k, res in enumerate(results):
        n = bodies[k].get("n", 1)
        assert sorted(res["ttft"]) == list(range(n)) and len(res["timings"]) == n
        for i in range(n):
            check_ttft(res["ttft"][i], res["timings"][i], f"request {k} choice {i}")
            assert res["roles"][i] == 1 and res["text"][i]
            assert len(res["itl"][i]) >= MAX_TOKENS  # the role chunk, then one chunk per token


def test_vllm_bench_parsing_completion_echo(server: ServerProc) -> None:
    """Completions with echo: the echoed prompt rides on the first token's chunk, not ahead of prefill."""
    body = {"model": MODEL, "prompt": long_prompt(4), "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": True, "echo": True, "return_timings": True}

    async def run() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=300) as http:
            return await vllm_style_stream(http, server.base_url + "/v1/completions", body)

    res = asyncio.run(run())
    check_ttft(res["ttft"][0], res["timings"][0], "completion echo")
    assert res["text"][0].startswith(long_prompt(4)) and len(res["text"][0]) > len(long_prompt(4))


@pytest.fixture(scope="module")
def client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def openai_kwargs(tag: int) -> dict[str, Any]:
    body = chat_body(tag)
    return dict(model=MODEL, messages=body["messages"], max_tokens=MAX_TOKENS,
                extra_body={"ignore_eos": True, "return_timings": True})


def test_openai_client_stream(client: openai.OpenAI) -> None:
    st = time.perf_counter()
    ttft, timings, content = None, None, ""
    for chunk in client.chat.completions.create(stream=True, **openai_kwargs(5)):
        if chunk.choices and ttft is None:
            ttft = time.perf_counter() - st
            assert chunk.choices[0].delta.role == "assistant"
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
        timings = (chunk.model_extra or {}).get("pdserve_timings", timings)
    assert ttft is not None and timings and content
    check_ttft(ttft, timings[0], "openai create(stream=True)")


def test_openai_stream_helper(client: openai.OpenAI) -> None:
    if not hasattr(client.chat.completions, "stream"):
        pytest.skip("this openai version has no chat.completions.stream helper")
    st = time.perf_counter()
    ttft, timings, content = None, None, ""
    with client.chat.completions.stream(**openai_kwargs(6)) as stream:
        for event in stream:
            if event.type == "chunk":
                if event.chunk.choices and ttft is None:
                    ttft = time.perf_counter() - st
                timings = (event.chunk.model_extra or {}).get("pdserve_timings", timings)
            elif event.type == "content.delta":
                content += event.delta
    # (get_final_completion() would refuse a max_tokens cut: it parses the message as finished content)
    assert ttft is not None and timings and content
    check_ttft(ttft, timings[0], "openai chat.completions.stream")

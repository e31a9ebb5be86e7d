"""A real `pdserve serve` process on the default model, driven by the official `openai` client and httpx."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.launch import ServerProc, start_server
from pdserve.roofline import StepCostModel, model_shape_from

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def server(real_server_bf16: ServerProc) -> ServerProc:
    """The session's bf16 default-model server (conftest; --max-body-bytes 200000, peaks measured), shared with
    tests/test_tool_calling.py; its teardown checks the clean SIGTERM exit. Metrics are read as deltas, log lines
    by tenant."""
    return real_server_bf16


@pytest.fixture(scope="module")
def client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def metrics(server: ServerProc) -> dict[str, float]:
    """Flatten /metrics into {'name{label=value,...}': value} (label model_name dropped)."""
    text = httpx.get(server.base_url + "/metrics").text
    flat: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            flat[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return flat


def wait_baseline(server: ServerProc, timeout: float = 10.0) -> dict[str, Any]:
    import time

    deadline = time.monotonic() + timeout
    while True:
        kv = httpx.get(server.base_url + "/debug/kv").json()
        if kv["num_used_blocks"] == 0 and kv["open_requests"] == 0 or time.monotonic() > deadline:
            return kv
        time.sleep(0.05)


def test_models_and_health(server: ServerProc, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}


def test_completion_and_chat(client: openai.OpenAI) -> None:
    c = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert c.choices[0].text and c.choices[0].finish_reason == "length"
    assert c.usage.prompt_tokens == 5 and c.usage.completion_tokens == 8 and c.usage.total_tokens == 13
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of "
                                                                                               "France?"}],
                                          max_tokens=20, temperature=0)
    assert chat.choices[0].message.content and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens > 0 and chat.usage.prompt_tokens > 20  # the template's system prompt


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_stream_equals_non_stream_with_seed(client: openai.OpenAI, kind: str) -> None:
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=24, temperature=0.9, top_p=0.95, seed=42)
    # Each request its own cache_salt: no prefix-cache hit, so all three compute the prompt in passes of the same
    # shape. A hit computes fewer rows, which this server's bf16 PyTorch path (not batch-invariant: its GEMMs block
    # by row count) may round differently, and a sampled token can flip.
    def salt(s: str) -> dict[str, Any]:
        return {"extra_body": {"cache_salt": f"{kind}-{s}"}}

    if kind == "completion":
        full = client.completions.create(prompt="用一句话描述春天：", **kw, **salt("full")).choices[0].text
        again = client.completions.create(prompt="用一句话描述春天：", **kw, **salt("again")).choices[0].text
        chunks = list(client.completions.create(prompt="用一句话描述春天：", stream=True,
                                                stream_options={"include_usage": True}, **kw, **salt("stream")))
        streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    else:
        msgs = [{"role": "user", "content": "Tell me a fun fact about cats."}]
        full = client.chat.completions.create(messages=msgs, **kw, **salt("full")).choices[0].message.content
        again = client.chat.completions.create(messages=msgs, **kw, **salt("again")).choices[0].message.content
        chunks = list(client.chat.completions.create(messages=msgs, stream=True, stream_options={
            "include_usage": True}, **kw, **salt("stream")))
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    # U+FFFD may occur: at temperature 0.9 the model can sample bytes that are not UTF-8 (seen on a Zen 5 in bf16:
    # "è¯" + "en", two bytes of a three-byte character and then ASCII). Both paths then show tokenizer.decode's
    # replacement, never a streamed delta's own broken character (test_invalid_bytes_stream_as_decode_replaces_them)
    assert full == again == streamed and full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_invalid_bytes_stream_as_decode_replaces_them(client: openai.OpenAI) -> None:
    """Sampling only "è¯" (bytes E8 AF: a three-byte character cut short) and "en": every "è¯" is an invalid
    sequence that tokenizer.decode replaces by one U+FFFD. Streamed and non-streamed text are both exactly that:
    the detokenizer holds back a possibly incomplete character, and confirms it as U+FFFD once it cannot complete."""
    kw: dict[str, Any] = dict(model=MODEL, prompt="用一句话描述春天：", max_tokens=24, temperature=1.0, seed=7,
                              logit_bias={"16313": 100, "264": 100})
    full = client.completions.create(**kw, extra_body={"ignore_eos": True, "cache_salt": "a"}).choices[0].text
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        stream=True, **kw, extra_body={"ignore_eos": True, "cache_salt": "b"}) if ch.choices)
    assert streamed == full
    assert "\ufffd" in full and set(full) <= {"\ufffd", "e", "n"}, full
    assert len(full.replace("en", "")) + full.count("en") == 24, full  # one U+FFFD per "è¯", one "en" per "en"


def test_n_stop_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, n=2, temperature=1.0,
                                  seed=3, logprobs=3)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs[0]) == 3 and all(v <= 0 for v in lp.token_logprobs)
    greedy = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0)
    stop = greedy.choices[0].text[10:14]
    cut = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].text == greedy.choices[0].text[:greedy.choices[0].text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and len(content[0].top_logprobs) == 2


def test_echo_and_token_prompts(server: ServerProc) -> None:
    r = httpx.post(server.base_url + "/v1/completions", json={
        "model": MODEL, "prompt": "Hello there", "max_tokens": 3, "temperature": 0, "echo": True}).json()
    assert r["choices"][0]["text"].startswith("Hello there")
    tok = httpx.post(server.base_url + "/tokenize", json={"prompt": "你好，世界"}).json()
    assert httpx.post(server.base_url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "你好，世界"
    r = httpx.post(server.base_url + "/v1/completions", json={
        "model": MODEL, "prompt": [tok["tokens"], tok["tokens"]], "max_tokens": 2, "temperature": 0}).json()
    assert len(r["choices"]) == 2 and r["usage"]["prompt_tokens"] == 2 * tok["count"]


BAD = [
    ("malformed json", dict(content=b"{not json"), 400, None),
    ("wrong type", dict(json={"model": MODEL, "prompt": "hi", "max_tokens": "many"}), 400, "max_tokens"),
    ("missing prompt", dict(json={"model": MODEL}), 400, "prompt"),
    ("bad temperature", dict(json={"model": MODEL, "prompt": "hi", "temperature": -1}), 400, None),
    ("unknown model", dict(json={"model": "gpt-9", "prompt": "hi"}), 404, "model"),
    ("too long", dict(json={"model": MODEL, "prompt": "hello " * 2100, "max_tokens": 5}), 400, "prompt"),
    ("prompt + max_tokens", dict(json={"model": MODEL, "prompt": "hello " * 1000, "max_tokens": 1500}), 400,
     "max_tokens"),
    ("oversized body", dict(content=json.dumps({"model": MODEL, "prompt": "x" * 300000}).encode()), 413, None),
    ("bad token ids", dict(json={"model": MODEL, "prompt": [1, 99999999]}), 400, "prompt"),
]


@pytest.mark.parametrize("name,kw,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input(server: ServerProc, client: openai.OpenAI, name: str, kw: dict, status: int,
                   param: str | None) -> None:
    r = httpx.post(server.base_url + "/v1/completions", headers={"content-type": "application/json"}, timeout=30,
                   **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["code"] is None or isinstance(err["code"], str), err  # as OpenAI's: never a number
    if param:
        assert err["param"] == param
    if name == "prompt + max_tokens":
        assert "1500" in err["message"] and "2048" in err["message"]
    if name == "too long":
        assert "2048" in err["message"]
    # still serving
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).usage.completion_tokens == 2
    assert wait_baseline(server)["num_used_blocks"] == 0


def test_bad_chat_input(server: ServerProc) -> None:
    for body in [{"model": MODEL, "messages": []}, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
                 {"model": MODEL, "messages": "hi"}]:
        r = httpx.post(server.base_url + "/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["message"]


async def _stream_and_maybe_drop(base: str, i: int, drop_after: int | None) -> tuple[int, int, str | None]:
    """Stream a completion; optionally close the connection after `drop_after` chunks."""
    body = {"model": MODEL, "prompt": f"Story number {i}: once upon a time", "max_tokens": 40, "temperature": 0.8,
            "seed": i, "stream": True, "ignore_eos": True}
    chunks, finish = 0, None
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", base + "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                chunks += 1
                finish = data["choices"][0]["finish_reason"] or finish
                if drop_after is not None and chunks >= drop_after:
                    return i, chunks, "dropped"
    return i, chunks, finish


def test_disconnects_free_blocks(server: ServerProc) -> None:
    before = metrics(server)
    rng = random.Random(0)
    plan = [rng.randrange(1, 30) if i % 2 else None for i in range(16)]

    async def run() -> list[tuple[int, int, str | None]]:
        return await asyncio.gather(*[_stream_and_maybe_drop(server.base_url, i, d) for i, d in enumerate(plan)])

    results = asyncio.run(run())
    for (i, chunks, finish), drop in zip(results, plan):
        if drop is None:
            assert finish == "length" and chunks >= 40 - 5, (i, chunks, finish)
    kv = wait_baseline(server)
    assert kv["num_used_blocks"] == 0 and kv["open_requests"] == 0
    after = metrics(server)
    assert after["pdserve:kv_cache_usage_perc"] == 0.0
    aborted = after["pdserve:request_success_total{finished_reason=abort}"] - before.get(
        "pdserve:request_success_total{finished_reason=abort}", 0)
    assert aborted == 8


def test_metrics_match_requests(server: ServerProc, client: openai.OpenAI) -> None:
    wait_baseline(server)
    before = metrics(server)
    prompts = ["One", "Two three", "你好，世界"]
    total_prompt = total_gen = 0
    prompt_lens = []
    for i, p in enumerate(prompts):
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=5 + i, temperature=0, extra_body={
            "ignore_eos": True}, user="tenant-a")
        prompt_lens.append(r.usage.prompt_tokens)
        total_prompt += r.usage.prompt_tokens
        total_gen += r.usage.completion_tokens
    wait_baseline(server)
    after = metrics(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("pdserve:request_success_total{finished_reason=length}") == 3
    assert delta("pdserve:prompt_tokens_total") == total_prompt
    assert delta("pdserve:generation_tokens_total") == total_gen == 5 + 6 + 7
    assert delta("pdserve:time_to_first_token_seconds_count") == 3
    assert delta("pdserve:e2e_request_latency_seconds_count") == 3
    assert delta("pdserve:inter_token_latency_seconds_count") == total_gen - 3
    assert delta("pdserve:request_queue_time_seconds_count") == 3
    assert delta("pdserve:request_prefill_time_seconds_count") == 3
    assert delta("pdserve:request_decode_time_seconds_count") == 3
    assert delta("pdserve:request_time_per_output_token_seconds_count") == 3
    assert any(k.startswith("pdserve:engine_step_time_seconds_count{step_kind=decode") for k in after)
    assert "pdserve:prefix_cache_queries_total" in after and "pdserve:num_preemptions_total" in after
    assert delta("pdserve:prefix_cache_inflight_waits_total") == 0  # one request at a time: nobody waits
    # live roofline: the FLOPs and bytes the steps needed, from the model shape (sequential requests: one prefill
    # step each, then one decode step per further token)
    arch = model_shape_from(None)
    h, i_size, hd = arch.hidden_size, arch.intermediate_size, arch.head_dim
    q, kv = arch.num_attention_heads * hd, arch.num_key_value_heads * hd
    layer_params = arch.num_hidden_layers * (2 * h * q + 2 * h * kv + 3 * h * i_size)
    cost = StepCostModel.for_model(arch, layer_params=layer_params, layer_weight_bytes=0,
                                   lm_head_params=arch.vocab_size * h, lm_head_bytes=0, embed_row_bytes=0,
                                   kv_dtype_bytes=4)
    want = {"prefill": 0.0, "decode": 0.0}
    for n_prompt, n_gen in zip(prompt_lens, [5, 6, 7]):
        want["prefill"] += cost.cost([(0, n_prompt)], 1)[0]
        want["decode"] += sum(cost.cost([(n_prompt + k, 1)], 1)[0] for k in range(n_gen - 1))
    for kind, flops in want.items():
        assert delta(f"pdserve:model_flops_total{{step_kind={kind}}}") == pytest.approx(flops, rel=1e-9)
        assert delta(f"pdserve:model_bytes_total{{step_kind={kind}}}") > 0
        assert delta(f"pdserve:model_time_seconds_total{{step_kind={kind}}}") > 0
        # peaks are known (measured or cached), so every step has an MFU and an MBU sample
        assert delta(f"pdserve:step_mfu_count{{step_kind={kind}}}") == (3 if kind == "prefill" else 4 + 5 + 6)
    # the server measured or probed this machine's peaks at start: how high they read depends on how busy it was
    assert after["pdserve:device_peak_flops"] > 0 and after["pdserve:device_peak_bandwidth_bytes"] > 0
    assert any(k.startswith("pdserve:device_peaks_info{") for k in after)  # where the peaks came from
    # which kernels ran: the native ones, whatever the dtype (`--kernels auto`)
    from pdserve import kernels

    labels = f"cpu_isa={kernels.require().cpu_isa()},isa={kernels.isa()},kernels=native"
    assert after[f"pdserve:kernels_info{{{labels}}}"] == 1
    # one JSON log line per request with the tenant and phase times
    lines = [json.loads(ln.split("pdserve.requests: ", 1)[1]) for ln in server.log().splitlines()
             if "pdserve.requests: " in ln]
    mine = [rec for rec in lines if rec["tenant"] == "tenant-a"]
    assert len(mine) == 3
    for rec in mine:
        assert rec["ttft_s"] == pytest.approx(rec["queue_s"] + rec["prefill_s"], abs=1e-6)
        assert rec["finish_reason"] == "length" and rec["e2e_s"] >= rec["ttft_s"]


def test_timings_in_response_and_tenant_header(server: ServerProc) -> None:
    r = httpx.post(server.base_url + "/v1/chat/completions", headers={"X-Tenant": "team-zh"}, json={
        "model": MODEL, "messages": [{"role": "user", "content": "你好"}], "max_tokens": 4, "return_timings": True})
    t = r.json()["pdserve_timings"][0]
    assert t["ttft"] > 0 and t["queue_time"] >= 0 and t["prefill_time"] > 0
    wait_baseline(server)
    assert any('"tenant": "team-zh"' in ln for ln in server.log().splitlines())


def test_api_key_queue_limit_and_sigterm(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--dtype", "bfloat16", "--api-key", "sekret", "--max-waiting-requests", "1",
                       "--max-num-seqs", "1", "--kv-cache-memory", "64MiB")
    try:
        url = srv.base_url + "/v1/completions"
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        assert httpx.post(url, json=body).status_code == 401
        r = httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.base_url + "/health").status_code == 200  # health needs no key
        auth = {"Authorization": "Bearer sekret"}
        assert httpx.post(url, json=body, headers=auth).status_code == 200

        async def burst() -> list[int]:
            async with httpx.AsyncClient(timeout=120, headers=auth) as http:
                long = {**body, "max_tokens": 60, "ignore_eos": True}
                rs = await asyncio.gather(*[http.post(url, json=long) for _ in range(6)])
                return [r.status_code for r in rs]

        codes = asyncio.run(burst())
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
        # SIGTERM with a request in flight: it completes, then the process exits cleanly
        async def in_flight() -> tuple[int, int]:
            async with httpx.AsyncClient(timeout=120, headers=auth) as http:
                task = asyncio.create_task(http.post(url, json={**body, "max_tokens": 40, "ignore_eos": True}))
                await asyncio.sleep(0.5)
                srv.proc.terminate()
                r = await task
                assert "usage" in r.json(), r.text
                return r.status_code, r.json()["usage"]["completion_tokens"]

        assert asyncio.run(in_flight()) == (200, 40)
        srv.proc.wait(60)
        assert srv.proc.returncode in (0, -15) and "Finished server process" in srv.log()
    finally:
        srv.stop()

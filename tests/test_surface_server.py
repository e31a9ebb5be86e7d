"""A real `pdserve serve` on the tiny model, driven by the official `openai` client and httpx: /v1/embeddings,
prompt_logprobs, priority, and unsupported fields refused by name. The KV pool is at baseline after every request."""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from test_embeddings import direct_embedding

from pdserve.launch import ServerProc, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Any) -> Iterator[ServerProc]:
    srv = start_server(tmp_path_factory.mktemp("surface"), "--model", str(tiny_dir), "--dtype", "float32",
                       "--num-kv-blocks", "128", "--max-model-len", "512", "--num-threads", "1",
                       "--max-num-batched-tokens", "32", "--device-peaks", "off")  # no MFU checked here
    yield srv
    assert srv.stop() in (0, -15)


@pytest.fixture(scope="module")
def client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def at_baseline(srv: ServerProc, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        kv = httpx.get(srv.base_url + "/debug/kv").json()
        if kv["num_used_blocks"] == 0 and kv["open_requests"] == 0:
            return
        assert time.monotonic() < deadline, kv
        time.sleep(0.05)


def post(srv: ServerProc, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, timeout=120)


def test_embeddings_with_the_openai_client(server: ServerProc, client: openai.OpenAI, model_id: str,
                                           tiny_hf_model: Any, tokenizer: Any) -> None:
    texts = ["hello world", "你好，世界！这是一个嵌入测试。" * 4, "x"]
    res = client.embeddings.create(model=model_id, input=texts)  # the client asks for base64 and decodes it
    assert [d.index for d in res.data] == [0, 1, 2]
    n_tokens = sum(len(tokenizer.encode(t)) for t in texts)
    assert res.usage.prompt_tokens == n_tokens == res.usage.total_tokens
    for text, d in zip(texts, res.data):
        ref = direct_embedding(tiny_hf_model, tokenizer.encode(text))
        assert torch.allclose(torch.tensor(d.embedding), ref, atol=1e-4)
    one = client.embeddings.create(model=model_id, input=texts[1], encoding_format="float")
    assert one.data[0].embedding == pytest.approx(res.data[1].embedding, abs=1e-5)
    ids = tokenizer.encode(texts[0])
    by_ids = client.embeddings.create(model=model_id, input=[ids, ids[:1]], dimensions=64)
    assert by_ids.data[0].embedding == pytest.approx(res.data[0].embedding, abs=1e-5)
    raw = post(server, "/v1/embeddings", {"input": ids, "encoding_format": "base64"}).json()
    vec = struct.unpack(f"<{64}f", base64.b64decode(raw["data"][0]["embedding"]))
    assert list(vec) == pytest.approx(res.data[0].embedding, abs=1e-5)
    at_baseline(server)


@pytest.mark.parametrize("body, param", [
    ({"input": "a", "dimensions": 32}, "dimensions"),
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [[1, 2], [10**9]]}, "input"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "priority": 1}, "priority"),
    ({"input": "a" * 3000}, "input"),
])
def test_embedding_errors(server: ServerProc, body: dict[str, Any], param: str) -> None:
    r = post(server, "/v1/embeddings", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    at_baseline(server)


def test_prompt_logprobs_and_priority_over_http(server: ServerProc, client: openai.OpenAI, model_id: str,
                                                tokenizer: Any) -> None:
    prompt = "Score me, 请"
    c = client.completions.create(model=model_id, prompt=prompt, max_tokens=3, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    plp = c.choices[0].model_extra["prompt_logprobs"]
    ids = tokenizer.encode(prompt)
    assert plp[0] is None and len(plp) == len(ids) and all(str(t) in e for t, e in zip(ids[1:], plp[1:]))
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_id, prompt=prompt, max_tokens=3, extra_body={"priority": 3})
    assert e.value.body["param"] == "priority"  # type: ignore[index]
    at_baseline(server)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}
BAD_CALL = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {}}]}


def counts(srv: ServerProc, name: str) -> dict[tuple[str, ...], float]:
    """One counter from /metrics: label values (sorted by label name, model labels left out) -> value."""
    out: dict[tuple[str, ...], float] = {}
    for fam in text_string_to_metric_families(httpx.get(srv.base_url + "/metrics").text):
        for smp in fam.samples:
            if smp.name == name:
                out[tuple(v for k, v in sorted(smp.labels.items()) if k not in ("model", "model_name"))] = smp.value
    return out


# a refusal raised (as RequestRejected) by each layer under the routes: sampling params, the engine's input
# checks, structured outputs, tools, the chat history (in the template's worker thread) and embeddings
@pytest.mark.parametrize("path, body, param, code", [
    ("/v1/completions", {**COMPLETION, "temperature": -1}, "temperature", "invalid_parameter"),
    ("/v1/completions", {"prompt": "你好", "max_tokens": 600}, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", {**COMPLETION, "response_format": {"type": "yaml"}}, "response_format.type",
     "invalid_structured_output"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice", "invalid_tool_choice"),
    ("/v1/chat/completions", {**CHAT, "messages": [BAD_CALL]}, "messages[0].tool_calls[0]", "invalid_parameter"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs",
     "invalid_parameter"),
    ("/tokenize", {"messages": [BAD_CALL]}, "messages[0].tool_calls[0]", "invalid_parameter"),
    ("/v1/embeddings", {"input": [[1, 10**9]]}, "input", "invalid_prompt"),
])
def test_refusals_answered_and_counted_once(server: ServerProc, path: str, body: dict[str, Any], param: str,
                                            code: str) -> None:
    """Each is a 400 with OpenAI's body carrying its ErrorCode, counted once in the error metrics (context length
    under its own kind) and once for the tenant."""
    errors, tenants = counts(server, "pdserve:request_errors_total"), counts(server, "pdserve:tenant_requests_total")
    r = httpx.post(server.base_url + path, json=body, headers={"x-tenant": "refused-t"}, timeout=120)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"], err
    assert (err["param"], err["code"]) == (param, code), err
    kind = ("context_length",) if code == "context_length_exceeded" else ("bad_request",)
    after = counts(server, "pdserve:request_errors_total")
    assert {k: v - errors.get(k, 0) for k, v in after.items() if v != errors.get(k, 0)} == {kind: 1}
    after = counts(server, "pdserve:tenant_requests_total")
    assert {k: v - tenants.get(k, 0) for k, v in after.items() if v != tenants.get(k, 0)} == \
        {("400", "refused-t"): 1}
    at_baseline(server)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {**COMPLETION, "use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {**COMPLETION, "length_penalty": 0.5}, "length_penalty"),
    ("/v1/completions", {**COMPLETION, "allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ("/v1/completions", {**COMPLETION, "bad_words": ["x"]}, "bad_words"),
    ("/v1/completions", {**COMPLETION, "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ("/v1/completions", {**COMPLETION, "add_special_tokens": False}, "add_special_tokens"),
    ("/v1/completions", {**COMPLETION, "spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ("/v1/completions", {**COMPLETION, "return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    ("/v1/completions", {**COMPLETION, "suffix": "end"}, "suffix"),
    ("/v1/completions", {**COMPLETION, "stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("/v1/chat/completions", {**CHAT, "echo": True}, "echo"),
    ("/v1/chat/completions", {**CHAT, "continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {**CHAT, "add_special_tokens": True}, "add_special_tokens"),
    ("/v1/chat/completions", {**CHAT, "reasoning_effort": "low"}, "reasoning_effort"),
    ("/v1/chat/completions", {**CHAT, "web_search_options": {}}, "web_search_options"),
    ("/v1/chat/completions", {**CHAT, "documents": [{"text": "d"}]}, "documents"),
    ("/v1/chat/completions", {**CHAT, "logits_processors": ["x"]}, "logits_processors"),
    ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
    ("/v1/embeddings", {"input": "a", "normalize": False}, "normalize"),
])
def test_result_changing_fields_are_refused_by_name(server: ServerProc, path: str, body: dict[str, Any],
                                                     param: str) -> None:
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "unsupported_parameter", err
    at_baseline(server)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {**COMPLETION, "use_beam_search": False, "length_penalty": 1.0, "add_special_tokens": True,
                         "store": True, "metadata": {"k": "v"}, "request_id": "abc", "zz_vendor_field": 1,
                         "stream_options": {"include_usage": True, "continuous_usage_stats": False}}),
    ("/v1/chat/completions", {**CHAT, "echo": False, "add_special_tokens": False, "service_tier": "auto",
                              "guided_decoding_backend": "xgrammar", "zz_vendor_field": 2,
                              "chat_template_kwargs": {"enable_thinking": False}}),
    ("/v1/embeddings", {"input": "a", "normalize": True, "zz_vendor_field": 3}),
])
def test_harmless_fields_are_accepted_and_logged_once(server: ServerProc, path: str, body: dict[str, Any]) -> None:
    for _ in range(2):
        r = post(server, path, body)
        assert r.status_code == 200, r.text
    at_baseline(server)
    log = server.log()
    assert log.count("ignoring unknown request field 'zz_vendor_field'") == 1
    assert log.count("ignoring unknown request field 'request_id'") <= 1

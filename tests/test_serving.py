"""The serving layer driven directly (no HTTP, no server process): a tiny in-memory model behind an EngineClient."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, cast

import pytest

from pdserve.api.errors import ERROR_STATUS, APIError, from_rejected
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.api.protocol_messages import MessagesRequest
from pdserve.config import EngineConfig
from pdserve.engine.client import EngineClient, EngineRequest, KVSnapshot
from pdserve.engine.engine import LLMEngine
from pdserve.errors import ErrorCode, RequestRejected
from pdserve.server.metrics import Metrics
from pdserve.server.serving import OpenAIServing, RequestContext
from pdserve.server.serving_chat import OpenAIServingChat
from pdserve.server.serving_completion import OpenAIServingCompletion
from pdserve.server.serving_messages import ServingMessages

from conftest import loaded_from_hf

MODEL = "tiny"
# The disconnect poll of the tests whose client goes away: the tiny model makes 400 tokens in ~0.25 s on a fast CPU,
# the server's own poll interval, so the check must come well before the request can finish.
POLL_S = 0.005


@pytest.fixture(scope="module")
def aengine(tiny_hf_model: Any, tokenizer: Any) -> Iterator[EngineClient]:
    engine = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=128, max_model_len=512),
                       model=loaded_from_hf(tiny_hf_model), tokenizer=tokenizer)
    ae = EngineClient(engine, Metrics(MODEL))
    ae.start()
    yield ae
    ae.shutdown()


def capture_children(serving: OpenAIServing) -> list[EngineRequest]:
    """Record the engine requests a serving object makes (to check their timestamps against the stream)."""
    made: list[EngineRequest] = []
    original = serving.make_children

    def make_children(*args: Any, **kwargs: Any) -> list[EngineRequest]:
        reqs = original(*args, **kwargs)
        made.extend(reqs)
        return reqs

    serving.make_children = make_children  # type: ignore[method-assign]
    return made


async def read_sse(stream: AsyncIterator[str], on_chunk: Callable[[dict[str, Any]], None] | None = None,
                   ) -> list[dict[str, Any]]:
    """Parse the SSE lines into chunks; `on_chunk` runs as each one arrives. Checks the [DONE] terminator."""
    chunks, done = [], False
    async for line in stream:
        assert line.startswith("data: ") and line.endswith("\n\n") and not done
        payload = line[6:].strip()
        if payload == "[DONE]":
            done = True
            continue
        chunk = json.loads(payload)
        if on_chunk is not None:
            on_chunk(chunk)
        chunks.append(chunk)
    assert done
    return chunks


def wait_kv_baseline(ae: EngineClient, timeout: float = 10.0) -> KVSnapshot:
    deadline = time.monotonic() + timeout
    while (snap := ae.kv_snapshot).num_used_blocks and time.monotonic() < deadline:
        time.sleep(0.02)
    return snap


def test_completion_n_and_prompts_collected(aengine: EngineClient) -> None:
    serving = OpenAIServingCompletion(aengine, MODEL)
    body = CompletionRequest(prompt=["Hello there", "Once upon"], n=2, max_tokens=4, ignore_eos=True, seed=1,
                             return_timings=True, logprobs=2)
    resp = asyncio.run(serving.create_completion(body, RequestContext(tenant="t")))
    assert isinstance(resp, dict)
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2, 3]
    assert all(len(c["logprobs"]["tokens"]) == 4 and c["finish_reason"] == "length" for c in resp["choices"])
    assert resp["usage"]["completion_tokens"] == 16
    assert [t["index"] for t in resp["pdserve_timings"]] == [0, 1, 2, 3]
    assert all(t["ttft"] > 0 for t in resp["pdserve_timings"])


def test_chat_stream_role_chunk_comes_with_first_token(aengine: EngineClient) -> None:
    """Each choice's role chunk is its first chunk and goes out only once that choice has its first token."""
    serving = OpenAIServingChat(aengine, MODEL)
    reqs = capture_children(serving)
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "Tell me a story " * 20}], n=2, max_tokens=5,
                                 ignore_eos=True, stream=True, stream_options={"include_usage": True},
                                 return_timings=True)
    seen: dict[int, list[dict[str, Any]]] = {0: [], 1: []}

    def on_chunk(chunk: dict[str, Any]) -> None:
        for ch in chunk["choices"]:
            if not seen[ch["index"]]:  # this choice's first chunk
                assert reqs[ch["index"]].times.first_token is not None, "chunk sent before the first token"
            seen[ch["index"]].append(ch)

    async def run() -> list[dict[str, Any]]:
        stream = await serving.create_chat_completion(body, RequestContext())
        assert not isinstance(stream, dict)
        return await read_sse(stream, on_chunk)

    chunks = asyncio.run(run())
    for choice_chunks in seen.values():
        assert choice_chunks[0]["delta"] == {"role": "assistant", "content": ""}
        assert sum("role" in ch["delta"] for ch in choice_chunks) == 1
        assert choice_chunks[-1]["finish_reason"] == "length"
        assert "".join(ch["delta"].get("content", "") for ch in choice_chunks)
    last = chunks[-1]  # usage and timings ride on one final chunk without choices
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    assert [t["index"] for t in last["pdserve_timings"]] == [0, 1]
    assert wait_kv_baseline(aengine).num_used_blocks == 0


def test_completion_stream_echo_goes_with_first_token(aengine: EngineClient) -> None:
    serving = OpenAIServingCompletion(aengine, MODEL)
    reqs = capture_children(serving)
    body = CompletionRequest(prompt="Hello there " * 30, max_tokens=3, ignore_eos=True, stream=True, echo=True)
    firsts: list[dict[str, Any]] = []

    def on_chunk(chunk: dict[str, Any]) -> None:
        if not firsts:
            assert reqs[0].times.first_token is not None, "echo sent before the first token"
            firsts.append(chunk)

    async def run() -> list[dict[str, Any]]:
        stream = await serving.create_completion(body, RequestContext())
        assert not isinstance(stream, dict)
        return await read_sse(stream, on_chunk)

    chunks = asyncio.run(run())
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert firsts[0]["choices"][0]["text"].startswith("Hello there " * 30) and len(text) > len("Hello there " * 30)


def test_stream_events_carry_chinese_as_utf8(aengine: EngineClient) -> None:
    """The server's SSE events (pdserve.api.sse, shared with the router) write Chinese as UTF-8 characters, as
    OpenAI does, not as \\u escapes: the echoed prompt appears verbatim in the raw event."""
    serving = OpenAIServingCompletion(aengine, MODEL)
    prompt = "你好，世界。请讲一个故事。"
    body = CompletionRequest(prompt=prompt, max_tokens=2, ignore_eos=True, stream=True, echo=True)

    async def run() -> list[str]:
        stream = await serving.create_completion(body, RequestContext())
        assert not isinstance(stream, dict)
        return [line async for line in stream]

    raw = asyncio.run(run())
    assert prompt in raw[0] and "\\u" not in raw[0], raw[0]
    assert json.loads(raw[0][len("data: "):])["choices"][0]["text"].startswith(prompt)
    assert raw[-1] == "data: [DONE]\n\n"


def test_every_error_code_has_one_answer() -> None:
    """api/errors.py's table answers every ErrorCode; a refusal keeps its message, param and code."""
    assert set(ERROR_STATUS) == set(ErrorCode)
    for code, (status, type_, kind) in ERROR_STATUS.items():
        err = from_rejected(RequestRejected("no", "p", code))
        assert (err.status, err.type, err.kind, err.code, err.param, err.message) == \
            (status, type_, kind, code.value, "p", "no")
        assert err.body()["error"]["code"] == code.value and (status == 400) == (type_ == "invalid_request_error")
        anthropic = err.anthropic_body()["error"]  # no param field: the message names it
        assert anthropic["message"] == "p: no" and (status == 400) == (anthropic["type"] == "invalid_request_error")
    # without a code of its own: the status's string code, or null; never a number
    assert APIError(404, "x").body()["error"]["code"] == "not_found"
    assert APIError(400, "x").body()["error"]["code"] is None
    assert APIError(418, "x", code=418).body()["error"]["code"] is None  # type: ignore[arg-type]


def test_rejected_and_failed_requests_carry_codes(aengine: EngineClient) -> None:
    serving = OpenAIServingCompletion(aengine, MODEL)
    # refused with its code; the app answers it (api/errors.py from_rejected)
    with pytest.raises(RequestRejected) as r:
        asyncio.run(serving.create_completion(CompletionRequest(prompt="hi", max_tokens=600), RequestContext()))
    assert (r.value.code, r.value.param) == (ErrorCode.CONTEXT_LENGTH_EXCEEDED, "max_tokens")
    err = from_rejected(r.value)
    assert (err.status, err.code, err.param, err.kind) == (400, "context_length_exceeded", "max_tokens",
                                                           "context_length")
    with pytest.raises(APIError) as e:
        asyncio.run(serving.create_completion(CompletionRequest(prompt="hi", model="other"), RequestContext()))
    assert e.value.status == 404 and e.value.code == "model_not_found"

    processor = aengine._engine.output_processor  # fault injection: every request's detokenizer raises
    original = processor.add_request

    def poisoned(req: Any) -> None:
        original(req)

        def boom(*_: Any, **__: Any) -> None:
            raise RuntimeError("poisoned request")

        processor.states[req.request_id].detokenizer.update = boom  # type: ignore[method-assign]

    processor.add_request = poisoned  # type: ignore[method-assign]
    try:
        with pytest.raises(APIError) as e:
            asyncio.run(serving.create_completion(CompletionRequest(prompt="hi", max_tokens=3), RequestContext()))
        assert (e.value.status, e.value.code) == (500, "postprocess_failed")

        async def stream() -> list[dict[str, Any]]:
            s = await serving.create_completion(CompletionRequest(prompt="hi", max_tokens=3, stream=True),
                                                RequestContext())
            assert not isinstance(s, dict)
            return await read_sse(s)

        assert [c["error"]["code"] for c in asyncio.run(stream())] == ["postprocess_failed"]

        async def anthropic_stream() -> list[str]:  # /v1/messages: named events, Anthropic's error body, no [DONE]
            messages = ServingMessages(OpenAIServingChat(aengine, MODEL))
            body = MessagesRequest(max_tokens=3, stream=True, messages=[{"role": "user", "content": "你好"}])
            s = await messages.create_message(body, RequestContext())
            assert not isinstance(s, dict)
            return [line async for line in s]

        events = asyncio.run(anthropic_stream())
        assert [e.split("\n")[0] for e in events] == ["event: message_start", "event: ping", "event: error"]
        error = json.loads(events[-1].split("\n")[1].removeprefix("data: "))
        assert error["type"] == "error" and error["error"]["type"] == "api_error" and error["error"]["message"]
    finally:
        processor.add_request = original  # type: ignore[method-assign]
    assert wait_kv_baseline(aengine).num_used_blocks == 0


def test_client_gone_while_collecting_aborts(aengine: EngineClient) -> None:
    serving = OpenAIServingCompletion(aengine, MODEL)
    serving._DISCONNECT_POLL_S = POLL_S

    async def gone() -> bool:
        return True

    body = CompletionRequest(prompt="Once upon a time", max_tokens=400, ignore_eos=True)
    with pytest.raises(APIError) as e:
        asyncio.run(serving.create_completion(body, RequestContext(is_disconnected=gone)))
    assert e.value.status == 499
    deadline = time.monotonic() + 10
    while aengine.num_unfinished and time.monotonic() < deadline:
        time.sleep(0.02)
    assert aengine.num_unfinished == 0
    snap = wait_kv_baseline(aengine)
    assert snap.num_used_blocks == 0 and snap.num_requests_holding_blocks == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.num_used_blocks = 1  # type: ignore[misc]


def test_admission_is_all_or_none_before_the_response(aengine: EngineClient) -> None:
    """A request whose children do not all fit the waiting queue is a 429 raised before any stream starts, and
    none of its children is left in the engine (no orphan holds KV blocks)."""
    serving = OpenAIServingCompletion(aengine, MODEL)
    aengine.max_waiting_requests = 2
    try:
        for stream in (False, True):
            body = CompletionRequest(prompt="hi", n=3, max_tokens=50, ignore_eos=True, stream=stream)
            with pytest.raises(APIError) as e:
                asyncio.run(serving.create_completion(body, RequestContext()))
            assert (e.value.status, e.value.code) == (429, "too_many_requests")
            assert aengine.num_unfinished == 0
    finally:
        aengine.max_waiting_requests = None
    assert wait_kv_baseline(aengine).num_used_blocks == 0


def test_aborts_write_a_log_line_and_unread_streams_abort(aengine: EngineClient,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    serving = OpenAIServingCompletion(aengine, MODEL)
    serving._DISCONNECT_POLL_S = POLL_S

    async def gone() -> bool:
        return True

    with caplog.at_level(logging.INFO, logger="pdserve.requests"):
        body = CompletionRequest(prompt="Once upon a time", max_tokens=400, ignore_eos=True)
        with pytest.raises(APIError):
            asyncio.run(serving.create_completion(body, RequestContext(tenant="gone", is_disconnected=gone)))
        deadline = time.monotonic() + 10
        while aengine.num_unfinished and time.monotonic() < deadline:
            time.sleep(0.02)
    recs = [json.loads(r.getMessage()) for r in caplog.records if r.name == "pdserve.requests"]
    assert [(r["tenant"], r["finish_reason"]) for r in recs] == [("gone", "abort")]

    async def never_read() -> None:  # the response never starts (client gone before its first byte)
        s = await serving.create_completion(CompletionRequest(prompt="hi", max_tokens=400, ignore_eos=True, n=2,
                                                              stream=True), RequestContext())
        assert aengine.num_unfinished == 2
        del s

    asyncio.run(never_read())
    deadline = time.monotonic() + 10
    while aengine.num_unfinished and time.monotonic() < deadline:
        time.sleep(0.02)
    assert aengine.num_unfinished == 0 and wait_kv_baseline(aengine).num_used_blocks == 0


def test_requests_cut_at_shutdown_leave_log_lines(tiny_hf_model: Any, tokenizer: Any,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Shutdown: a request refused at admission (the grace ran out) and one still running when the engine loop
    stops each write their request-log line (issue 31 item 8)."""
    engine = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=128, max_model_len=512),
                       model=loaded_from_hf(tiny_hf_model), tokenizer=tokenizer)
    client = EngineClient(engine, Metrics(MODEL))
    client.start()
    serving = OpenAIServingCompletion(client, MODEL)
    body = CompletionRequest(prompt="Once upon a time", max_tokens=400, ignore_eos=True, stream=True)

    async def cut() -> str:
        stream = await serving.create_completion(body, RequestContext(tenant="running"))
        assert not isinstance(stream, dict)
        first = await anext(aiter(stream))
        client.shutdown()  # its abort is queued as the loop stops
        return str(json.loads(first[6:])["id"])

    with caplog.at_level(logging.INFO, logger="pdserve.requests"):
        rid = asyncio.run(cut())
        client.closed = True  # as fail_all leaves it
        with pytest.raises(APIError) as exc:
            asyncio.run(serving.create_completion(body, RequestContext(tenant="late")))
    assert exc.value.status == 503 and exc.value.code == "server_shutting_down"
    recs = [json.loads(r.getMessage()) for r in caplog.records if r.name == "pdserve.requests"]
    assert [(r["request_id"], r["finish_reason"]) for r in recs if r["tenant"] == "running"] == [(f"{rid}-0-0",
                                                                                                 "abort")]
    assert [(r["finish_reason"], r["error"]) for r in recs if r["tenant"] == "late"] == [
        ("abort", "server_shutting_down")]


THINK_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>"
                  "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n{% endif %}"
                  "{% endif %}")


class _ThinkTemplateTokenizer:
    """The session's real tokenizer with a Qwen3-style template that reads `enable_thinking`."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    def apply_chat_template(self, messages: list[dict[str, Any]], **kw: Any) -> Any:
        return self.tok.apply_chat_template(messages, chat_template=THINK_TEMPLATE, **kw)

    def encode(self, text: str, **kw: Any) -> list[int]:
        return list(self.tok.encode(text, **kw))


def test_chat_template_kwargs_reach_the_template(tokenizer: Any) -> None:
    """chat_template_kwargs become template variables (Qwen3's enable_thinking); what the renderer sets itself
    (tools, messages, add_generation_prompt, ...) cannot be overridden through them."""
    from pdserve.server.chat_template import render_chat

    tok = _ThinkTemplateTokenizer(tokenizer)
    msgs = [{"role": "user", "content": "你好，请介绍一下杭州。"}]
    plain = render_chat(tok, msgs)["prompt"]
    off = render_chat(tok, msgs, template_kwargs={"enable_thinking": False})["prompt"]
    on = render_chat(tok, msgs, template_kwargs={"enable_thinking": True})["prompt"]
    assert "<think>" not in plain and plain == on and off == plain + "<think>\n\n</think>\n"
    for key in ("tools", "add_generation_prompt", "messages"):
        with pytest.raises(RequestRejected) as e:
            render_chat(tok, msgs, template_kwargs={key: None})
        assert e.value.param == "chat_template_kwargs" and e.value.code == ErrorCode.INVALID_PARAMETER


def spy_template_kwargs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any] | None]:
    """The template_kwargs of every render_chat call the serving layer makes, in order."""
    import pdserve.server.serving as serving_mod

    seen: list[dict[str, Any] | None] = []
    real = serving_mod.render_chat

    def spy(tok: Any, msgs: list[dict[str, Any]], agp: bool = True, tools: Any = None,
            template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        seen.append(template_kwargs)
        return real(tok, msgs, agp, tools, template_kwargs)

    monkeypatch.setattr(serving_mod, "render_chat", spy)
    return seen


def test_chat_request_passes_chat_template_kwargs(aengine: EngineClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chat endpoint accepts chat_template_kwargs (vLLM's field), hands them to the template renderer, and
    refuses reserved keys with a coded 400 before anything is scheduled."""
    seen = spy_template_kwargs(monkeypatch)
    serving = OpenAIServingChat(aengine, MODEL)
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "你好"}], max_tokens=3, ignore_eos=True,
                                 chat_template_kwargs={"enable_thinking": False})
    out = asyncio.run(serving.create_chat_completion(body, RequestContext()))
    assert isinstance(out, dict) and out["usage"]["completion_tokens"] == 3
    assert seen == [{"enable_thinking": False}]
    bad = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                chat_template_kwargs={"tools": []})
    with pytest.raises(RequestRejected) as e:
        asyncio.run(serving.create_chat_completion(bad, RequestContext()))
    # the renderer itself refuses (one check, shared with LLM.chat), before anything is scheduled
    assert e.value.param == "chat_template_kwargs" and seen == [{"enable_thinking": False}, {"tools": []}]
    assert wait_kv_baseline(aengine).num_used_blocks == 0


def test_default_chat_template_kwargs_sit_under_the_request_s(aengine: EngineClient,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """--default-chat-template-kwargs: every chat request's template gets them; a request's own value for the same
    name wins. The flag refuses what is not a JSON object and what the renderer sets itself."""
    import argparse

    from pdserve.cli import _template_kwargs_arg
    from pdserve.server.serving import ServingOptions

    seen = spy_template_kwargs(monkeypatch)
    defaults = _template_kwargs_arg('{"enable_thinking": false, "风格": "简洁"}')
    serving = OpenAIServingChat(aengine, MODEL, options=ServingOptions(default_chat_template_kwargs=defaults))
    for own in (None, {"enable_thinking": True}):
        body = ChatCompletionRequest(messages=[{"role": "user", "content": "你好"}], max_tokens=2, ignore_eos=True,
                                     chat_template_kwargs=own)
        out = asyncio.run(serving.create_chat_completion(body, RequestContext()))
        assert isinstance(out, dict) and out["usage"]["completion_tokens"] == 2
    assert seen == [{"enable_thinking": False, "风格": "简洁"}, {"enable_thinking": True, "风格": "简洁"}]
    for bad in ('["enable_thinking"]', '{"tools": []}', "{not json"):
        with pytest.raises(argparse.ArgumentTypeError):
            _template_kwargs_arg(bad)
    assert wait_kv_baseline(aengine).num_used_blocks == 0


def test_admission_gives_free_batch_seats_before_counting_waiting(tiny_hf_model: Any, tokenizer: Any) -> None:
    """max_num_seqs 2, max_waiting_requests 1: with the engine loop not running yet (nothing scheduled), a burst of
    3 is admitted (2 seats + 1 waiting) and the 4th is refused; requests the engine thread has not picked up yet
    are not 'waiting' while the batch has room for them."""
    from pdserve import SamplingParams
    from pdserve.engine.client import QueueFull

    engine = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=64, max_model_len=256, max_num_seqs=2,
                                    device_peaks="off"), model=loaded_from_hf(tiny_hf_model), tokenizer=tokenizer)
    client = EngineClient(engine, None, max_waiting_requests=1)  # not started: nothing gets scheduled

    async def burst() -> int:
        params = SamplingParams(max_tokens=2)
        for i in range(3):
            client.add_requests([engine.make_request({"prompt_token_ids": [1, 2, 3]}, params, f"r{i}")])
        with pytest.raises(QueueFull):
            client.add_requests([engine.make_request({"prompt_token_ids": [1, 2, 3]}, params, "r3")])
        return len(client._streams)

    assert asyncio.run(burst()) == 3
    engine.close()


def test_a_steps_outputs_reach_each_loop_in_one_call_and_in_order() -> None:
    """StepDeliveries: a step's outputs go to each consumer loop with one thread-safe call (not one per stream),
    every stream's queue gets its items in order, and a closed loop is skipped without an error."""
    from pdserve.engine.streams import RequestStream, StepDeliveries
    from pdserve.outputs import RequestOutput

    loop = asyncio.new_event_loop()
    closed = asyncio.new_event_loop()
    closed.close()
    calls = 0
    real = loop.call_soon_threadsafe

    def counting(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        return real(*args)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        streams = [RequestStream(loop, asyncio.Queue(), cast(Any, None)) for _ in range(3)]
        gone = RequestStream(closed, asyncio.Queue(), cast(Any, None))
        outs = [[cast(RequestOutput, f"s{i}-t{t}") for t in range(2)] for i in range(3)]
        for t in range(2):  # two steps
            batch = StepDeliveries()
            for i, s in enumerate(streams):
                batch.add(s, outs[i][t])
            batch.add(gone, cast(RequestOutput, "lost"))
            batch.flush()
        assert calls == 2  # one per step for the live loop
        loop.run_until_complete(asyncio.sleep(0))
        for i, s in enumerate(streams):
            assert [s.queue.get_nowait() for _ in range(2)] == outs[i]
            assert s.queue.empty()
    finally:
        loop.close()

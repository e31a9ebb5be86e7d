"""Reasoning parsers (`--reasoning-parser`): the split of a reply into reasoning_content and content, whole and
streamed (however the deltas cut the tags), and through the chat serving object on a real engine."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from test_serving import MODEL, aengine, read_sse, wait_kv_baseline  # noqa: F401  (aengine: a fixture)

from pdserve.api.protocol import ChatCompletionRequest
from pdserve.engine.client import EngineClient
from pdserve.server.reasoning import get_reasoning_parser
from pdserve.server.serving import RequestContext, ServingOptions
from pdserve.server.serving_chat import OpenAIServingChat

CASES = [
    ("qwen3", "<think>\n先想一想：6 乘 7。</think>\n\n答案是 42。", ("先想一想：6 乘 7。", "答案是 42。")),
    ("qwen3", "直接回答：42", (None, "直接回答：42")),
    ("qwen3", "<think>还没想完", ("还没想完", "")),
    ("qwen3", "a <thinking> tag is not </think> one", (None, "a <thinking> tag is not </think> one")),
    ("deepseek_r1", "思考中……</think>\n结果", ("思考中……", "结果")),
    ("deepseek_r1", "一直在想", ("一直在想", "")),
]


@pytest.mark.parametrize("name, text, want", CASES)
def test_split_whole_and_streamed_at_every_cut(name: str, text: str, want: tuple[str | None, str]) -> None:
    parser = get_reasoning_parser(name)
    assert parser is not None and parser.extract(text) == want
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            stream = parser.stream()
            pieces = stream.feed(text[:i]) + stream.feed(text[i:j]) + stream.feed(text[j:]) + stream.finish()
            assert all("<think>" not in t and "</think>" not in t for k, t in pieces if k == "reasoning")
            reasoning = "".join(t for k, t in pieces if k == "reasoning")
            got = (reasoning if any(k == "reasoning" for k, _ in pieces) else None,
                   "".join(t for k, t in pieces if k == "content"))
            assert got == want, (i, j, pieces)


def test_unknown_parser_is_refused() -> None:
    assert get_reasoning_parser(None) is None
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_reasoning_parser("o1")


def _chat(client: EngineClient, parser: str | None, stream: bool) -> Any:
    serving = OpenAIServingChat(client, MODEL, options=ServingOptions(reasoning_parser=parser))
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "你好，请介绍一下杭州。"}], max_tokens=12,
                                 temperature=0, ignore_eos=True, stream=stream)

    async def run() -> Any:
        out = await serving.create_chat_completion(body, RequestContext())
        return out if isinstance(out, dict) else await read_sse(out)

    return asyncio.run(run())


def test_chat_reply_goes_to_reasoning_content(aengine: EngineClient) -> None:  # noqa: F811
    """deepseek_r1 (its template opens <think>): a reply that never closes it is all reasoning, streamed and not;
    qwen3: a reply without <think> is all content. The same greedy text either way."""
    plain = _chat(aengine, None, False)["choices"][0]["message"]
    text = plain["content"]
    assert text and "reasoning_content" not in plain
    r1 = _chat(aengine, "deepseek_r1", False)["choices"][0]["message"]
    assert r1["reasoning_content"] == text and r1["content"] == ""
    q3 = _chat(aengine, "qwen3", False)["choices"][0]["message"]
    assert q3["reasoning_content"] is None and q3["content"] == text
    chunks = _chat(aengine, "deepseek_r1", True)
    deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == text
    assert "".join(d.get("content", "") for d in deltas) == ""
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert wait_kv_baseline(aengine).num_used_blocks == 0


def test_openai_client_reads_reasoning_content(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Any) -> None:
    """Over HTTP with the official client, streamed and not: `reasoning_content` (an extra field the SDK keeps)."""
    import openai

    from pdserve.launch import start_server

    srv = start_server(tmp_path_factory.mktemp("reasoning"), "--model", str(tiny_dir), "--dtype", "float32",
                       "--num-kv-blocks", "64", "--max-model-len", "256", "--device-peaks", "off",
                       "--reasoning-parser", "deepseek_r1")
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        kw: dict[str, Any] = {"model": client.models.list().data[0].id, "max_tokens": 8, "temperature": 0,
                              "messages": [{"role": "user", "content": "你好"}], "extra_body": {"ignore_eos": True}}
        msg = client.chat.completions.create(**kw).choices[0].message
        reasoning = (msg.model_extra or {}).get("reasoning_content")
        assert reasoning and msg.content == ""
        streamed = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kw) if c.choices]
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in streamed) == reasoning
        assert "".join(d.content or "" for d in streamed) == ""
    finally:
        assert srv.stop() in (0, -15)

"""One streaming request against an OpenAI-compatible server, timed per chunk as vLLM's serving benchmark does.

t_send is taken just before the request goes out; TTFT = first chunk with text − t_send; every later chunk with
text adds one ITL sample (the gap since the previous text chunk); E2EL = end of stream − t_send. A chunk may carry
several tokens (a detokenizer holding back half a UTF-8 character), so token counts come from the final `usage`
chunk (`stream_options.include_usage`), not from counting chunks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdserve.bench.datasets import SampleRequest

MAX_ERROR_CHARS = 500


@dataclass
class RequestRecord:
    """The client-side account of one request. Times are seconds; `arrival` and `send` are offsets from the start
    of the run. Invariant for a success: ttft <= e2el and len(itl) == num_chunks - 1."""

    index: int
    prompt_len: int | None  # usage.prompt_tokens, else the dataset's count
    expected_output_len: int  # max_tokens sent
    arrival: float = 0.0  # scheduled arrival
    send: float = 0.0  # after a concurrency slot was free (send - arrival = client-side wait)
    success: bool = False
    error: str = ""
    status_code: int | None = None
    request_id: str | None = None  # the response's `id`
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    output_len: int = 0  # usage.completion_tokens, else counted by the tokenizer or chunks (see output_len_source)
    output_len_source: str = "usage"
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    num_chunks: int = 0  # SSE chunks that carried text
    finish_reason: str | None = None
    generated_text: str = ""

    @property
    def tpot(self) -> float:
        """(E2EL − TTFT) / (output tokens − 1); 0 for a request with at most one output token (vLLM's rule)."""
        return (self.e2el - self.ttft) / (self.output_len - 1) if self.success and self.output_len > 1 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["tpot"] = self.tpot
        return d


@dataclass(frozen=True)
class Target:
    """Where and how to send: the full URL, the model name, and the request options shared by every request."""

    url: str
    model: str
    chat: bool
    temperature: float = 0.0
    ignore_eos: bool = False
    top_p: float = 1.0  # sent when below 1
    headers: dict[str, str] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request body (e.g. `user`)


def build_body(target: Target, sample: SampleRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": target.model, "temperature": target.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.top_p < 1:
        body["top_p"] = target.top_p
    body.update(target.extra_body)
    if target.chat:
        body["messages"] = [{"role": "user", "content": sample.prompt}]
        body["max_completion_tokens"] = sample.output_len
    else:
        body["prompt"] = sample.prompt
        body["max_tokens"] = sample.output_len
    return body


def error_message(status: int, body: bytes) -> str:
    """'HTTP 400: <OpenAI error message>' (or the start of a non-JSON body)."""
    text = body.decode("utf-8", errors="replace")
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        msg = err.get("message") or err.get("detail") or text if isinstance(err, dict) else str(err)
    except json.JSONDecodeError:
        msg = text
    return f"HTTP {status}: {str(msg)[:MAX_ERROR_CHARS]}"


def chunk_text(obj: dict[str, Any], chat: bool) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if chat:
        return (c.get("delta") or {}).get("content") or ""
    return c.get("text") or ""


class _Stream:
    """Accumulates one SSE stream into a RequestRecord."""

    def __init__(self, rec: RequestRecord, t_send: float, chat: bool) -> None:
        self.rec, self.t_send, self.chat = rec, t_send, chat
        self.last = t_send
        self.parts: list[str] = []

    def on_data(self, data: str, now: float) -> None:
        obj = json.loads(data)
        if "error" in obj:  # an error after the response started (sent as an SSE event)
            err = obj["error"]
            raise _StreamFailed(f"stream error: {err.get('message', err) if isinstance(err, dict) else err}")
        rec = self.rec
        rec.request_id = rec.request_id or obj.get("id")
        if usage := obj.get("usage"):
            rec.prompt_len = usage.get("prompt_tokens", rec.prompt_len)
            rec.output_len = usage.get("completion_tokens", 0)
            rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        for c in obj.get("choices") or []:
            rec.finish_reason = c.get("finish_reason") or rec.finish_reason
        text = chunk_text(obj, self.chat)
        if not text:
            return
        if rec.num_chunks == 0:
            rec.ttft = now - self.t_send
        else:
            rec.itl.append(now - self.last)
        self.last = now
        rec.num_chunks += 1
        self.parts.append(text)

    def finish(self, now: float) -> None:
        rec = self.rec
        rec.e2el = now - self.t_send
        rec.generated_text = "".join(self.parts)
        if rec.num_chunks == 0:
            raise _StreamFailed("the stream carried no text, so TTFT is undefined")
        if not rec.output_len:
            rec.output_len_source = "none"  # no usage chunk: the runner counts tokens
        rec.success = True


class _StreamFailed(Exception):
    pass


Clock = Callable[[], float]  # seconds; the latency stamps' clock


async def send_request(http: httpx.AsyncClient, target: Target, sample: SampleRequest, rec: RequestRecord,
                       t0: float, clock: Clock = time.perf_counter) -> RequestRecord:
    """Send `sample`, stream the answer into `rec` (its index/arrival already set) and return it. Never raises for
    a failed request: the error text and status code go into the record. `clock` stamps TTFT, ITL and E2EL (wall
    time by default; `rec.send`, an offset from the run's start `t0`, is always wall time)."""
    rec.send = time.perf_counter() - t0
    t_send = clock()
    stream = _Stream(rec, t_send, target.chat)
    try:
        async with http.stream("POST", target.url, json=build_body(target, sample), headers=target.headers) as resp:
            rec.status_code = resp.status_code
            if resp.status_code != 200:
                rec.error = error_message(resp.status_code, await resp.aread())
                rec.e2el = clock() - t_send
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event names
                now = clock()
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                stream.on_data(data, now)
        stream.finish(clock())
    except _StreamFailed as e:
        rec.error = str(e)[:MAX_ERROR_CHARS]
        rec.e2el = clock() - t_send
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS] if str(e) else type(e).__name__
        rec.e2el = clock() - t_send
    return rec

"""uvicorn's h11 protocol with the two guards on a request's head (request line + headers) that neither h11 nor
uvicorn gives: a deadline to receive it and a bound on its size and header count.

- Slowloris: uvicorn arms no timer until a first response is sent, and its keep-alive timer stops at the first
  byte of the next request, so a client sending a byte a second holds a connection (and its buffers) forever. Here
  each head must arrive within `read_timeout` seconds of the connection opening or the previous response ending;
  after that the connection gets a 408 and is closed. The body has its own deadline (AuthAndBodyLimitMiddleware,
  `--body-read-timeout`).
- Oversized heads: h11 bounds only an incomplete head (its `max_incomplete_event_size`, checked when it needs more
  data), so a 1 MB header or 10,000 headers arriving in one read are parsed and served. Here the bytes are counted
  before h11 sees them: a head over `max_bytes` or with more than `max_headers` lines gets a 431 and is closed.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_HEAD_END = re.compile(rb"\r?\n\r?\n")  # h11 accepts bare LF line endings too


LINGER_S = 2.0  # how long a connection closed with a 408/431 still reads (and drops) what its client sends


@dataclass(frozen=True)
class HeadLimits:
    read_timeout: float = 10.0  # seconds to receive a request's line and headers (--header-read-timeout)
    max_bytes: int = 32 * 1024  # request line + headers (--max-header-bytes); Apache/nginx allow ~8-32 KB
    max_headers: int = 100  # header lines, as Apache's LimitRequestFields


def _raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    """H11Protocol whose request heads are bounded in time and size (HeadLimits; `guarded_protocol` binds them)."""

    limits: ClassVar[HeadLimits] = HeadLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None  # the head's deadline, or the end of a lingering close
        self._lingering = False
        self._start_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._start_head()  # the next request's head, on a kept-alive connection
        super().on_response_complete()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return
        if self._head is not None and self.conn.their_state is h11.IDLE and not self._scan_head(data):
            return
        super().data_received(data)

    # ---- the head's bounds ---------------------------------------------------------------------------------
    def _start_head(self) -> None:
        self._head: bytearray | None = bytearray()  # the head received so far (None: complete)
        self._stop_head_timer()
        self._head_timer = self.loop.call_later(self.limits.read_timeout, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _scan_head(self, data: bytes) -> bool:
        """Count `data` into the head; False when the head is over a bound (then answered 431 and closed)."""
        assert self._head is not None
        start = max(len(self._head) - 3, 0)
        self._head += data[: self.limits.max_bytes + 4 - len(self._head)]  # never more than the bound is kept
        end = _HEAD_END.search(self._head, start)
        head = self._head if end is None else self._head[: end.start()]
        if len(head) > self.limits.max_bytes or head.count(b"\n") > self.limits.max_headers:
            self._close_with(_raw_response(431, "Request Header Fields Too Large", "request headers exceed "
                                           f"{self.limits.max_bytes} bytes or {self.limits.max_headers} fields",
                                           "request_header_fields_too_large"))
            return False
        if end is not None:
            self._head = None
            self._stop_head_timer()
        return True

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._head is None or self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return  # the head arrived (a pipelined request's, without passing data_received)
        reply = _raw_response(408, "Request Timeout", f"request headers not received within "
                              f"{self.limits.read_timeout:g} s", "request_timeout") if self._head else b""
        self._close_with(reply)

    def _close_with(self, reply: bytes) -> None:
        """Send `reply` and close. With a reply, close as nginx's lingering close does: half-close after it and
        drop what still arrives for LINGER_S; closing a socket with bytes arriving makes the kernel answer them
        with a reset, which can discard the reply before the client reads it."""
        self._stop_head_timer()
        self._head = None
        self.transport.write(reply)  # b"": nothing
        if not reply or not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self._lingering = True  # data_received drops; the client's EOF (eof_received) or the timer closes
        self._head_timer = self.loop.call_later(LINGER_S, self.transport.close)


def guarded_protocol(limits: HeadLimits) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn.Config(http=...), its heads bounded by `limits`."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


# Clients pool idle connections for a while (httpx, and so the openai and anthropic clients: 5 s) and reuse them
# without retrying a POST: a server that closes an idle connection at the same moment races them (ReadError).
CLIENT_KEEPALIVE_EXPIRY = 5.0


def uvicorn_options(limits: HeadLimits) -> dict[str, Any]:
    """uvicorn.Config keyword arguments for guarded heads (h11's own bound on an incomplete head set to match).
    An idle kept-alive connection is closed, silently, by the head timer (`read_timeout` after the last response);
    uvicorn's own keep-alive timer is set past both it and clients' pool expiry so that it never fires first."""
    keep_alive = max(limits.read_timeout, CLIENT_KEEPALIVE_EXPIRY) + 1
    return {"http": guarded_protocol(limits), "h11_max_incomplete_event_size": limits.max_bytes + 4,
            "timeout_keep_alive": int(keep_alive + 0.999)}

"""`x-request-id` on every response (the server's and the router's): the client's own `X-Request-Id`, sanitized, or
a new id. The id is also put back into the request's headers, so the routes read one value (`request_id(raw)`),
the request log line carries it, and the router forwards it to the instances it calls (one id across the hops).
Anthropic routes also answer it as `request-id`, the header the `anthropic` client reads (`message._request_id`)."""

from __future__ import annotations

import re
import uuid

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.api.errors import ANTHROPIC_PREFIX

HEADER = "x-request-id"
MAX_LEN = 128  # longer ids are cut to this many characters
_UNSAFE = re.compile(r"[^A-Za-z0-9._:/=+-]")  # kept: what log parsers and shells read as one word


def sanitize(raw: str | None) -> str:
    """The client's id with every character outside the safe set dropped, at most MAX_LEN long; a new
    `req_<hex>` id when nothing is left (or none was sent)."""
    cleaned = _UNSAFE.sub("", raw or "")[:MAX_LEN]
    return cleaned or f"req_{uuid.uuid4().hex}"


def request_id(raw: Request) -> str | None:
    """The request's id as the middleware set it (None outside the middleware, e.g. a bare test app)."""
    return raw.headers.get(HEADER)


class RequestIdMiddleware:
    """Outermost: every answer carries the id, refusals by the guards included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == HEADER.encode()), None)
        rid = sanitize(sent).encode()
        scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != HEADER.encode()] + [(HEADER.encode(),
                                                                                                     rid)]
        names = {HEADER.encode(), b"request-id"} if scope["path"].startswith(ANTHROPIC_PREFIX) else {HEADER.encode()}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*(h for h in message.get("headers", []) if h[0].lower() not in names),
                                      *((name, rid) for name in sorted(names))]
            await send(message)

        await self.app(scope, receive, send_with_id)

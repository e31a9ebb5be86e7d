"""ASGI middleware that guards the API before any route runs: the API key and the request body size cap."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.server.errors import APIError, error_response
from pdserve.server.metrics import Metrics

# Paths that need the API key (when one is set); /health, /metrics and /debug stay open for probes.
_KEYED_PREFIX = "/v1"
_KEYED_PATHS = ("/tokenize", "/detokenize")


class AuthAndBodyLimitMiddleware:
    """Refuse requests without `Authorization: Bearer <api_key>` (401) on the API paths, and bodies over
    `max_body_bytes` (413), checked on the declared Content-Length and again on the bytes actually received
    (a chunked upload declares none)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, metrics: Metrics) -> None:
        self.app, self.api_key, self.max_body_bytes, self.metrics = app, api_key, max_body_bytes, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key and (path.startswith(_KEYED_PREFIX) or path in _KEYED_PATHS):
            if headers.get("authorization", "") != f"Bearer {self.api_key}":
                self.metrics.error("unauthorized")
                await error_response(APIError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                                              "authentication_error", code="invalid_api_key"))(scope, receive, send)
                return
        limit = self.max_body_bytes
        if int(headers.get("content-length", "0") or 0) > limit:
            self.metrics.error("payload_too_large")
            await error_response(_too_large(limit))(scope, receive, send)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise _too_large(limit)  # reaches the app's APIError handler, which counts it
            return msg

        await self.app(scope, limited_receive, send)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds {limit} bytes", code="payload_too_large", kind="payload_too_large")

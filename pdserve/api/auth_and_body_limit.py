"""ASGI middleware that guards the API before any route runs: the API key, the body size cap, the body read
deadline."""

from __future__ import annotations

import asyncio
import hmac
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.api.errors import APIError, ErrorCounter, error_response

# Paths that need the API key (when one is set); /health stays open for probes. /metrics (tenant names, load) and
# /version (commit, library versions) and /kv/prefix_hashes (which cached prefixes) need it too unless
# `public_metrics` (`--metrics-public`).
_KEYED_PREFIXES = ("/v1", "/debug", "/docs", "/redoc")
_KEYED_PATHS = ("/tokenize", "/detokenize", "/openapi.json", "/start_profile", "/stop_profile")
_METRICS_PATHS = ("/metrics", "/version", "/kv/prefix_hashes")


class AuthAndBodyLimitMiddleware:
    """Refuse requests without `Authorization: Bearer <api_key>` or `x-api-key: <api_key>` (401; scheme
    case-insensitive, key compared in constant time) on the API and introspection paths; bodies over
    `max_body_bytes` (413), checked on the declared Content-Length and on the bytes received (a chunked upload
    declares none); and bodies not received within `body_read_timeout` seconds (408: a client that trickles its
    body cannot hold a connection open).

    The body is read here in full (it is needed in full anyway) and replayed to the app; later receives (the
    app listening for a disconnect) go to the client."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, metrics: ErrorCounter,
                 body_read_timeout: float = 30.0, admin_api_key: str | None = None,
                 public_metrics: bool = False) -> None:
        self.app, self.max_body_bytes, self.metrics = app, max_body_bytes, metrics
        self.api_key = api_key.encode() if api_key else None
        self.admin_api_key = admin_api_key.encode() if admin_api_key else None  # opens the API too
        self.body_read_timeout = body_read_timeout
        self.keyed_paths = _KEYED_PATHS + (() if public_metrics else _METRICS_PATHS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            if self.api_key and (path.startswith(_KEYED_PREFIXES) or path in self.keyed_paths):
                self._check_key(headers.get("authorization", ""), headers.get("x-api-key"))
            if int(headers.get("content-length", "0") or 0) > self.max_body_bytes:
                raise _too_large(self.max_body_bytes)
            body, more = await self._read_body(receive) if scope["method"] in ("POST", "PUT", "PATCH") else (b"", [])
        except ValueError:  # a Content-Length that is not a number
            await self._refuse(APIError(400, "invalid Content-Length header"), scope, receive, send)
            return
        except APIError as e:
            await self._refuse(e, scope, receive, send)
            return
        replay: list[Message] = [{"type": "http.request", "body": body, "more_body": False}, *more]

        async def replaying_receive() -> Message:
            return replay.pop(0) if replay else await receive()

        await self.app(scope, replaying_receive if scope["method"] in ("POST", "PUT", "PATCH") else receive, send)

    def _check_key(self, authorization: str, x_api_key: str | None) -> None:
        """`Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's)."""
        scheme, _, token = authorization.strip().partition(" ")
        if x_api_key is not None and not authorization:
            scheme, token = "bearer", x_api_key
        key = token.strip().encode()
        admin = self.admin_api_key is not None and hmac.compare_digest(key, self.admin_api_key)
        if scheme.lower() != "bearer" or not (hmac.compare_digest(key, self.api_key or b"") or admin):
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                           "authentication_error", code="invalid_api_key", kind="unauthorized")

    async def _read_body(self, receive: Receive) -> tuple[bytes, list[Message]]:
        """The whole body, within the size cap and the read deadline. A disconnect ends it early (returned as a
        message for the app to see)."""
        parts: list[bytes] = []
        seen = 0
        deadline = time.monotonic() + self.body_read_timeout
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
            except TimeoutError:
                raise APIError(408, f"request body not received within {self.body_read_timeout:g} s",
                               code="request_timeout", kind="request_timeout") from None
            if msg["type"] != "http.request":  # http.disconnect
                return b"".join(parts), [msg]
            chunk = msg.get("body", b"")
            seen += len(chunk)
            if seen > self.max_body_bytes:
                raise _too_large(self.max_body_bytes)
            parts.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(parts), []

    async def _refuse(self, e: APIError, scope: Scope, receive: Receive, send: Send) -> None:
        self.metrics.error(e.kind)
        await error_response(e, scope["path"])(scope, receive, send)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds {limit} bytes", code="payload_too_large", kind="payload_too_large")

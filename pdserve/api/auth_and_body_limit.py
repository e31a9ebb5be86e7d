"""ASGI middleware that guards the API before any route runs: the API key, the body size cap, the body read
deadline."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.api.api_keys import ApiKey, KeyRing, default_name
from pdserve.api.errors import APIError, ErrorCounter, error_response
from pdserve.api.key_limiter import KeyLimiter, TokenQuota

# Paths that need the API key (when one is set); /health stays open for probes. /metrics (tenant names, load) and
# /version (commit, library versions) and /kv/prefix_hashes (which cached prefixes) need it too unless
# `public_metrics` (`--metrics-public`).
_KEYED_PREFIXES = ("/v1", "/debug", "/docs", "/redoc")
_KEYED_PATHS = ("/tokenize", "/detokenize", "/openapi.json", "/start_profile", "/stop_profile")
_METRICS_PATHS = ("/metrics", "/version", "/kv/prefix_hashes")
QUOTA_SCOPE_KEY = "pdserve.token_quota"  # the request's key_limiter.TokenQuota, when its key limits tokens/min


class AuthAndBodyLimitMiddleware:
    """Refuse requests without `Authorization: Bearer KEY` or `x-api-key: KEY` (401; scheme case-insensitive, keys
    compared in constant time) on the API and introspection paths; requests over their key's requests/min or
    concurrency (429 with Retry-After, key_limiter.py); bodies over
    `max_body_bytes` (413), checked on the declared Content-Length and on the bytes received (a chunked upload
    declares none); and bodies not received within `body_read_timeout` seconds (408: a client that trickles its
    body cannot hold a connection open).

    The body is read here in full (it is needed in full anyway) and replayed to the app; later receives (the
    app listening for a disconnect) go to the client."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, metrics: ErrorCounter,
                 body_read_timeout: float = 30.0, admin_api_key: str | None = None,
                 public_metrics: bool = False, keys: KeyRing | None = None,
                 limiter: KeyLimiter | None = None, on_key_refused: Callable[[str, int], None] | None = None) -> None:
        self.app, self.max_body_bytes, self.metrics = app, max_body_bytes, metrics
        # `keys` (api_keys.py), else the one `api_key`; None: the API is open
        self.keys = keys or (KeyRing([ApiKey(default_name(api_key), api_key.encode())], False) if api_key else None)
        self.limiter = limiter
        self.on_key_refused = on_key_refused  # (key name, status): a key over its limits, counted for its tenant
        self.admin_api_key = admin_api_key.encode() if admin_api_key else None  # opens the API too
        self.body_read_timeout = body_read_timeout
        self.keyed_paths = _KEYED_PATHS + (() if public_metrics else _METRICS_PATHS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key: ApiKey | None = None
        try:
            if self.keys and (path.startswith(_KEYED_PREFIXES) or path in self.keyed_paths):
                key = self._check_key(headers.get("authorization", ""), headers.get("x-api-key"))
            if int(headers.get("content-length", "0") or 0) > self.max_body_bytes:
                raise _too_large(self.max_body_bytes)
            body, more = await self._read_body(receive) if scope["method"] in ("POST", "PUT", "PATCH") else (b"", [])
            if key is not None and self.limiter is not None:
                self._enter(key.name)  # last: a request refused above spends none of the key's limits
        except ValueError:  # a Content-Length that is not a number
            await self._refuse(APIError(400, "invalid Content-Length header"), scope, receive, send)
            return
        except APIError as e:
            await self._refuse(e, scope, receive, send)
            return
        replay: list[Message] = [{"type": "http.request", "body": body, "more_body": False}, *more]

        async def replaying_receive() -> Message:
            return replay.pop(0) if replay else await receive()

        if key is not None:
            scope = self._as_key(scope, key)
        try:
            await self.app(scope, replaying_receive if scope["method"] in ("POST", "PUT", "PATCH") else receive, send)
        finally:
            if key is not None and self.limiter is not None:
                self.limiter.leave(key.name)  # a stream counts as open until its last byte is sent

    def _enter(self, name: str) -> None:
        assert self.limiter is not None
        try:
            self.limiter.enter(name)
        except APIError as e:
            if self.on_key_refused is not None:
                self.on_key_refused(name, e.status)
            raise

    def _as_key(self, scope: Scope, key: ApiKey) -> Scope:
        """The request as the app sees it: when keys pin tenants, X-Tenant is the key's name (a client's own
        X-Tenant dropped: one key cannot speak for another's tenant); the key's tokens/min handle."""
        scope = dict(scope)
        if self.keys is not None and self.keys.pins_tenant:
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != b"x-tenant"]
            scope["headers"].append((b"x-tenant", key.name.encode()))
        if self.limiter is not None and self.limiter.limits(key.name):
            scope[QUOTA_SCOPE_KEY] = TokenQuota(self.limiter, key.name)
        return scope

    def _check_key(self, authorization: str, x_api_key: str | None) -> ApiKey | None:
        """`Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's): the key, or None
        for the admin key (which may set X-Tenant)."""
        scheme, _, token = authorization.strip().partition(" ")
        if x_api_key is not None and not authorization:
            scheme, token = "bearer", x_api_key
        raw = token.strip().encode()
        found = self.keys.match(raw) if self.keys is not None else None
        admin = self.admin_api_key is not None and hmac.compare_digest(raw, self.admin_api_key)
        if scheme.lower() != "bearer" or not (found or admin):
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                           "authentication_error", code="invalid_api_key", kind="unauthorized")
        return None if admin else found

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

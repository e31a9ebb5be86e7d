"""API errors in OpenAI's body, {"error": {"message", "type", "param", "code"}}, and the exception handlers of the
server's and the router's apps. `code` is a string or null, never a number (as OpenAI's). On the Anthropic routes
(/v1/messages...) the same errors leave in Anthropic's body, {"type": "error", "error": {"type", "message"}}.

Each error also names a `kind`: the label it is counted under by the app's metrics (`ErrorCounter.error`).
A `RequestRejected` (pdserve/errors.py) raised anywhere below the routes leaves through the one handler here,
`from_rejected`: its ErrorCode picks the status, type and kind from ERROR_STATUS; nothing else converts it.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.errors import ErrorCode, RequestRejected

logger = logging.getLogger("pdserve.api")


class ErrorCounter(Protocol):
    """What the guards and handlers count refused requests on (the server's Metrics, the router's RouterMetrics)."""

    def error(self, kind: str) -> None: ...


class APIError(Exception):
    """An error answered to the client: HTTP status, OpenAI body fields, and the metrics kind."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, kind: str = "bad_request") -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type_
        self.param, self.code, self.kind = param, code, kind
        self.headers: dict[str, str] | None = None  # extra response headers (a 429's Retry-After)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.type, self.param, self.code)

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's error body: its error type follows the status (ANTHROPIC_ERROR_TYPES); it has no `param`,
        so the message names the field when it does not already."""
        kind = ANTHROPIC_ERROR_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        named = self.param is None or self.param in self.message
        return {"type": "error", "error": {"type": kind,
                                           "message": self.message if named else f"{self.param}: {self.message}"}}


# ErrorCode -> (HTTP status, OpenAI error type, metrics kind): every code has one answer
_BAD_REQUEST = (400, "invalid_request_error", "bad_request")
_ENGINE_FAILED = (500, "internal_error", "engine")
ERROR_STATUS: dict[ErrorCode, tuple[int, str, str]] = {
    ErrorCode.INVALID_PROMPT: _BAD_REQUEST,
    ErrorCode.INVALID_PARAMETER: _BAD_REQUEST,
    ErrorCode.UNSUPPORTED_PARAMETER: _BAD_REQUEST,
    ErrorCode.INVALID_STRUCTURED_OUTPUT: _BAD_REQUEST,
    ErrorCode.INVALID_TOOL: _BAD_REQUEST,
    ErrorCode.INVALID_TOOL_CHOICE: _BAD_REQUEST,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: (400, "invalid_request_error", "context_length"),
    ErrorCode.KV_TRANSFER_PARAMS_REJECTED: _BAD_REQUEST,  # the PD router retries without the params on this code
    ErrorCode.MODEL_STEP_FAILED: _ENGINE_FAILED,
    ErrorCode.SAMPLING_FAILED: _ENGINE_FAILED,
    ErrorCode.POSTPROCESS_FAILED: _ENGINE_FAILED,
    ErrorCode.KV_TRANSFER_FAILED: _ENGINE_FAILED,
}


def from_rejected(e: RequestRejected) -> APIError:
    """The one translation of a refused request into its API error: status, type and kind by its code."""
    status, type_, kind = ERROR_STATUS[e.code]
    return APIError(status, str(e), type_, param=e.param, code=e.code.value, kind=kind)


# the `code` of an error raised without one, by HTTP status (a string, as OpenAI's; other statuses: null)
STATUS_CODES: dict[int, str] = {401: "invalid_api_key", 403: "forbidden", 404: "not_found",
                                405: "method_not_allowed", 408: "request_timeout", 409: "conflict",
                                413: "payload_too_large", 429: "too_many_requests", 499: "client_disconnected",
                                500: "internal_error", 502: "upstream_error", 503: "service_unavailable"}
ANTHROPIC_ERROR_TYPES: dict[int, str] = {401: "authentication_error", 403: "permission_error",
                                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                                         503: "overloaded_error", 529: "overloaded_error"}
ANTHROPIC_PREFIX = "/v1/messages"  # routes whose errors leave in Anthropic's body


def error_body(status: int, message: str, type_: str, param: str | None = None, code: Any = None) -> dict:
    """OpenAI's error body; `code` is the error's own string code, else its status's (STATUS_CODES), else null.
    A code that is not a string (an older instance's number, relayed by the router) is replaced the same way."""
    code = code if isinstance(code, str) and code else STATUS_CODES.get(status)
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(e: APIError, path: str = "") -> JSONResponse:
    """The error as the route's API writes it: Anthropic's body under ANTHROPIC_PREFIX, else OpenAI's."""
    body = e.anthropic_body() if path.startswith(ANTHROPIC_PREFIX) else e.body()
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def validation_message(e: RequestValidationError) -> APIError:
    """The first few pydantic errors as one message; `param` names the first offending field."""
    errs = e.errors()
    first = errs[0] if errs else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ()) if x != 'body') or 'body'}: {er.get('msg')}"
                    for er in errs[:5])
    return APIError(400, msg or "invalid request", param=".".join(loc) or None)


def install_exception_handlers(app: FastAPI, metrics: ErrorCounter) -> None:
    """Every error leaves as an OpenAI error body and counts once in the error metrics."""

    @app.exception_handler(APIError)
    async def _api_error(raw: Request, e: APIError) -> JSONResponse:
        metrics.error(e.kind)
        return error_response(e, raw.url.path)

    @app.exception_handler(RequestRejected)
    async def _rejected(raw: Request, e: RequestRejected) -> JSONResponse:
        return await _api_error(raw, from_rejected(e))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(raw: Request, e: RequestValidationError) -> JSONResponse:
        metrics.error("bad_request")
        return error_response(validation_message(e), raw.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(raw: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if e.status_code == 404 else "bad_request"
        metrics.error(kind)
        return error_response(APIError(e.status_code, str(e.detail), kind=kind), raw.url.path)

    @app.exception_handler(Exception)
    async def _internal(raw: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        metrics.error("internal")
        return error_response(APIError(500, f"internal error: {e!r}", "internal_error", kind="internal"),
                              raw.url.path)

"""API errors in OpenAI's body, {"error": {"message", "type", "param", "code"}}, and the exception handlers of the
server's and the router's apps.

Each error also names a `kind`: the label it is counted under by the app's metrics (`ErrorCounter.error`).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.type, self.param, self.code)


def error_body(status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error body; `code` falls back to the HTTP status when the error has no code of its own."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code if code else status}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


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
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        metrics.error(e.kind)
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        metrics.error("bad_request")
        return error_response(validation_message(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if e.status_code == 404 else "bad_request"
        metrics.error(kind)
        return error_response(APIError(e.status_code, str(e.detail), kind=kind))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        metrics.error("internal")
        return error_response(APIError(500, f"internal error: {e!r}", "internal_error", kind="internal"))

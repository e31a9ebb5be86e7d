"""The admin API (only with `--admin-api-key`; `Authorization: Bearer KEY`, 401 otherwise): load, unload, sleep
and wake models, point aliases (switch, canary share, rollback), read the audit log. Handlers are thin: the
ModelRegistry does the work and writes the audit entries, keyed by the admin key's id (never the key)."""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from pdserve.api.errors import APIError
from pdserve.server.audit import key_id
from pdserve.server.model_registry import ModelRegistry
from pdserve.server.model_routes import model_entry
from pdserve.server.model_spec import ModelSpec


class LoadModelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    path: str | None = None
    version: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)


class Canary(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    share: float = Field(ge=0.0, le=1.0)


class AliasRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    canary: Canary | None = None


def admin_key(raw: Request) -> str:
    """The caller's admin key id (401 unless the Authorization header carries the admin key)."""
    expected: str = raw.app.state.admin_api_key
    scheme, _, token = raw.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise APIError(401, "admin API: missing or wrong admin key (Authorization: Bearer KEY)",
                       "authentication_error", code="invalid_api_key", kind="unauthorized")
    return key_id(expected) or ""


admin_router = APIRouter(prefix="/admin", dependencies=[Depends(admin_key)])


def _registry(raw: Request) -> ModelRegistry:
    return raw.app.state.registry  # type: ignore[no-any-return]


@admin_router.post("/models")
async def load_model(body: LoadModelRequest, raw: Request, wait: bool = False,
                     kid: str = Depends(admin_key)) -> JSONResponse:
    """Load in the background (202, progress in /v1/models); `?wait=true`: answer when loaded, or the failure."""
    registry = _registry(raw)
    try:
        spec = ModelSpec(body.name, body.path, body.version, body.options)
    except ValueError as e:
        raise APIError(400, str(e), param="options", code="invalid_model_spec") from e
    served, thread = registry.load_in_background(spec, kid)
    if not wait:
        return JSONResponse({"name": served.name, "state": "loading"}, status_code=202)
    await asyncio.to_thread(thread.join)
    if served.state == "failed":
        bad_input = served.error_is_input
        raise APIError(400 if bad_input else 500, f"model {served.name!r} failed to load: {served.error}",
                       "invalid_request_error" if bad_input else "internal_error", param="path",
                       code="model_load_failed", kind="bad_request" if bad_input else "internal")
    return JSONResponse({**model_entry(served, []), "load_s": served.load_s})


@admin_router.delete("/models/{name:path}")
async def unload_model(name: str, raw: Request, kid: str = Depends(admin_key)) -> dict[str, Any]:
    return await _registry(raw).unload(name, kid)


@admin_router.post("/models/{name:path}/sleep")
async def sleep_model(name: str, raw: Request, kid: str = Depends(admin_key)) -> dict[str, Any]:
    return await _registry(raw).sleep(name, kid)


@admin_router.post("/models/{name:path}/wake")
async def wake_model(name: str, raw: Request, kid: str = Depends(admin_key)) -> dict[str, Any]:
    return await _registry(raw).wake(name, kid)


@admin_router.put("/aliases/{alias}")
async def set_alias(alias: str, body: AliasRequest, raw: Request, kid: str = Depends(admin_key)) -> dict[str, Any]:
    canary = body.canary.model_dump() if body.canary is not None else None
    return _registry(raw).set_alias(alias, body.model, canary, kid)


@admin_router.post("/aliases/{alias}/rollback")
async def rollback_alias(alias: str, raw: Request, kid: str = Depends(admin_key)) -> dict[str, Any]:
    return _registry(raw).rollback(alias, kid)


@admin_router.get("/audit")
async def audit(raw: Request, limit: int = 100) -> dict[str, Any]:
    return {"entries": _registry(raw).audit.tail(min(max(limit, 0), 10000))}

"""The admin API (only with `--admin-api-key`; `Authorization: Bearer KEY`, 401 otherwise): load, unload, sleep
and wake models, point aliases (switch, canary share, rollback), read the audit log. Handlers are thin: the
ModelRegistry does the work and writes the audit entries, keyed by the admin key's id (never the key). Every
authenticated call that changes something, accepted or refused, is one audit line. The names it creates (a
loaded model's name and version, an alias) must fit model_spec's NAME_PATTERN (else 400 invalid_model_name);
names it looks up are only ever quoted (repr) in answers and logs."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from pdserve.api.errors import APIError, validation_message
from pdserve.server.audit import key_id
from pdserve.server.model_registry import ModelRegistry
from pdserve.server.model_routes import model_entry
from pdserve.server.model_spec import ModelSpec, name_error, version_error


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


def is_admin(raw: Request) -> bool:
    """The Authorization header carries the admin key (`--admin-api-key`; never when there is none)."""
    expected: str | None = raw.app.state.admin_api_key
    scheme, _, token = raw.headers.get("authorization", "").strip().partition(" ")
    return bool(expected) and scheme.lower() == "bearer" and \
        hmac.compare_digest(token.strip().encode(), str(expected).encode())


def admin_key(raw: Request) -> str:
    """The caller's admin key id (401 unless the Authorization header carries the admin key)."""
    if not is_admin(raw):
        raise APIError(401, "admin API: missing or wrong admin key (Authorization: Bearer KEY)",
                       "authentication_error", code="invalid_api_key", kind="unauthorized")
    return key_id(raw.app.state.admin_api_key) or ""


# the audit action of each changing route (by its handler's name)
_ACTIONS = {"load_model": "load", "unload_model": "unload", "sleep_model": "sleep", "wake_model": "wake",
            "set_alias": "switch", "rollback_alias": "rollback", "load_lora_adapter": "load_lora",
            "unload_lora_adapter": "unload_lora"}


class AuditedRoute(APIRoute):
    """An admin route whose body or query the schema refuses (400, before the handler runs) is still one audit
    line, like every other refused admin call (the admin key was checked first: its dependency runs before)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        action = _ACTIONS.get(self.name)

        async def audited(raw: Request) -> Response:
            try:
                return await handler(raw)
            except RequestValidationError as e:
                if action is not None and is_admin(raw):
                    target = str(raw.path_params.get("name") or raw.path_params.get("alias") or "")
                    _registry(raw).refused(action, target[:128], key_id(raw.app.state.admin_api_key),
                                           validation_message(e))
                raise

        return audited


admin_router = APIRouter(prefix="/admin", dependencies=[Depends(admin_key)], route_class=AuditedRoute)


def _registry(raw: Request) -> ModelRegistry:
    return raw.app.state.registry  # type: ignore[no-any-return]


def check_names(raw: Request, action: str, kid: str, target: str, **names: str | None) -> None:
    """400 invalid_model_name (audited under `target`, escaped by the JSON line) unless every name is valid."""
    for param, name in names.items():
        if name is None:
            continue
        error = version_error(name) if param == "version" else name_error(name, "alias" if param == "alias" else
                                                                          "model name")
        if error is not None:
            raise _registry(raw).refused(action, target[:128], kid, APIError(400, error, param=param,
                                                                       code="invalid_model_name"))


@admin_router.post("/models")
async def load_model(body: LoadModelRequest, raw: Request, wait: bool = False,
                     kid: str = Depends(admin_key)) -> JSONResponse:
    """Load in the background (202, progress in /v1/models); `?wait=true`: answer when loaded, or the failure."""
    registry = _registry(raw)
    check_names(raw, "load", kid, body.name, name=body.name, version=body.version)
    try:
        spec = ModelSpec(body.name, body.path, body.version, body.options)
    except ValueError as e:
        raise registry.refused("load", body.name, kid, APIError(400, str(e), param="options",
                                                                code="invalid_model_spec")) from e
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
    check_names(raw, "switch", kid, alias, alias=alias)
    canary = body.canary.model_dump() if body.canary is not None else None
    return _registry(raw).set_alias(alias, body.model, canary, kid)


@admin_router.post("/aliases/{alias}/rollback")
async def rollback_alias(alias: str, raw: Request, kid: str = Depends(admin_key)) -> dict[str, Any]:
    return _registry(raw).rollback(alias, kid)


@admin_router.get("/audit")
async def audit(raw: Request, limit: int = 100) -> dict[str, Any]:
    return {"entries": _registry(raw).audit.tail(min(max(limit, 0), 10000))}

"""Introspection routes: the profiler by phase (vLLM's /start_profile, /stop_profile) and per-request explanations
(GET /debug/requests/{id}). Thin: the logic is in EngineClient, PhaseProfiler and RequestExplainer. With several
models the profiler acts on one (the body's or query's `model`, default the default model) and a request id is
looked up in every loaded model's history."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field

from pdserve.api.errors import APIError
from pdserve.engine.client import EngineClient, ProfilerState
from pdserve.profiler.phase import MAX_PROFILE_STEPS
from pdserve.server.admin import is_admin
from pdserve.server.model_registry import ModelRegistry

debug_router = APIRouter()

MAX_WAIT_S = 600.0


ModelQuery = Query(None, description="the model (or alias) to profile; default: the default model")


class StartProfileRequest(BaseModel):
    model: str | None = Field(None, description="the model (or alias) to profile; default: the default model")
    num_steps: int | None = Field(None, ge=1, le=MAX_PROFILE_STEPS,
                                  description="profile this many engine steps (default: until /stop_profile)")


class StopProfileRequest(BaseModel):
    model: str | None = Field(None, description="the model (or alias) being profiled; default: the default model")
    wait_s: float = Field(0.0, ge=0.0, le=MAX_WAIT_S,
                          description="wait up to this long for num_steps steps before stopping")


def _conflict(e: ProfilerState) -> APIError:
    return APIError(409, str(e), code="profiler_state", kind="bad_request")


def _engine(raw: Request, model: str | None) -> EngineClient:
    """The loaded model's EngineClient (404 / 503 from the registry for an unknown or not loaded model)."""
    client = raw.app.state.registry.get(model).client
    assert client is not None  # get() returns loaded models only
    return client


@debug_router.post("/start_profile")
async def start_profile(raw: Request, body: StartProfileRequest | None = None,
                        model: str | None = ModelQuery) -> dict[str, Any]:
    body = body or StartProfileRequest(model=None, num_steps=None)
    client = _engine(raw, body.model or model)
    try:
        client.start_profile(body.num_steps)
    except ProfilerState as e:
        raise _conflict(e) from None
    return {"status": "started", "num_steps": body.num_steps}


@debug_router.post("/stop_profile")
async def stop_profile(raw: Request, body: StopProfileRequest | None = None,
                       model: str | None = ModelQuery) -> dict[str, Any]:
    """Stop (after waiting up to wait_s for the asked steps) and return the report, its table and trace path."""
    body = body or StopProfileRequest(model=None, wait_s=0.0)
    client = _engine(raw, body.model or model)
    try:
        result = await client.stop_profile(body.wait_s)
    except ProfilerState as e:
        raise _conflict(e) from None
    return result.as_dict()


@debug_router.get("/debug/requests/{request_id}")
async def debug_request(request_id: str, raw: Request) -> dict[str, Any]:
    """A recent finished request's timeline and stall causes; an API request id lists each of its sequences.
    A caller sees only its own tenant's requests (X-Tenant, as it sent them) and only by their full id; the
    admin key sees every tenant's, by any id prefix. Every loaded model's history is searched (a sleeping or
    unloaded model's history went with its engine)."""
    registry: ModelRegistry = raw.app.state.registry
    admin = is_admin(raw)
    tenant = raw.headers.get("x-tenant")
    found: list[dict[str, Any]] = []
    sizes = []
    for served in registry.loaded():
        if (client := served.client) is not None:
            found += client.explanations(request_id, tenant, any_tenant=admin, by_prefix=admin)
            sizes.append(client.explanation_history_size)
    if not found:
        raise APIError(404, f"no recent request {request_id!r} (only the last {max(sizes, default=0)} "
                       "finished requests per model are kept)", param="request_id", code="request_not_found",
                       kind="not_found")
    return {"object": "list", "data": found}

"""Introspection routes: the profiler by phase (vLLM's /start_profile, /stop_profile) and per-request explanations
(GET /debug/requests/{id}). Thin: the logic is in AsyncEngine, PhaseProfiler and RequestExplainer."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from pdserve.profiler.phase import MAX_PROFILE_STEPS
from pdserve.server.async_engine import AsyncEngine, ProfilerState
from pdserve.server.errors import APIError

debug_router = APIRouter()

MAX_WAIT_S = 600.0


class StartProfileRequest(BaseModel):
    num_steps: int | None = Field(None, ge=1, le=MAX_PROFILE_STEPS,
                                  description="profile this many engine steps (default: until /stop_profile)")


class StopProfileRequest(BaseModel):
    wait_s: float = Field(0.0, ge=0.0, le=MAX_WAIT_S,
                          description="wait up to this long for num_steps steps before stopping")


def _conflict(e: ProfilerState) -> APIError:
    return APIError(409, str(e), code="profiler_state", kind="bad_request")


@debug_router.post("/start_profile")
async def start_profile(raw: Request, body: StartProfileRequest | None = None) -> dict[str, Any]:
    aengine: AsyncEngine = raw.app.state.engine
    body = body or StartProfileRequest(num_steps=None)
    try:
        aengine.start_profile(body.num_steps)
    except ProfilerState as e:
        raise _conflict(e) from None
    return {"status": "started", "num_steps": body.num_steps}


@debug_router.post("/stop_profile")
async def stop_profile(raw: Request, body: StopProfileRequest | None = None) -> dict[str, Any]:
    """Stop (after waiting up to wait_s for the asked steps) and return the report, its table and trace path."""
    aengine: AsyncEngine = raw.app.state.engine
    try:
        result = await aengine.stop_profile((body or StopProfileRequest(wait_s=0.0)).wait_s)
    except ProfilerState as e:
        raise _conflict(e) from None
    return result.as_dict()


@debug_router.get("/debug/requests/{request_id}")
async def debug_request(request_id: str, raw: Request) -> dict[str, Any]:
    """A recent finished request's timeline and stall causes; an API request id lists each of its sequences."""
    aengine: AsyncEngine = raw.app.state.engine
    found = aengine.explanations.get(request_id)
    if not found:
        raise APIError(404, f"no recent request {request_id!r} (only the last {aengine.explanations.size} "
                       "finished requests are kept)", param="request_id", code="request_not_found",
                       kind="not_found")
    return {"object": "list", "data": found}

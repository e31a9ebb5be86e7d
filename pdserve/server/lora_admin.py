"""LoRA adapters at run time, with vLLM's routes: `POST /v1/load_lora_adapter {lora_name, lora_path}` and
`POST /v1/unload_lora_adapter {lora_name}` (pdserve's optional `model`: the base model; default: the default model).

Admin calls like those of admin.py: the admin key (401 otherwise; the routes exist only with `--admin-api-key`),
one audit line per call, accepted or refused (actions `load_lora`, `unload_lora`); the adapter's name must fit the
admin API's name rules (400 invalid_model_name) and be no model's, alias's or other adapter's (409 model_exists).
An adapter is served as a model name: a request's `model` picks it, `/v1/models` lists it with `parent` = its
base model. Unloading an adapter that unfinished requests run with is refused (409 lora_in_use; retry when they
end): in-flight requests always finish on the weights they started with.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from pdserve.api.errors import APIError
from pdserve.engine.client import LoRAAdapterError, LoRAExists, LoRAInUse, LoRANotLoaded
from pdserve.server.admin import AuditedRoute, admin_key, check_names
from pdserve.server.model_registry import ModelRegistry, ServedModel

lora_router = APIRouter(prefix="/v1", dependencies=[Depends(admin_key)], route_class=AuditedRoute)

# LoRAAdapterError.code -> HTTP status
_STATUS = {"lora_adapter_not_found": 404, "invalid_lora_adapter": 400, "lora_limit_reached": 409}


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    model: str | None = None  # the base model (pdserve); None: the default model


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's body may carry it; the name decides


def _base_model(registry: ModelRegistry, model: str | None) -> ServedModel:
    served = registry.get(model)  # 404 model_not_found / 503 while not loaded
    if served.client is None or not served.client.config.enable_lora:
        raise APIError(400, f"model {served.name!r} serves no LoRA adapters; start it with --enable-lora (or "
                       "serve --lora-modules)", param="model", code="lora_not_enabled")
    return served


async def load_adapter(registry: ModelRegistry, name: str, path: str, model: str | None,
                       key: str | None) -> dict[str, Any]:
    """Load an adapter onto `model` (its name checked by the caller); one audit line."""
    t0 = time.monotonic()
    with registry.auditing_refusals("load_lora", name, key):
        served = _base_model(registry, model)
        if registry.name_taken(name):
            raise APIError(409, f"{name!r} is already a model, alias or LoRA adapter name", param="lora_name",
                           code="model_exists")
        assert served.client is not None
        try:
            lr = await served.client.add_lora(name, path)
        except LoRAExists as e:
            raise APIError(409, str(e), param="lora_name", code="model_exists") from e
        except LoRAAdapterError as e:
            raise APIError(_STATUS[e.code], f"LoRA adapter {name!r}: {e}", param="lora_path", code=e.code,
                           kind="not_found" if e.code == "lora_adapter_not_found" else "bad_request") from e
    registry.record("load_lora", name, key, served, served, t0, detail={"model": served.name, "path": path,
                                                                          "lora_int_id": lr.lora_int_id})
    return {"lora_name": name, "model": served.name, "lora_int_id": lr.lora_int_id, "state": "loaded"}


def unload_adapter(registry: ModelRegistry, name: str, key: str | None) -> dict[str, Any]:
    t0 = time.monotonic()
    with registry.auditing_refusals("unload_lora", name, key):
        served = registry.lora_owner(name)
        if served is None or served.client is None:
            raise APIError(404, f"LoRA adapter {name!r} is not loaded", param="lora_name",
                           code="lora_adapter_not_found", kind="not_found")
        try:
            lr = served.client.remove_lora(name)
        except LoRANotLoaded as e:
            raise APIError(404, str(e.args[0]), param="lora_name", code="lora_adapter_not_found",
                           kind="not_found") from e
        except LoRAInUse as e:
            raise APIError(409, str(e), param="lora_name", code="lora_in_use") from e
    registry.record("unload_lora", name, key, served, served, t0, detail={"model": served.name,
                                                                            "lora_int_id": lr.lora_int_id})
    return {"lora_name": name, "model": served.name, "state": "unloaded"}


def _registry(raw: Request) -> ModelRegistry:
    return raw.app.state.registry  # type: ignore[no-any-return]


@lora_router.post("/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRARequest, raw: Request, kid: str = Depends(admin_key)) -> dict[str, Any]:
    check_names(raw, "load_lora", kid, body.lora_name, lora_name=body.lora_name)
    return await load_adapter(_registry(raw), body.lora_name, body.lora_path, body.model, kid)


@lora_router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRARequest, raw: Request,
                              kid: str = Depends(admin_key)) -> dict[str, Any]:
    return unload_adapter(_registry(raw), body.lora_name, kid)

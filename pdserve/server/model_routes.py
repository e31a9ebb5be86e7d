"""What a server serves and how it is configured: `GET /v1/models` (every model with its state, version, config
hash and aliases; every alias as its own entry), `GET /v1/config` (effective engine options per model and their
hash; `server`: server-wide options such as the per-model admission limit) and `GET /version` (pdserve, its git
commit when known, torch, Python, the kernels each model runs)."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch
from fastapi import APIRouter, Request

import pdserve
from pdserve.api.errors import APIError
from pdserve.server.model_registry import ModelRegistry, ServedModel

models_router = APIRouter()


def model_entry(m: ServedModel, aliases: list[str]) -> dict[str, Any]:
    entry: dict[str, Any] = {"id": m.name, "object": "model", "created": m.created, "owned_by": "pdserve",
                             "state": m.state, "version": m.version, "config_hash": m.config_hash,
                             "aliases": aliases, "max_model_len": m.max_model_len}
    if m.client is not None:  # loaded: how its weight matrices are stored, by type (GGUF names; float dtypes)
        info = m.client.model_info
        entry["quantization"] = info.weight_formats
        entry["kv_cache"] = {"dtype": info.kv_cache_dtype, "bytes_per_token": info.kv_bytes_per_token,
                             "role": info.kv_role}
    if m.state == "loading":
        entry["progress"] = round(m.progress, 3)
    if m.error is not None:
        entry["error"] = m.error
    return entry


def lora_entries(m: ServedModel) -> list[dict[str, Any]]:
    """The /v1/models entries of a loaded model's adapters (vLLM's: `root` the adapter's path, `parent` the base)."""
    if m.client is None:
        return []
    return [{"id": lr.lora_name, "object": "model", "created": m.created, "owned_by": "pdserve", "state": "loaded",
             "version": None, "config_hash": m.config_hash, "aliases": [], "max_model_len": m.max_model_len,
             "root": lr.lora_path, "parent": m.name} for lr in m.client.loras()]


def list_models(registry: ModelRegistry) -> dict[str, Any]:
    """OpenAI's model list, models in load order (each followed by its LoRA adapters, with `parent`), then aliases
    (with their target's state and version)."""
    aliases = registry.aliases()
    data = [e for m in registry.models() for e in (
        model_entry(m, sorted(a for a, al in aliases.items() if al.model == m.name)), *lora_entries(m))]
    by_name = {m["id"]: m for m in data}
    for alias, al in aliases.items():
        target = by_name.get(al.model, {"state": "unloaded", "version": None, "config_hash": None,
                                        "max_model_len": None, "created": 0})
        entry = {"id": alias, "object": "model", "created": target["created"], "owned_by": "pdserve",
                 "state": target["state"], "version": target["version"], "config_hash": target["config_hash"],
                 "aliases": [], "max_model_len": target["max_model_len"], "alias_of": al.model}
        if al.canary is not None:
            entry["canary"] = {"model": al.canary, "share": al.share}
        data.append(entry)
    return {"object": "list", "data": data}


@functools.cache
def git_commit() -> str | None:
    """The commit pdserve runs from, when it runs from a git checkout (None otherwise)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(pdserve.__file__).parent, capture_output=True,
                             text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


@models_router.get("/v1/models")
async def models(raw: Request) -> dict[str, Any]:
    return list_models(raw.app.state.registry)


@models_router.get("/v1/models/{model_id:path}")
async def model(model_id: str, raw: Request) -> dict[str, Any]:
    """One entry of the list (an alias is its own entry, with `alias_of`); 404 model_not_found."""
    found = [m for m in list_models(raw.app.state.registry)["data"] if m["id"] == model_id]
    if not found:
        raise APIError(404, f"model {model_id!r} does not exist", param="model", code="model_not_found",
                       kind="not_found")
    return found[0]


@models_router.get("/v1/config")
async def config(raw: Request) -> dict[str, Any]:
    registry: ModelRegistry = raw.app.state.registry
    # server-wide options that shape every model's behaviour (the admission limit applies to each model's queue)
    return {"server": {"max_waiting_requests": registry.max_waiting_requests},
            "models": {m.name: {"options": m.options, "config_hash": m.config_hash, "version": m.version,
                                "state": m.state} for m in registry.models()}}


@models_router.get("/version")
async def version(raw: Request) -> dict[str, Any]:
    registry: ModelRegistry = raw.app.state.registry
    return {"pdserve": pdserve.__version__, "commit": git_commit(), "torch": torch.__version__,
            "python": platform.python_version(),
            "kernels": {m.name: m.kernels for m in registry.models() if m.kernels is not None},
            # what `pdserve diagnose` weighs PD against colocated by: usable CPUs and the compute threads
            "machine": {"cpus": len(os.sched_getaffinity(0)), "threads": torch.get_num_threads()}}

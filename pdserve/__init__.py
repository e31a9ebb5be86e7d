"""pdserve: an LLM inference server that schedules, measures and deploys prefill and decode separately."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# pdserve never downloads from a model hub: models come from local files or installed packages. Without this,
# transformers retries network look-ups for a name it does not find locally before failing.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

if TYPE_CHECKING:
    from pdserve.config import EngineConfig
    from pdserve.llm import LLM
    from pdserve.outputs import CompletionOutput, RequestOutput
    from pdserve.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

# Lazy: importing pdserve (or any pdserve.x) loads nothing else, so that the router and the Ray ingress, which never
# run a model, start without torch; `from pdserve import LLM` loads the engine.
_EXPORTS = {"LLM": "pdserve.llm", "EngineConfig": "pdserve.config", "SamplingParams": "pdserve.sampling_params",
            "RequestOutput": "pdserve.outputs", "CompletionOutput": "pdserve.outputs"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])

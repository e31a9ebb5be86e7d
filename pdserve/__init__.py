"""pdserve: an LLM inference server that schedules, measures and deploys prefill and decode separately."""

import os

# pdserve never downloads from a model hub: models come from local files or installed packages. Without this,
# transformers retries network look-ups for a name it does not find locally before failing.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pdserve.config import EngineConfig  # noqa: E402
from pdserve.outputs import CompletionOutput, RequestOutput  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: importing pdserve must not load torch models or transformers
    if name == "LLM":
        from pdserve.llm import LLM

        return LLM
    raise AttributeError(name)

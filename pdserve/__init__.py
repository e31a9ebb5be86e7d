"""pdserve: an LLM inference server that schedules, measures and deploys prefill and decode separately."""

from pdserve.config import EngineConfig
from pdserve.outputs import CompletionOutput, RequestOutput
from pdserve.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: importing pdserve must not load torch models or transformers
    if name == "LLM":
        from pdserve.llm import LLM

        return LLM
    raise AttributeError(name)

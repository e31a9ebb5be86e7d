"""A LoRA adapter as every layer names it (vLLM's LoRARequest): plain data, no weights.

`lora_int_id` is unique per load and never reused in a server's life: the engine keys the adapter's weights and its
prefix-cache blocks by it, so an adapter unloaded and loaded again (perhaps from other files) never meets blocks
computed with its old weights. 0 is the base model.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

_ids = itertools.count(1)


def next_lora_id() -> int:
    """A fresh adapter id (process-wide, so that ids never repeat across reloads)."""
    return next(_ids)


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str  # the model name clients send in `model`
    lora_int_id: int  # >= 1
    lora_path: str  # the PEFT directory: adapter_config.json + adapter_model.safetensors

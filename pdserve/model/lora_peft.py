"""Reading a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) into plain tensors.

What is read: per decoder layer and PEFT target module name (`q_proj`, ...), lora_A [r, in] and lora_B [out, r],
and the PEFT scaling: lora_alpha / r, or lora_alpha / sqrt(r) with `use_rslora`. What PEFT can express but pdserve
does not serve is refused here with a coded LoRAAdapterError (DoRA, trained biases, modules_to_save, per-module
rank or alpha patterns, embedding or lm_head adapters); shapes are checked against the model by model/lora.py.
Nothing here touches the engine: a server worker thread reads while the engine steps.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT strips the adapter name when saving)
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
MAX_ADAPTER_BYTES = 4 * 2**30  # a file larger than this is not an adapter of a model pdserve serves


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served: `code` is "lora_adapter_not_found" (no such directory or file) or
    "invalid_lora_adapter" (what it holds does not fit); the message says what and where."""

    def __init__(self, message: str, code: str = "invalid_lora_adapter") -> None:
        super().__init__(message)
        self.code = code


@dataclass
class PEFTAdapter:
    """An adapter's weights as stored: (layer, PEFT module name) -> (A [r, in], B [out, r]), and its scaling."""

    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ab in self.weights.values() for t in ab)


def _config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise LoRAAdapterError(f"LoRA adapter directory {str(path)!r} does not exist", "lora_adapter_not_found")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            hint = " (only safetensors adapters are read; save with safe_serialization=True)" \
                if name == WEIGHTS_FILE and (path / "adapter_model.bin").exists() else ""
            raise LoRAAdapterError(f"LoRA adapter {str(path)!r} has no {name}{hint}", "lora_adapter_not_found")
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"{CONFIG_FILE} of {str(path)!r} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"{CONFIG_FILE} of {str(path)!r} is not a JSON object")
    return cfg


def _check_config(cfg: dict[str, Any], max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a PEFT LoRA config; LoRAAdapterError for what pdserve does not serve."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"peft_type is {cfg.get('peft_type')!r}; only LORA adapters are served")
    refused = [k for k in ("use_dora", "fan_in_fan_out") if cfg.get(k)] + \
        [k for k in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform") if cfg.get(k)]
    if cfg.get("bias", "none") != "none":
        refused.append("bias")
    if refused:
        raise LoRAAdapterError(f"adapter_config.json sets {', '.join(refused)}: not supported (plain LoRA on "
                               "linear layers only)")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAAdapterError(f"adapter_config.json: r must be an integer >= 1, got {r!r}")
    if r > max_rank:
        raise LoRAAdapterError(f"adapter rank r={r} is above --max-lora-rank {max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LoRAAdapterError(f"adapter_config.json: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scaling)


def read_peft_adapter(path: str, max_rank: int) -> PEFTAdapter:
    """The adapter at `path` (LoRAAdapterError: missing files, refused options, rank above `max_rank`, tensors that
    are not pairs of LoRA matrices of rank r)."""
    root = Path(path)
    rank, scaling = _check_config(_config(root), max_rank)
    file = root / WEIGHTS_FILE
    if file.stat().st_size > MAX_ADAPTER_BYTES:
        raise LoRAAdapterError(f"{WEIGHTS_FILE} of {path!r} is over {MAX_ADAPTER_BYTES} bytes")
    try:
        tensors = load_file(str(file))
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a corrupt file
        raise LoRAAdapterError(f"cannot read {WEIGHTS_FILE} of {path!r}: {e}") from e
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAAdapterError(f"adapter weight {key!r} is not a LoRA matrix of a decoder layer's linear module "
                                   "(embedding, lm_head and other targets are not supported)")
        parts.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
    adapter = PEFTAdapter(path, rank, scaling)
    for (layer, module), ab in sorted(parts.items()):
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None:
            raise LoRAAdapterError(f"layer {layer} {module}: lora_A and lora_B must both be present")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAAdapterError(f"layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                                   f"are not [r, in] and [out, r] with r={rank}")
        adapter.weights[layer, module] = (a, b)
    if not adapter.weights:
        raise LoRAAdapterError(f"{WEIGHTS_FILE} of {path!r} holds no LoRA weights")
    return adapter

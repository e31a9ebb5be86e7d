"""LoRA adapters in the model layer: several adapters, and the base model, in one step (vLLM's punica idea).

A step's rows belong to requests, each with an adapter id (0: the base model). The runner sets the step's
LoRAMapping from plain ints before the forward: for each adapter present, the flat rows it owns (None: every row).
Each target Linear (the fused qkv_proj and gate_up_proj, o_proj, down_proj of every decoder layer) holds a
LoRALinear that adds, after the base product y = base(x), for each adapter i of the step and its rows:

    y[rows, cols of module m] += (x[rows] @ A_i,m^T) @ (scaling_i * B_i,m)^T

(grouped by adapter: one gather, two small GEMMs, one scatter-add; vLLM's bgmv/sgmv in PyTorch). A fused module's
slices (q, k, v; gate, up) stack their A matrices and put their B matrices block-diagonally into one
[sum r, out] matrix, so an adapter costs two GEMMs per module whatever the slices it targets.
A step without adapter rows costs one attribute test per target Linear; without `--enable-lora` nothing is attached
at all. Steps with adapter rows run the per-layer path (the native whole-stack program has no LoRA op).

Adapters are registered and removed on the engine thread between steps (LoRAManager.add / remove); reading and
checking one (`LoRAManager.prepare`, from a PEFT directory) touches no live state, so a server worker thread does
it while the engine steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pdserve.model.layers.linear import Linear
from pdserve.model.lora_peft import LoRAAdapterError, PEFTAdapter, read_peft_adapter

# PEFT module name -> (the pdserve Linear under a decoder layer, which output slice of it; None: all of it)
TARGETS: dict[str, tuple[str, int | None]] = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
    "qkv_proj": ("self_attn.qkv_proj", None), "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "gate_up_proj": ("mlp.gate_up_proj", None), "down_proj": ("mlp.down_proj", None)}


@dataclass
class LoRAMapping:
    """The current step's adapters: (adapter id, its flat rows as int64 indices, or None for all rows). Empty: a
    base-only step. Set by the runner before each forward (set_rows), cleared after."""

    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)

    def set_rows(self, per_request: list[tuple[int, int]], device: torch.device) -> None:
        """`per_request`: (adapter id, rows) of each scheduled request in flat-row order."""
        rows: dict[int, list[int]] = {}
        start = 0
        for lora_id, n in per_request:
            if lora_id:
                rows.setdefault(lora_id, []).extend(range(start, start + n))
            start += n
        self.groups = [(i, None if len(r) == start else torch.tensor(r, dtype=torch.long, device=device))
                       for i, r in rows.items()]

    def clear(self) -> None:
        self.groups = []


@dataclass
class ModuleLoRA:
    """One adapter on one target Linear: A of its slices stacked and transposed [in, sum r], and scaling * B^T of
    its slices block-diagonally [sum r, out] (zero in the columns of slices it does not target)."""

    a_t: torch.Tensor
    b_t: torch.Tensor


class LoRALinear:
    """What a target Linear runs with LoRA on: its base product, plus the step's adapters' deltas."""

    def __init__(self, mapping: LoRAMapping, in_features: int, widths: list[int]) -> None:
        self.mapping = mapping
        self.in_features = in_features
        self.widths = widths  # output slices (q, k, v / gate, up / one)
        self.out_features = sum(widths)
        self.adapters: dict[int, ModuleLoRA] = {}

    def __call__(self, base: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        y = base(x)
        if self.mapping.groups:
            self.add_deltas(y, x)
        return y

    def add_deltas(self, y: torch.Tensor, x: torch.Tensor) -> None:
        for lora_id, rows in self.mapping.groups:
            w = self.adapters.get(lora_id)
            if w is None:  # the adapter does not target this module
                continue
            delta = ((x if rows is None else x.index_select(0, rows)).to(w.a_t.dtype) @ w.a_t) @ w.b_t
            if rows is None:
                y.add_(delta.to(y.dtype))
            else:
                y.index_add_(0, rows, delta.to(y.dtype))


@dataclass
class PreparedAdapter:
    """An adapter checked against the model and laid out for LoRALinear: (layer, module path) -> ModuleLoRA."""

    lora_id: int
    modules: dict[tuple[int, str], ModuleLoRA]
    nbytes: int


class LoRAManager:
    """The model's LoRA state: the step mapping, the LoRALinear of every target, the registered adapters."""

    def __init__(self, layers: nn.ModuleList, max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        """Attach a LoRALinear to every target Linear of the decoder `layers`."""
        self.mapping = LoRAMapping()
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.dtype, self.device = dtype, device
        self.targets: dict[tuple[int, str], LoRALinear] = {}
        self.active: dict[int, PreparedAdapter] = {}
        for i, layer in enumerate(layers):
            for path in {p for p, _ in TARGETS.values()}:
                linear = _submodule(layer, path)
                if linear is None:  # a sparse MoE layer's MLP: its experts take no adapters
                    continue
                self.targets[i, path] = lora = LoRALinear(self.mapping, linear.in_features, _widths(layer, path))
                linear.set_lora(lora)
        self.num_layers = len(layers)

    def prepare(self, lora_id: int, path: str) -> PreparedAdapter:
        """Read and check the PEFT adapter at `path` (LoRAAdapterError), laid out in the model's dtype. Reads no
        live state: any thread."""
        return self.layout(lora_id, read_peft_adapter(path, self.max_lora_rank))

    def layout(self, lora_id: int, adapter: PEFTAdapter) -> PreparedAdapter:
        by_module: dict[tuple[int, str], dict[int | None, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, name), (a, b) in adapter.weights.items():
            if name not in TARGETS:
                raise LoRAAdapterError(f"layer {layer}: target module {name!r} is not supported; supported: "
                                       f"{', '.join(TARGETS)}")
            if layer >= self.num_layers:
                raise LoRAAdapterError(f"adapter has weights for layer {layer}; the model has {self.num_layers}")
            path, part = TARGETS[name]
            if (layer, path) not in self.targets:
                raise LoRAAdapterError(f"layer {layer}: {name!r} targets a sparse MoE layer's MLP; adapters on "
                                       "experts are not supported (attention modules are)")
            slot = by_module.setdefault((layer, path), {})
            if part in slot or (part is None and slot) or (part is not None and None in slot):
                raise LoRAAdapterError(f"layer {layer} {path}: fused and unfused targets overlap")
            slot[part] = (a, b)
        modules = {key: self._module(key, parts, adapter.scaling) for key, parts in by_module.items()}
        return PreparedAdapter(lora_id, modules, adapter.nbytes)

    def _module(self, key: tuple[int, str], parts: dict[int | None, tuple[torch.Tensor, torch.Tensor]],
                scaling: float) -> ModuleLoRA:
        target = self.targets[key]
        starts = [sum(target.widths[:j]) for j in range(len(target.widths))]
        ordered = sorted(parts.items(), key=lambda kv: -1 if kv[0] is None else kv[0])
        b_t = torch.zeros(sum(a.shape[0] for _, (a, _) in ordered), target.out_features)
        a_parts, rank_row = [], 0
        for part, (a, b) in ordered:
            c0, width = (0, target.out_features) if part is None else (starts[part], target.widths[part])
            if a.shape[1] != target.in_features or b.shape[0] != width:
                raise LoRAAdapterError(
                    f"layer {key[0]} {key[1]}{'' if part is None else f' slice {part}'}: lora_A {tuple(a.shape)} "
                    f"and lora_B {tuple(b.shape)} do not fit the base weight ({width} x {target.in_features})")
            r = a.shape[0]
            a_parts.append(a.to(torch.float32))
            b_t[rank_row:rank_row + r, c0:c0 + width] = b.to(torch.float32).t() * scaling
            rank_row += r
        a_t = torch.cat(a_parts).t().contiguous()
        return ModuleLoRA(a_t.to(self.dtype).to(self.device), b_t.to(self.dtype).to(self.device))

    # ---- engine thread, between steps ---------------------------------------------------------------------------
    def add(self, adapter: PreparedAdapter) -> None:
        if adapter.lora_id in self.active:
            raise ValueError(f"LoRA id {adapter.lora_id} is already registered")
        if len(self.active) >= self.max_loras:
            raise LoRAAdapterError(f"{len(self.active)} LoRA adapters are loaded, --max-loras {self.max_loras}; "
                                   "unload one first", "lora_limit_reached")
        for key, module in adapter.modules.items():
            self.targets[key].adapters[adapter.lora_id] = module
        self.active[adapter.lora_id] = adapter

    def remove(self, lora_id: int) -> bool:
        if self.active.pop(lora_id, None) is None:
            return False
        for target in self.targets.values():
            target.adapters.pop(lora_id, None)
        return True


def _submodule(layer: nn.Module, path: str) -> Linear | None:
    """The Linear at `path` under a decoder layer; None where the layer has none (a sparse MoE layer's MLP)."""
    try:
        linear = layer.get_submodule(path)
    except AttributeError:
        return None
    return linear if isinstance(linear, Linear) else None


def _widths(layer: nn.Module, path: str) -> list[int]:
    """The output slices of a target (q, k, v of qkv_proj; gate, up of gate_up_proj; else the whole output)."""
    linear = layer.get_submodule(path)
    assert isinstance(linear, Linear)
    if path == "self_attn.qkv_proj":
        att: Any = layer.get_submodule("self_attn")
        return [int(att.q_size), int(att.kv_size), int(att.kv_size)]
    if path == "mlp.gate_up_proj":
        return [linear.out_features // 2] * 2
    return [linear.out_features]

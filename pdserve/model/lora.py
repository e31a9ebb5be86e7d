"""LoRA adapters in the model layer: several adapters, and the base model, in one step (vLLM's punica idea).

A step's rows belong to requests, each with an adapter id (0: the base model). The runner hands the manager the
step's (adapter id, rows) per request as plain ints (LoRAManager.set_step), which become the LoRAMapping: each flat
row's resident slot. Each target Linear (the fused qkv_proj and gate_up_proj, o_proj, down_proj of every decoder
layer) holds a LoRALinear that adds, after the base product y = base(x), for the adapter i of each row r:

    y[r, cols of module m] += (x[r] @ A_i,m^T) @ (scaling_i * B_i,m)^T

computed for all rows and adapters at once on the adapters' stacked weights (one slot per resident adapter, zero
where it has none): y += ((x @ A_all) * mask) @ B_all, the mask keeping each row's own slot (vLLM's bgmv on stacked
LoRA weights, in PyTorch). A fused module's slices (q, k, v; gate, up) stack their A matrices and put their B
matrices block-diagonally. Two GEMMs and a mask per target whatever the mix of adapters; the stacked weights cost
max_loras x max_lora_rank x (in + out) per target, allocated with `--enable-lora`.
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
    """The current step's rows by adapter slot: `row_slot` [T] int64, the resident slot of each flat row's adapter
    (-1: the base model); None: a base-only step. Set by the runner before each forward, cleared after. The masks
    (row r, column c: 1 where c's slot is row r's) are made once per step and slot width, shared by the layers."""

    row_slot: torch.Tensor | None = None
    masks: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def mask(self, slots: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        assert self.row_slot is not None
        key = (width, dtype)
        if key not in self.masks:
            cols = torch.arange(slots * width, device=self.row_slot.device) // width
            self.masks[key] = (cols.unsqueeze(0) == self.row_slot.unsqueeze(1)).to(dtype)
        return self.masks[key]

    def clear(self) -> None:
        self.row_slot = None
        self.masks = {}


@dataclass
class ModuleLoRA:
    """One adapter on one target Linear: A of its slices stacked and transposed [in, sum r], and scaling * B^T of
    its slices block-diagonally [sum r, out] (zero in the columns of slices it does not target)."""

    a_t: torch.Tensor
    b_t: torch.Tensor


class LoRALinear:
    """What a target Linear runs with LoRA on: its base product, plus the step's adapters' deltas. Every resident
    adapter has a slot of `width` = slices x max rank columns in `a_all` [in, slots x width] and rows in `b_all`
    [slots x width, out] (zero where it has no weights), so a step with any mix of adapters costs
    y += ((x @ a_all) * mask) @ b_all: two GEMMs and a mask, whatever the adapters (vLLM's bgmv on stacked
    weights)."""

    def __init__(self, mapping: LoRAMapping, in_features: int, widths: list[int], slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.mapping = mapping
        self.in_features = in_features
        self.widths = widths  # output slices (q, k, v / gate, up / one)
        self.out_features = sum(widths)
        self.slots, self.width = slots, len(widths) * max_rank
        self.a_all = torch.zeros(in_features, slots * self.width, dtype=dtype, device=device)
        self.b_all = torch.zeros(slots * self.width, self.out_features, dtype=dtype, device=device)

    def __call__(self, base: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        y = base(x)
        if self.mapping.row_slot is not None:
            xa = x.to(self.a_all.dtype) @ self.a_all
            xa.mul_(self.mapping.mask(self.slots, self.width, xa.dtype))
            y.add_((xa @ self.b_all).to(y.dtype))
        return y

    def set_slot(self, slot: int, w: ModuleLoRA | None) -> None:
        """Put an adapter's matrices into `slot` (None: zero it)."""
        cols = slice(slot * self.width, (slot + 1) * self.width)
        self.a_all[:, cols] = 0
        self.b_all[cols] = 0
        if w is not None:
            r = w.a_t.shape[1]
            self.a_all[:, cols.start:cols.start + r] = w.a_t
            self.b_all[cols.start:cols.start + r] = w.b_t


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
        self.slot_of: dict[int, int] = {}  # adapter id -> its resident slot
        self._free = list(range(max_loras - 1, -1, -1))
        for i, layer in enumerate(layers):
            for path in {p for p, _ in TARGETS.values()}:
                linear = layer.get_submodule(path)
                assert isinstance(linear, Linear)
                self.targets[i, path] = lora = LoRALinear(self.mapping, linear.in_features, _widths(layer, path),
                                                          max_loras, max_lora_rank, dtype, device)
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
        slot = self._free.pop()
        for key, target in self.targets.items():  # every target: a module it does not adapt stays zero
            target.set_slot(slot, adapter.modules.get(key))
        self.active[adapter.lora_id], self.slot_of[adapter.lora_id] = adapter, slot

    def remove(self, lora_id: int) -> bool:
        if self.active.pop(lora_id, None) is None:
            return False
        slot = self.slot_of.pop(lora_id)
        for target in self.targets.values():
            target.set_slot(slot, None)
        self._free.append(slot)
        return True

    # ---- each step with adapter rows (the runner) ----------------------------------------------------------------
    def set_step(self, per_request: list[tuple[int, int]]) -> None:
        """`per_request`: (adapter id, rows) of each scheduled request in flat-row order (id 0: the base model)."""
        slots = [self.slot_of[i] if i else -1 for i, _ in per_request]
        counts = torch.tensor([n for _, n in per_request])
        self.mapping.row_slot = torch.repeat_interleave(torch.tensor(slots), counts).to(self.device)

    def clear_step(self) -> None:
        self.mapping.clear()


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

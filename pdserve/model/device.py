"""The device the model runs on (`--device cpu|cuda`) and the CUDA memory plan.

On cuda the KV cache is sized as vLLM sizes it: the engine may use `gpu_memory_utilization` x the device's total
memory; the weights and the peak activation memory of a profiled forward pass of the largest step come out of that
budget, and the KV cache gets the rest. The arithmetic is a pure function (`kv_cache_budget`) so it is tested with
injected numbers on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.config import DEVICES


def resolve_device(name: str) -> torch.device:
    """torch.device for `--device`; cuda fails here, at start-up, when this machine has no usable CUDA device."""
    if name not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch.cuda.is_available() is false here (no CUDA device, no driver, or "
                           f"a CPU-only PyTorch build: torch {torch.__version__}); use --device cpu")
    return torch.device(name)


@dataclass(frozen=True)
class MemoryPlan:
    """Where the engine's share of device memory goes, in bytes."""

    total: int  # the device's memory
    budget: int  # gpu_memory_utilization x total
    weights: int
    activations: int  # profiled peak of a forward pass of the largest step, above the weights
    kv_cache: int  # what is left for the KV cache

    def num_blocks(self, bytes_per_block: int) -> int:
        return self.kv_cache // bytes_per_block


def kv_cache_budget(total: int, free: int, weights: int, activations: int, utilization: float,
                    used_before_load: int = 0) -> MemoryPlan:
    """The KV cache's bytes under vLLM's `gpu_memory_utilization` (the fraction of the device's *total* memory this
    engine may use). `free`: free device memory before the engine allocated anything; `used_before_load`: what this
    process held then (CUDA context, other tensors), counted against the budget too. Raises when other processes
    hold so much memory that the budget cannot be had, or when nothing is left for the KV cache."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(total * utilization)
    if budget > free + used_before_load:
        raise ValueError(f"gpu_memory_utilization={utilization} asks for {budget / 2**30:.2f} GiB of the device's "
                         f"{total / 2**30:.2f} GiB but only {(free + used_before_load) / 2**30:.2f} GiB are free "
                         "(other processes hold the rest); lower --gpu-memory-utilization")
    kv = budget - used_before_load - weights - activations
    if kv <= 0:
        raise ValueError(f"no memory left for the KV cache: budget {budget / 2**30:.2f} GiB, weights "
                         f"{weights / 2**30:.2f} GiB, activations {activations / 2**30:.2f} GiB; raise "
                         "--gpu-memory-utilization or lower --max-num-batched-tokens")
    return MemoryPlan(total, budget, weights, activations, kv)


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device."""
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)

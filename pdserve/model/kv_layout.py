"""How the paged KV cache is laid out over a model's layers: KV cache groups, for models whose layers attend over
different spans (sliding-window local layers beside full-attention global ones: Gemma 2/3; one window on every layer:
Mistral 7B v0.1, Phi-3 with a window).

A group is a set of layers with one attention span and one block table per request. Every group has the same number
of layers, `layers_per_block` (vLLM's hybrid KV cache: one page size), so a block of the pool holds the K/V of
`layers_per_block` layers of whichever group holds it, and every group draws on the same pool:

    kv_cache[index, 0 = K | 1 = V, block_id, slot_in_block, kv_head, head_dim]

Layer `layers[j]` of a group uses `kv_cache[j]` with that group's block table. A sliding group's table holds the
null block in place of the blocks that fell out of the window of every query still to come: those are freed, so a
long conversation holds only a window of K/V for its local layers. With one full-attention group (every dense model,
and hybrid ones when the hybrid layout is off) the layout is the plain one: index = layer, one table.

Plain data: the model runner shapes the cache and points each attention layer at (group, index); the block manager
keeps one table per group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    sliding_window: int  # keys a query sees, its own included (0: full attention; its blocks are never freed early)
    layers: tuple[int, ...]  # model layers; layers[j] uses cache index j (fewer than layers_per_block: padding)


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    layers_per_block: int  # cache indices: a block holds this many layers' K/V

    @classmethod
    def plain(cls, num_layers: int) -> KVCacheLayout:
        """One full-attention group of every layer: a block holds every layer's K/V (no block is freed early)."""
        return cls((KVCacheGroup(0, tuple(range(num_layers))),), num_layers)

    @classmethod
    def plan(cls, layer_windows: Sequence[int]) -> KVCacheLayout:
        """Groups for layers with these windows (0: full attention), vLLM's way: the smallest set of layers sharing
        one window sets the group size; each window's layers are cut into groups of that size (the last one padded
        when it does not divide). Full-attention groups come first."""
        by_window: dict[int, list[int]] = {}
        for layer, w in enumerate(layer_windows):
            by_window.setdefault(int(w), []).append(layer)
        size = min(len(v) for v in by_window.values())
        groups = [KVCacheGroup(w, tuple(layers[i:i + size]))
                  for w, layers in sorted(by_window.items()) for i in range(0, len(layers), size)]
        return cls(tuple(groups), size)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def windows(self) -> tuple[int, ...]:
        return tuple(g.sliding_window for g in self.groups)

    @property
    def frees_blocks(self) -> bool:
        """Some group frees the blocks that fell out of its window."""
        return any(self.windows)

    def describe(self) -> str:
        """For the start-up log, e.g. '6 groups of 3 layers a block: 1 full attention, 5 with sliding window 512
        (their blocks out of the window are freed)'."""
        full = sum(1 for w in self.windows if not w)
        windows = sorted({w for w in self.windows if w})
        sliding = ", ".join(f"{sum(1 for x in self.windows if x == w)} with sliding window {w}" for w in windows)
        parts = ([f"{full} full attention"] if full else []) + ([sliding] if sliding else [])
        return (f"{self.num_groups} group{'s' if self.num_groups > 1 else ''} of {self.layers_per_block} layers a "
                f"block: {', '.join(parts)} (their blocks out of the window are freed)")

    def placement(self, layer: int) -> tuple[int, int]:
        """(group, cache index) of a model layer."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise ValueError(f"layer {layer} is in no KV cache group")

    def blocks_needed(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """Blocks one request of num_tokens tokens holds at most: every block in full-attention groups; in a sliding
        group, its window plus the largest chunk computed in one step (a chunk's K/V are all written before its
        queries read the last window)."""
        n = -(-num_tokens // block_size)
        return sum(n if not g.sliding_window else min(n, -(-(g.sliding_window + max_chunk) // block_size) + 1)
                   for g in self.groups)

"""Decode steps at padded batch sizes from static buffers: CUDA graphs on cuda, the same logic eagerly on cpu.

A pure-decode step (one new token per sequence, no drafts, no prompt logprobs, no pooling) of n sequences runs at
the smallest captured size b >= n (1, 2, 4, 8, ... up to max_num_seqs). Its inputs are copied into static buffers
(token ids, positions, slots, block tables of a fixed width, sequence lengths); the b - n padding rows decode token
0 at position 0 into the cache's scratch block (never handed out by the block manager) and see only that slot, so
they neither touch a real block nor produce NaN. On cuda the forward pass up to the logits is captured once per
size as a CUDA graph and replayed (one launch instead of one per kernel); on cpu the same function runs on the same
buffers each step (the eager twin the tests compare with the plain path). The logits stay on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pdserve.model.attention import AttentionBackend, AttentionMetadata
from pdserve.model.inputs import SchedulerOutput


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, ... and max_batch itself as the last size."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return [*sizes, max_batch]


@dataclass
class _Graph:
    logits: torch.Tensor  # [b, vocab] float32: the output buffer the graph writes
    graph: Any = None  # torch.cuda.CUDAGraph; None on cpu (eager twin)


class DecodeGraphRunner:
    def __init__(self, model: nn.Module, kv_cache: torch.Tensor, backend: AttentionBackend, block_size: int,
                 max_blocks_per_seq: int, max_batch: int, scratch_block: int, capture: bool | None = None) -> None:
        """`kv_cache` has scratch_block + 1 blocks at least; `capture`: record CUDA graphs (default: on cuda)."""
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.block_size, self.width, self.scratch = block_size, max_blocks_per_seq, scratch_block
        self.device = kv_cache.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.sizes = capture_sizes(max_batch)
        b, dev = self.sizes[-1], self.device
        self.input_ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.long, device=dev)
        self.slots = torch.full((b,), scratch_block * block_size, dtype=torch.long, device=dev)
        self.tables = torch.zeros(b, max_blocks_per_seq, dtype=torch.long, device=dev)
        self.tables[:, 0] = scratch_block
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.keys = torch.arange(max_blocks_per_seq * block_size, device=dev)
        self._graphs: dict[int, _Graph] = {}
        self._pool: Any = None
        self.replays = 0  # steps served (tests and logs)

    def padded_size(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def can_run(self, sched: SchedulerOutput) -> bool:
        reqs = sched.scheduled_reqs
        return (0 < len(reqs) == sched.num_decodes <= self.sizes[-1] and sched.num_spec_decodes == 0
                and all(r.prompt_logprobs is None and r.pool_offset is None and len(r.block_ids) <= self.width
                        for r in reqs))

    def run(self, sched: SchedulerOutput) -> torch.Tensor:
        """float32 logits [n, vocab] of the step's n decodes (a view of the size's output buffer: use it before
        the next step)."""
        reqs = sched.scheduled_reqs
        n, bs = len(reqs), self.block_size
        b = self.padded_size(n)
        tables = torch.zeros(b, self.width, dtype=torch.long)
        tables[n:, 0] = self.scratch
        pos = [r.num_computed_tokens for r in reqs]
        for i, r in enumerate(reqs):
            tables[i, :len(r.block_ids)] = torch.tensor(r.block_ids, dtype=torch.long)
        slots = [r.block_ids[p // bs] * bs + p % bs for r, p in zip(reqs, pos)] + [self.scratch * bs] * (b - n)
        self.input_ids[:b].copy_(torch.tensor([r.token_ids[0] for r in reqs] + [0] * (b - n)), non_blocking=True)
        self.positions[:b].copy_(torch.tensor(pos + [0] * (b - n)), non_blocking=True)
        self.slots[:b].copy_(torch.tensor(slots), non_blocking=True)
        self.seq_lens[:b].copy_(torch.tensor([p + 1 for p in pos] + [1] * (b - n), dtype=torch.int32),
                                non_blocking=True)
        self.tables[:b].copy_(tables, non_blocking=True)
        g = self._graphs.get(b)
        if g is None:
            g = self._graphs[b] = self._record(b)
        elif g.graph is not None:
            g.graph.replay()
        else:
            g.logits = self._forward(b)
        self.replays += 1
        return g.logits[:n]

    def _forward(self, b: int) -> torch.Tensor:
        """The captured function: the decode forward of the first b static rows, up to the logits."""
        seq_lens = self.seq_lens[:b]
        tables = self.tables[:b]
        meta = AttentionMetadata(
            slot_mapping=self.slots[:b], num_decodes=b, decode_block_tables=tables,
            decode_mask=(self.keys.unsqueeze(0) < seq_lens.unsqueeze(1))[:, None, None, :], prefills=[],
            block_table=tables.to(torch.int32), query_start_loc=self.query_start_loc[:b + 1], seq_lens=seq_lens)
        positions = self.positions[:b]
        self.backend.prepare(meta, positions, self.kv_cache.shape[2], self.block_size)
        hidden = self.model(self.input_ids[:b], positions, self.kv_cache, meta)
        return self.model.compute_logits(hidden)  # type: ignore[operator, no-any-return]

    def _record(self, b: int) -> _Graph:
        """First use of size b: on cpu run it; on cuda warm up on a side stream (compiles, allocator pools), then
        capture into a graph sharing one memory pool with the other sizes, and replay it for this step."""
        if not self.capture:
            return _Graph(self._forward(b))
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(b)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(b)
        self._pool = graph.pool()
        graph.replay()
        return _Graph(logits, graph)

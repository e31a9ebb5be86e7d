"""Attention over the paged KV cache, behind a small backend interface.

KV cache layout (one tensor for the whole model, so a block's K/V in every layer is one index away and can be
copied or sent as a unit):

    kv_cache[layer, 0 = K | 1 = V, block_id, slot_in_block, kv_head, head_dim]

(quantized caches, `--kv-cache-dtype int8|fp8`: the last dimension is head_dim codes + a 2-byte scale per row,
model/kv_cache_dtype.py.)

A step's tokens are laid out flat: first the decode tokens (one per sequence), then each prefill chunk
contiguously. Every token's K/V is written to its slot (`slot_mapping`) before attention reads the cache, so a
chunk sees its own keys as well as those of earlier chunks and prefix-cache hits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from pdserve.model.kv_cache_dtype import dequantize_kv, is_quantized, kv_bytes, quantize_kv


@dataclass
class PrefillChunk:
    """One sequence's prefill chunk in the flat batch."""

    start: int  # offset of its first query token in the flat batch
    num_tokens: int  # query tokens in this chunk
    num_context: int  # tokens already in the cache before this chunk (prefix hit or earlier chunks)
    block_ids: torch.Tensor  # long [ceil((num_context + num_tokens) / block_size)]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # long [num_tokens]: flat cache slot of each token
    num_decodes: int  # the first num_decodes tokens are decodes, one per sequence
    decode_block_tables: torch.Tensor | None  # long [num_decodes, max_blocks] (padded with block 0)
    decode_mask: torch.Tensor | None  # bool [num_decodes, 1, 1, max_blocks * block_size]: key is valid
    prefills: list[PrefillChunk]
    # Varlen form of the same step, one row per sequence (decodes first), for the native kernel: sequence s owns
    # query rows query_start_loc[s]..query_start_loc[s+1] and has seq_lens[s] keys once this step's K/V are written.
    block_table: torch.Tensor | None = None  # int32 [S, max_blocks] (padded with block 0)
    query_start_loc: torch.Tensor | None = None  # int32 [S + 1]
    seq_lens: torch.Tensor | None = None  # int32 [S]
    prompt_lens: torch.Tensor | None = None  # int32 [S]: rows at positions below it are prompt rows (None: none)
    block_mask: Any = None  # the flex backend's BlockMask of the step (model/flex_attention.py)
    dense_mask: torch.Tensor | None = None  # flex's dense mode: bool [T, slots], the block mask evaluated
    window_masks: dict[int, Any] = field(default_factory=dict)  # flex: sliding window -> its masks (built lazily)
    window_mask_builder: Any = None  # flex: sliding window -> (block mask, dense mask) of this step
    # KV cache groups 1.. (model/kv_layout.py): the same step with each group's slot_mapping and block tables
    groups: list[AttentionMetadata] = field(default_factory=list)

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata of KV cache group `group` (0: this one)."""
        return self if group == 0 else self.groups[group - 1]


@dataclass
class ForwardContext:
    """What a step's attention layers share besides their inputs: the whole KV cache (each layer reads its own
    `kv_cache[layer]`) and the step's metadata. Passed down explicitly, never kept between steps."""

    kv_cache: torch.Tensor  # [layers, 2, num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata


class AttentionBackend(Protocol):
    name: str
    varlen: bool  # reads the varlen metadata (block_table / query_start_loc / seq_lens); else the sdpa form

    def prepare(self, meta: AttentionMetadata, positions: torch.Tensor, num_blocks: int, block_size: int) -> None:
        """Once per step, before the layers: per-step structures shared by all layers (stored in `meta`)."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], layer_cache [2, num_blocks, block_size, Hkv, D] -> out [T, Hq, D].
        `sliding_window` > 0: the query at position p sees keys p - sliding_window < j <= p only. `softcap` > 0
        (Gemma 2): each score s (scale included) becomes softcap * tanh(s / softcap) before the softmax."""
        ...


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
         is_causal: bool = False, softcap: float = 0.0) -> torch.Tensor:
    """scaled_dot_product_attention (q [B, Hq, L, D], k/v [B, Hkv, S, D], GQA; `mask` bool, True = attend), or with
    `softcap` > 0 its math spelled out as transformers' eager Gemma 2 attention does it: scores = q k^T scale,
    softcap * tanh(scores / softcap), masked, softmax in float32, times v."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / softcap) * softcap
    if is_causal:  # query i of L sees keys 0 .. S - L + i
        length, keys = q.shape[-2], k.shape[-2]
        mask = torch.ones(length, keys, dtype=torch.bool, device=q.device).tril(keys - length)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def write_kv(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k/v [T, Hkv, D] into their slots, in the cache's format (quantized per row: model/kv_cache_dtype.py)."""
    _, nb, bs, h, row = layer_cache.shape
    if is_quantized(layer_cache.dtype):
        k, v = quantize_kv(k, layer_cache.dtype), quantize_kv(v, layer_cache.dtype)
    else:
        k, v = k.to(layer_cache.dtype), v.to(layer_cache.dtype)
    cache = kv_bytes(layer_cache)
    cache[0].view(nb * bs, h, row).index_copy_(0, slot_mapping, k)
    cache[1].view(nb * bs, h, row).index_copy_(0, slot_mapping, v)


class SDPABackend:
    """PyTorch scaled_dot_product_attention on gathered blocks: decodes batched with a padding mask,
    prefill chunks one sequence at a time (causal, offset by their context)."""

    name = "sdpa"
    varlen = False

    def prepare(self, meta: AttentionMetadata, positions: torch.Tensor, num_blocks: int, block_size: int) -> None:
        pass

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        write_kv(layer_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            assert meta.decode_block_tables is not None and meta.decode_mask is not None
            kd, vd = self._gather(layer_cache, meta.decode_block_tables, dtype=q.dtype)  # [nd, Hkv, L, D]
            qd = q[:nd].unsqueeze(2)  # [nd, Hq, 1, D]
            mask = meta.decode_mask
            if sliding_window:  # the valid keys are a prefix 0..position: keep the last sliding_window of them
                last = mask.sum(-1, keepdim=True) - 1
                mask = mask & (torch.arange(mask.shape[-1], device=q.device) > last - sliding_window)
            od = sdpa(qd, kd, vd, scale, mask, softcap=softcap)
            out[:nd] = od.squeeze(2)
        for chunk in meta.prefills:
            s, n = chunk.start, chunk.num_tokens
            qp = q[s:s + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            # the whole sequence: plain causal attention (quantized caches: attend to what was stored, as native)
            if chunk.num_context == 0 and not sliding_window and not is_quantized(layer_cache.dtype):
                kp = k[s:s + n].transpose(0, 1).unsqueeze(0)
                vp = v[s:s + n].transpose(0, 1).unsqueeze(0)
                op = sdpa(qp, kp.to(q.dtype), vp.to(q.dtype), scale, is_causal=True, softcap=softcap)
            else:
                total = chunk.num_context + n
                kp, vp = self._gather(layer_cache, chunk.block_ids.unsqueeze(0), total, q.dtype)
                # query i sits at position num_context + i and sees keys 0..num_context + i
                qpos = torch.arange(chunk.num_context, total, device=q.device).unsqueeze(1)
                key = torch.arange(total, device=q.device).unsqueeze(0)
                mask = (key <= qpos) & (key > qpos - sliding_window) if sliding_window else key <= qpos
                op = sdpa(qp, kp, vp, scale, mask, softcap=softcap)
            out[s:s + n] = op.squeeze(0).transpose(0, 1)
        return out

    @staticmethod
    def _gather(layer_cache: torch.Tensor, block_tables: torch.Tensor, length: int | None = None,
                dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the listed blocks as [B, Hkv, L, D] (L = blocks * block_size or `length`). One index_select of
        whole blocks (a row copy each, 4-5x faster than advanced indexing); the result is a strided view. Quantized
        caches are dequantized (into `dtype`, default float32); others keep their dtype unless `dtype` is given."""
        b, nblk = block_tables.shape
        _, nb, bs, h, row = layer_cache.shape
        flat = block_tables.reshape(-1)
        cache = kv_bytes(layer_cache)
        kv = cache.view(2 * nb, bs * h * row).index_select(0, torch.cat([flat, flat + nb]))
        kv = kv.view(2, b, nblk * bs, h, row)
        if length is not None:
            kv = kv[:, :, :length]
        if is_quantized(layer_cache.dtype):
            kv = dequantize_kv(kv, layer_cache.dtype, dtype or torch.float32)
        elif dtype is not None:
            kv = kv.to(dtype)
        kv = kv.transpose(2, 3)  # [2, B, Hkv, L, D]
        return kv[0], kv[1]


class NativeBackend:
    """pdserve's C++ paged attention (pdserve/kernels): reads K/V blocks in place through the block table, one
    kernel for decodes, multi-token decode rows and prefill chunks with context (GQA-aware, online softmax)."""

    name = "native"
    varlen = True

    def __init__(self, lib: Any) -> None:
        self.lib = lib  # the native kernel module (pdserve.kernels.require())

    def prepare(self, meta: AttentionMetadata, positions: torch.Tensor, num_blocks: int, block_size: int) -> None:
        pass

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        assert meta.block_table is not None and meta.query_start_loc is not None and meta.seq_lens is not None
        self.lib.reshape_and_cache(k, v, layer_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=torch.float32)
        self.lib.paged_attention(out, q, layer_cache, meta.block_table, meta.query_start_loc, meta.seq_lens, scale,
                                 sliding_window, softcap, meta.prompt_lens)
        return out

"""Paged attention with PyTorch FlexAttention: K/V are read in place from the KV cache through a block mask.

The whole layer cache is one key sequence of num_blocks x block_size physical slots ([1, Hkv, slots, D], a strided
view: no copy), and the step's flat tokens (decodes, decode rows with drafts, prefill chunks with context) are one
query sequence. Which (query, slot) pairs attend is a mask:

    slot k is visible to query row i  <=>  block k // block_size is logical block j of row i's sequence and
                                          j * block_size + k % block_size <= position of row i

(`p2l[seq, physical block]` = logical index j, or -1 when the sequence does not own the block). The block mask's
sparse structure lists, per tile of Q_BLOCK query rows, the physical blocks owned by any sequence with a row in the
tile, so the compiled kernel (cuda) loads only those; the mask function above makes the result exact. Every
tensor here has a shape fixed by (rows, sequences, table width, cache blocks), so the same code is captured inside
a CUDA graph.

Modes: `compiled` (torch.compile'd flex_attention: the fused kernel that skips unlisted blocks; the cuda default;
it also compiles on cpu, slowly: one test), `eager` (flex_attention's unfused reference), `dense` (the cpu default:
the same mask function evaluated once per step into a [T, slots] mask for scaled_dot_product_attention on the same
in-place cache view; flex's eager path materialises the same scores but re-evaluates the mask in every layer,
~30x slower on the test model).
"""

from __future__ import annotations

from typing import Any

import torch

from pdserve.model.attention import AttentionMetadata, sdpa, write_kv
from pdserve.model.kv_cache_dtype import dequantize_kv, is_quantized, kv_bytes

Q_BLOCK = 16  # query rows per sparse tile: a decode tile spans at most 16 sequences' blocks


def flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def build_block_mask(block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                     positions: torch.Tensor, num_blocks: int, block_size: int, sliding_window: int = 0) -> Any:
    """The BlockMask of a step in varlen form (AttentionMetadata.block_table / query_start_loc / seq_lens; the
    rows' positions). `num_blocks`: physical blocks in the cache. `sliding_window` > 0: a row at position p sees
    keys p - sliding_window < j <= p only (the sparse structure still lists every owned block: a superset).
    No data-dependent shapes (CUDA-graph safe)."""
    from torch.nn.attention.flex_attention import BlockMask

    dev = positions.device
    t, (s, w) = positions.shape[0], block_table.shape
    counts = (query_start_loc[1:] - query_start_loc[:-1]).long()
    q_seq = torch.repeat_interleave(torch.arange(s, device=dev), counts, output_size=t)  # row -> sequence
    logical = torch.arange(w, device=dev).unsqueeze(0).expand(s, w)
    valid = logical < (seq_lens.long() + block_size - 1).div(block_size, rounding_mode="floor").unsqueeze(1)
    # invalid table entries (padding) scatter into a dummy column num_blocks, dropped after
    cols = torch.where(valid, block_table.long(), num_blocks)
    p2l = torch.full((s, num_blocks + 1), -1, dtype=torch.int32, device=dev)
    p2l.scatter_(1, cols, torch.where(valid, logical, -1).to(torch.int32))
    p2l = p2l[:, :num_blocks].contiguous()
    pos = positions.long()

    def mask_mod(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        lb = p2l[q_seq[q_idx], kv_idx // block_size]
        key = lb * block_size + kv_idx % block_size
        visible = (lb >= 0) & (key <= pos[q_idx])
        return visible & (key > pos[q_idx] - sliding_window) if sliding_window else visible

    nq = -(-t // Q_BLOCK)
    member = torch.zeros(nq, s, dtype=torch.float32, device=dev)  # tile has a row of the sequence
    member[torch.arange(t, device=dev) // Q_BLOCK, q_seq] = 1.0
    tile_blocks = (member @ (p2l >= 0).float()) > 0  # [nq, num_blocks]
    kv_num = tile_blocks.sum(-1, dtype=torch.int32)
    kv_idx = torch.argsort(tile_blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return BlockMask.from_kv_blocks(kv_num[None, None], kv_idx[None, None], BLOCK_SIZE=(Q_BLOCK, block_size),
                                    mask_mod=mask_mod, seq_lengths=(t, num_blocks * block_size),
                                    compute_q_blocks=False)


def _softcap_mod(softcap: float) -> Any:
    """flex's score_mod for attention logit soft-capping (Gemma 2): on the scaled score, before the mask."""
    def score_mod(score: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> torch.Tensor:
        return torch.tanh(score / softcap) * softcap
    return score_mod


FLEX_MODES = ("compiled", "eager", "dense")


class FlexBackend:
    """Attention through torch.nn.attention.flex_attention on the cache in place. Needs the varlen metadata and
    `meta.block_mask` (built once per step by `prepare`, shared by all layers)."""

    name = "flex"
    varlen = True  # the runner builds block_table / query_start_loc / seq_lens for it

    def __init__(self, device: torch.device | str = "cpu", mode: str | None = None) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        self.mode = mode or ("compiled" if torch.device(device).type == "cuda" else "dense")
        if self.mode not in FLEX_MODES:
            raise ValueError(f"flex mode must be one of {FLEX_MODES}, got {self.mode!r}")
        # automatic dynamic shapes: compiled for the first step's row count, recompiled once with a symbolic one
        self._attn: Any = torch.compile(flex_attention) if self.mode == "compiled" else flex_attention
        # The Triton kernel's tiles must divide the sparse blocks (Q_BLOCK rows x one cache block of keys), and
        # its separate decoding kernel has other constraints: force the main kernel at those tile sizes (as vLLM's
        # flex backend does for a directly built block mask). Not on cpu, whose compiled template picks its own.
        self._on_cuda = torch.device(device).type == "cuda"

    def prepare(self, meta: AttentionMetadata, positions: torch.Tensor, num_blocks: int, block_size: int) -> None:
        meta.block_mask, meta.dense_mask = self._masks(meta, positions, num_blocks, block_size, 0)
        meta.window_masks = {}
        # a sliding window's masks are built on its first layer's use, once per step
        meta.window_mask_builder = lambda window: self._masks(meta, positions, num_blocks, block_size, window)

    def _masks(self, meta: AttentionMetadata, positions: torch.Tensor, num_blocks: int, block_size: int,
               sliding_window: int) -> tuple[Any, torch.Tensor | None]:
        """The step's block mask and, in dense mode, the dense mask it evaluates to."""
        assert meta.block_table is not None and meta.query_start_loc is not None and meta.seq_lens is not None
        block_mask = build_block_mask(meta.block_table, meta.query_start_loc, meta.seq_lens, positions, num_blocks,
                                      block_size, sliding_window)
        if self.mode != "dense":
            return block_mask, None
        from torch.nn.attention.flex_attention import create_mask

        t, slots = block_mask.seq_lengths
        return block_mask, create_mask(block_mask.mask_mod, None, None, t, slots, device=positions.device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        write_kv(layer_cache, k, v, meta.slot_mapping)
        block_mask, dense_mask = meta.block_mask, meta.dense_mask
        if sliding_window:  # one mask per window and step, shared by the layers of that window
            if sliding_window not in meta.window_masks:
                assert meta.window_mask_builder is not None
                meta.window_masks[sliding_window] = meta.window_mask_builder(sliding_window)
            block_mask, dense_mask = meta.window_masks[sliding_window]
        cache = layer_cache
        if is_quantized(cache.dtype):  # int8/fp8 rows: the layer dequantized whole (correct, not fast)
            cache = dequantize_kv(kv_bytes(cache), cache.dtype, q.dtype)
        _, nb, bs, h, d = cache.shape
        kc = cache[0].view(1, nb * bs, h, d).transpose(1, 2)  # [1, Hkv, slots, D]: a view
        vc = cache[1].view(1, nb * bs, h, d).transpose(1, 2)
        qf = q.to(cache.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
        if self.mode == "dense":
            out = sdpa(qf, kc, vc, scale, dense_mask, softcap=softcap)
        else:
            opts = {"BLOCK_M": Q_BLOCK, "BLOCK_N": bs, "FORCE_USE_FLEX_ATTENTION": True} if self._on_cuda else None
            out = self._attn(qf, kc, vc, block_mask=block_mask, scale=scale, enable_gqa=True,
                             kernel_options=opts, score_mod=_softcap_mod(softcap) if softcap else None)
        return out[0].transpose(0, 1).to(q.dtype)

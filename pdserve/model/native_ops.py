"""Which kernels a model's layer modules run, chosen once when the model is built.

`KernelSelection` is the one object that says it: the attention backend (sdpa | flex for the PyTorch reference,
native with the native kernels) and `native`, the native layer ops or None for the PyTorch reference. Every layer
module (model/layers/) takes it at construction and binds its PyTorch or its native implementation then; nothing
asks a backend what it can do at run time.

`NativeOps` is the native side: one method per layer op, on float32 activations [T, width] whose rows may be strided
(a column slice of a wider matrix, e.g. q out of the fused qkv output). The same methods are what
model/native_program.py records to build the whole-stack program, so a layer module reaches the native kernels only
through them.

`PackedMatrix` is what a Linear or Embedding module accepts besides a float tensor: a weight matrix W [N, K] in a
packed format, with forward / rows / dequantize. The kernels' PackedWeight objects (csrc/packed_weight.h: GGUF blocks
and float weights, model/packed_weights.py), and on the PyTorch path oneDNN's reordered copy and int8 weights, are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from pdserve.model.attention import AttentionBackend, AttentionMetadata, ForwardContext, NativeBackend


class PackedMatrix(Protocol):
    """A weight W [N, K] as stored for its kernels; activations float (float32 for the native formats)."""

    @property
    def shape(self) -> tuple[int, int]: ...

    @property
    def nbytes(self) -> int:
        """Bytes one pass over W reads (what a batch-1 decode step streams for it)."""
        ...

    @property
    def type_name(self) -> str:
        """The stored type, as GGUF names it where it has a name: Q4_K, Q8_0, BF16, F32, ..."""
        ...

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                prompt_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ W.T (+ bias) -> [M, N]; prompt_rows (uint8/bool [M]): which rows are prompt rows."""
        ...

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] as [*ids.shape, K] (W read as an embedding table)."""
        ...

    def dequantize(self) -> torch.Tensor:
        """W as a float tensor [N, K]: the values the kernels multiply by."""
        ...


Weight = torch.Tensor | PackedMatrix  # what Linear and Embedding hold


class NativeOps:
    """The native layer ops (pdserve/kernels). In-place ops say so; the others return a new float32 tensor."""

    def __init__(self, lib: Any, bf16_prompt_rows: bool = False) -> None:
        """`bf16_prompt_rows`: the linears may multiply prompt rows by another fixed arithmetic (GGUF blocks on AMX:
        bf16 tiles, csrc/packed_weight.h); on for dtype bfloat16, off for float32 (every row int8 / fp32 as stored)."""
        self.lib = lib
        self.attention_backend = NativeBackend(lib)
        self.bf16_prompt_rows = bf16_prompt_rows
        self._prompt_rows: torch.Tensor | None = None  # the current forward's row kinds (step)

    def prompt_rows(self, meta: AttentionMetadata) -> torch.Tensor | None:
        """uint8 [T]: which of the step's rows the linears treat as prompt rows (None: none)."""
        if not self.bf16_prompt_rows or meta.prompt_lens is None or meta.query_start_loc is None \
                or meta.seq_lens is None:
            return None
        return self.lib.prompt_row_mask(meta.query_start_loc, meta.seq_lens, meta.prompt_lens)  # type: ignore[no-any-return]

    @contextlib.contextmanager
    def step(self, meta: AttentionMetadata) -> Iterator[None]:
        """For one forward over a step's rows: the linears learn the rows' kinds (prompt_rows), as the whole-stack
        program is told them."""
        self._prompt_rows = self.prompt_rows(meta)
        try:
            yield
        finally:
            self._prompt_rows = None

    def embedding(self, ids: torch.Tensor, weight: Weight) -> torch.Tensor:
        return F.embedding(ids, weight) if isinstance(weight, torch.Tensor) else weight.rows(ids)

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return F.linear(x, weight, bias)
        rows = self._prompt_rows
        # inside a step every linear reads all of its rows (the logits' rows are picked outside one)
        if rows is not None and rows.shape[0] == x.shape[0]:
            return weight.forward(x, bias, rows)
        return weight.forward(x, bias)

    def writes_into(self, weight: Weight) -> bool:
        """linear_into takes this weight: the kernels' own packed matrix (not a float tensor or another format)."""
        return isinstance(weight, self.lib.PackedWeight)

    def linear_into(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        """linear's product (every row a generated one) written into out (float32 [M, N]); where writes_into."""
        assert isinstance(weight, self.lib.PackedWeight), "linear_into takes the kernels' own packed weights"
        weight.forward_into(x, out, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=torch.float32)
        self.lib.rms_norm(out, x, weight, eps)
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """In place: residual += x; x = rms_norm(residual) * weight."""
        self.lib.fused_add_rms_norm(x, residual, weight, eps)

    def head_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """In place: every head (weight.numel() wide) of every row of x rms-normed and scaled."""
        self.lib.rms_norm_heads(x, weight, eps)

    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, head_dim: int) -> None:
        """In place: rotate-half RoPE of every head of q and k at rows `positions` of cos/sin [P, rotary_dim / 2]
        (the first rotary_dim = 2 * cos.shape[1] <= head_dim dims of each head turn)."""
        self.lib.rotary_embedding(positions, q, k, cos, sin, head_dim)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=torch.float32)
        self.lib.silu_and_mul(out, x)
        return out

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """gelu(x[:, :I], approximate="tanh") * x[:, I:] (Gemma's GeGLU)."""
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=torch.float32)
        self.lib.gelu_tanh_and_mul(out, x)
        return out

    def scale(self, x: torch.Tensor, factor: float) -> None:
        """In place: x *= factor (rounded to float32 first, as a float32 tensor factor would be)."""
        x.mul_(factor)

    def moe(self, x: torch.Tensor, logits: torch.Tensor, experts: Any) -> torch.Tensor:
        """The sparse MLP of x [T, H] with router logits [T, E] over `experts` (the kernels' MoeExperts: each row's
        top-k experts run on it, their outputs weighted and summed; csrc/moe.h)."""
        out = torch.empty(x.shape, dtype=torch.float32)
        rows = self._prompt_rows
        experts.forward_into(x, logits, out, rows if rows is not None and rows.shape[0] == x.shape[0] else None)
        return out

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext, layer: int,
                  num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                  sliding_window: int = 0, softcap: float = 0.0, group: int = 0) -> torch.Tensor:
        """Write k/v [T, Hkv * D] into cache index `layer` with KV group `group`'s slots, attend q [T, Hq * D] ->
        [T, Hq * D] (`sliding_window` > 0: each query sees its last sliding_window keys only; `softcap` > 0: scores
        capped)."""
        t = q.shape[0]
        out = self.attention_backend.forward(q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim),
                                             v.view(t, num_kv_heads, head_dim), ctx.kv_cache[layer],
                                             ctx.meta.for_group(group), scale, sliding_window, softcap)
        return out.view(t, num_heads * head_dim)


@dataclass
class KernelSelection:
    """The kernels of one model, fixed at construction (see the module docstring)."""

    attention: AttentionBackend
    native: NativeOps | None = None  # None: the PyTorch reference ops

    @property
    def ops(self) -> NativeOps:
        """The native ops; only the native implementations of the layer modules call this."""
        assert self.native is not None, "the PyTorch reference path has no native ops"
        return self.native

    @contextlib.contextmanager
    def step(self, meta: AttentionMetadata) -> Iterator[None]:
        """Around one forward over a step's rows (NativeOps.step; nothing on the PyTorch path)."""
        if self.native is None:
            yield
            return
        with self.native.step(meta):
            yield

    @contextlib.contextmanager
    def recording(self, recorder: NativeOps) -> Iterator[None]:
        """Route the native ops to `recorder` for the duration (model/native_program.py builds a program so)."""
        saved, self.native = self.ops, recorder
        try:
            yield
        finally:
            self.native = saved


def select_kernels(kernels: str, attention_backend: str = "auto",
                   device: torch.device | str = "cpu", bf16_prompt_rows: bool = False) -> KernelSelection:
    """`kernels`: native | torch (the engine resolves auto before this). `attention_backend` (torch kernels): sdpa
    | flex | auto (flex on cuda, sdpa on cpu). `bf16_prompt_rows`: NativeOps'."""
    from pdserve import kernels as native_kernels
    from pdserve.model.attention_backends import get_attention_backend

    if kernels == "native":
        ops = NativeOps(native_kernels.require(), bf16_prompt_rows)
        return KernelSelection(ops.attention_backend, ops)
    if kernels != "torch":
        raise ValueError(f"kernels must be native or torch here, got {kernels!r}")
    on_cpu = torch.device(device).type == "cpu"
    name = attention_backend if attention_backend != "auto" else ("sdpa" if on_cpu else "flex")
    return KernelSelection(get_attention_backend(name, device))

"""What every decoder-only architecture shares: the token embedding, decoder layers in vLLM's residual form, the
final norm and the lm_head, run on flat token batches.

`forward(input_ids [T], positions [T], kv_cache, meta)` runs every token of a step (decodes and prefill chunks of
many sequences) as one [T, hidden] matrix; only attention looks at sequence boundaries. Its Python definition is
`hidden_states`: embed, then `hidden, residual = layer(positions, hidden, residual, ctx)` for every layer, then the
final norm with the last residual add fused in. An architecture subclasses CausalLM, builds its layers from the shared
modules (model/layers/) and maps its checkpoint's weight names (`load_hf_state_dict`, with `WeightLoader`).

With the native kernels the same definition is recorded once into a NativeProgram (model/native_program.py) that
runs the whole stack in one native call per step; the Python definition stays the only one.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from pdserve.config import ModelArchConfig
from pdserve.model.attention import AttentionMetadata, ForwardContext
from pdserve.model.kv_layout import KVCacheLayout
from pdserve.model.layers.linear import Embedding, Linear
from pdserve.model.layers.norm import RMSNorm
from pdserve.model.layers.paged_attention import PagedAttention
from pdserve.model.layers.rotary import RotaryEmbedding
from pdserve.model.native_ops import KernelSelection
from pdserve.model.packed_weights import GGUFMatrix, StateDict, pack_matrices

logger = logging.getLogger(__name__)


class CausalLM(nn.Module):
    embed_tokens: Embedding
    layers: nn.ModuleList
    norm: RMSNorm
    lm_head: Linear

    def __init__(self, cfg: ModelArchConfig, kernels: KernelSelection) -> None:
        super().__init__()
        self.cfg = cfg
        self.kernels = kernels
        self.program: Any = None  # the native whole-stack program, once build_native_program succeeded
        self._logits_buf: torch.Tensor | None = None  # compute_logits(reuse=True)'s rows

    def build(self, layers: list[nn.Module], embed_scale: float | None = None) -> None:
        """The shared parts around an architecture's `layers`: embedding (times `embed_scale`), final norm, lm_head
        (the embedding's weight when tied)."""
        cfg, kernels = self.cfg, self.kernels
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, kernels, scale=embed_scale)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, kernels)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [T, hidden]; call `compute_logits` on the rows that need sampling."""
        if self.program is not None:
            slots, table = meta.slot_mapping, meta.block_table
            if meta.groups:  # KV cache groups: each attention op picks its group's row
                slots = torch.stack([slots] + [m.slot_mapping for m in meta.groups])
                table = torch.stack([t for t in [table] + [m.block_table for m in meta.groups] if t is not None])
            return self.program.run(input_ids, positions, kv_cache, slots, table, meta.query_start_loc,
                                    meta.seq_lens, meta.prompt_lens, self.kernels.ops.prompt_rows(meta))
        return self.hidden_states(input_ids, positions, ForwardContext(kv_cache, meta))

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The model's one definition (see the module docstring)."""
        with self.kernels.step(ctx.meta):
            hidden, residual = self.embed(input_ids), None
            for layer in self.layers:
                hidden, residual = layer(positions, hidden, residual, ctx)
            hidden, _ = self.norm(hidden, residual)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> the first layer's input (Gemma's embedding module scales it by sqrt(hidden))."""
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor, reuse: bool = False) -> torch.Tensor:
        """float32 logits of `hidden`'s rows. `reuse`: into a buffer the model keeps, valid until the next reusing
        call (a step's sampled rows: [rows, vocab] is megabytes, and under the server's allocator settings a fresh
        block that large is mmapped and its pages zero-filled by the OS on every step; BENCHMARKS.md)."""
        if reuse and self.lm_head.writes_into:
            logits = self._logits_buffer(hidden.shape[0])
            self.lm_head.multiply_into(hidden, logits)
        else:
            logits = self.lm_head(hidden).float()
        cap = self.cfg.final_logit_softcapping
        if cap:  # Gemma 2's final soft-capping, tanh(logits / cap) * cap, in place (the buffer stays the result)
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    def _logits_buffer(self, rows: int) -> torch.Tensor:
        """The kept logits buffer's first `rows` rows, as wide as the lm_head's output (native kernels: on the CPU;
        grown in steps of 16 rows)."""
        if self._logits_buf is None or self._logits_buf.shape[0] < rows:
            self._logits_buf = torch.empty((-(-rows // 16) * 16, self.lm_head.out_features), dtype=torch.float32)
        return self._logits_buf[:rows]

    def place_kv(self, layout: KVCacheLayout) -> None:
        """Point each attention layer at its KV cache group and cache index (before the program is recorded)."""
        for m in self.modules():
            if isinstance(m, PagedAttention):
                m.kv_group, m.kv_index = layout.placement(m.layer_idx)

    def build_native_program(self) -> bool:
        """Record `hidden_states` into a NativeProgram that `forward` runs from then on (native kernels only).
        A model the recorder cannot express keeps running its Python definition, with a warning."""
        from pdserve.model.native_program import ProgramUnsupported, record_program

        try:
            self.program = record_program(self)
        except ProgramUnsupported as e:
            logger.warning("native whole-stack program unavailable (%s): the layers run one native call per op", e)
            self.program = None
        return self.program is not None

    def to_device(self, device: torch.device) -> None:
        """Move what `nn.Module.to` does not (the float32 rope tables)."""
        for m in self.modules():
            if isinstance(m, RotaryEmbedding):
                m.to_device(device)

    def load_hf_state_dict(self, sd: StateDict) -> None:
        raise NotImplementedError


class WeightLoader:
    """Copies Hugging Face-named weights into a model, fusing parts into one matrix; remembers what it used so that
    `finish` can refuse a checkpoint with weights the architecture does not know."""

    def __init__(self, sd: StateDict) -> None:
        self.sd = sd
        self.used: set[str] = set()

    def take(self, name: str) -> torch.Tensor | GGUFMatrix:
        if name not in self.sd:
            raise KeyError(f"checkpoint lacks {name}")
        self.used.add(name)
        return self.sd[name]

    def tensor(self, name: str) -> torch.Tensor:
        """A weight that is always float (norms, biases): GGUF blocks are dequantized."""
        w = self.take(name)
        return w.dequantize() if isinstance(w, GGUFMatrix) else w

    @torch.no_grad()
    def matrix(self, module: Linear | Embedding, names: list[str], bias: list[str] | None = None) -> None:
        """Fill `module` with the row-concatenation of the named weights: packed as stored when every part is a GGUF
        matrix (packed_weights.pack_matrices, each part in its own type), else as floats (GGUF parts dequantized)."""
        parts = [self.take(n) for n in names]
        gguf = [p for p in parts if isinstance(p, GGUFMatrix)]
        if gguf and len(gguf) == len(parts):
            module.set_packed(pack_matrices(gguf))
        else:
            assert module.weight is not None
            module.weight.copy_(torch.cat([p.dequantize() if isinstance(p, GGUFMatrix) else p for p in parts]))
        if bias is not None:
            assert isinstance(module, Linear) and module.bias is not None
            module.bias.copy_(torch.cat([self.tensor(n) for n in bias]))

    @torch.no_grad()
    def copy(self, param: nn.Parameter, name: str, offset: float = 0.0) -> None:
        """param = the named weight (+ offset: Gemma's norms scale by 1 + w, their weight becomes 1 + w here)."""
        w = self.tensor(name)
        param.copy_(w + offset if offset else w)

    def finish(self) -> None:
        """Raise on weights no module took (Hugging Face's rotary buffers aside)."""
        unexpected = [k for k in self.sd if k not in self.used and "rotary_emb" not in k]
        if unexpected:
            raise KeyError(f"checkpoint has unexpected weights, e.g. {unexpected[:5]}")

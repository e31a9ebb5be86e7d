"""ModelRunner: owns the weights and the KV cache; turns a SchedulerOutput (plain data, pdserve/model/inputs.py)
into batch tensors, runs the model and samples. Batch tensors (input_ids, positions, slot_mapping, block tables,
masks) are built once per step and shared by all layers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import nn

from pdserve.config import ModelArchConfig
from pdserve.model.attention import AttentionMetadata, PrefillChunk, get_attention_backend
from pdserve.model.cpu_linear import pack_model_linears, use_onednn
from pdserve.model.inputs import SchedulerOutput
from pdserve.model.llama import LlamaForCausalLM, skip_weight_init
from pdserve.model.quant import quantize_model
from pdserve.model.quant_linear import QuantEmbedding, QuantLinear, StateDict
from pdserve.model.sampler import Sampler, SamplerOutput, score_tokens
from pdserve.outputs import TokenLogprobs
from pdserve.roofline import StepCostModel

PROMPT_ROWS_PER_PASS = 256  # prompt-logprob rows per logits pass: bounds memory to 256 x vocab floats


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # flat-batch rows whose logits are sampled, in sampling-metadata order (1 + drafts each)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, align: int = 64) -> torch.Tensor:
    """A zero tensor whose pages the OS zero-fills on first touch (numpy's calloc) instead of torch.zeros' memset
    of the whole buffer: a 1 GiB KV cache costs nothing at start-up, and memory is committed as blocks are used.
    The data pointer is `align`-byte aligned, as torch's allocator would give."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    buf = np.zeros(nbytes + align, dtype=np.uint8)
    off = -buf.ctypes.data % align
    return torch.from_numpy(buf[off:off + nbytes]).view(dtype).view(shape)


class ModelRunner:
    def __init__(self, arch: ModelArchConfig, state_dict: StateDict, dtype: torch.dtype,
                 num_blocks: int, block_size: int, max_model_len: int, kernels: str = "torch",
                 quantization: str | None = None, linear_backend: str = "auto") -> None:
        """`kernels`: "native" (pdserve/kernels: fused layer ops, paged attention in place, GGUF-block linears) or
        "torch" (the PyTorch reference path); the engine resolves "auto" before this."""
        self.arch = arch
        self.dtype = dtype
        self.block_size = block_size
        with skip_weight_init():  # uninitialised (untouched, so unpaged) parameters: the state dict fills them
            model = LlamaForCausalLM(arch, max_positions=1)
        model.rotary = type(model.rotary)(arch, max_model_len)
        model.load_hf_state_dict(state_dict)
        self.model = model.to(dtype).eval()
        native = kernels == "native"
        if quantization:
            quantize_model(self.model, quantization, packed=use_onednn(linear_backend, dtype), native=native)
        if use_onednn(linear_backend, dtype):
            pack_model_linears(self.model)  # the float projections that remain
        self.backend = get_attention_backend("native" if native else "sdpa")
        if native:
            self.model.build_native_decoder(self.backend.ops)  # type: ignore[attr-defined]
        self.sampler = Sampler()
        self.kv_cache = lazy_zeros((arch.num_hidden_layers, 2, num_blocks, block_size, arch.num_key_value_heads,
                                    arch.head_dim), dtype)

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in _weights(self.model))

    def step_cost_model(self) -> StepCostModel:
        """The live roofline's FLOP and byte counts, from the weights as stored (int8 weights count 1 byte, GGUF
        blocks their bytes per block)."""
        layer_params = layer_bytes = 0
        for layer in self.model.layers:
            p, b = _matrix_stats(layer)
            layer_params, layer_bytes = layer_params + p, layer_bytes + b
        head_params, head_bytes = _matrix_stats(self.model.lm_head)
        emb = cast(nn.Module, self.model.embed_tokens)
        emb_w = cast(torch.Tensor, emb.qweight if isinstance(emb, QuantEmbedding) else emb.weight)
        emb_row_bytes = int(emb_w.shape[1] * emb_w.element_size())
        return StepCostModel.for_model(
            self.arch, layer_params=layer_params, layer_weight_bytes=layer_bytes, lm_head_params=head_params,
            lm_head_bytes=head_bytes, embed_row_bytes=emb_row_bytes, kv_dtype_bytes=self.kv_cache.element_size())

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        return self._prepare_varlen(sched) if self.backend.name == "native" else self._prepare_sdpa(sched)

    def _prepare_varlen(self, sched: SchedulerOutput) -> StepInputs:
        """One row per sequence (decodes first): the native kernel's block_table / query_start_loc / seq_lens."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl, seq_lens, tables = [0], [], []
        sample_rows: list[int] = []
        for i, r in enumerate(sched.scheduled_reqs):
            c, n, b = r.num_computed_tokens, r.num_scheduled_tokens, r.block_ids
            ids.extend(r.token_ids)
            span = range(c, c + n)
            pos.extend(span)
            slots.extend(b[p // bs] * bs + p % bs for p in span)
            qsl.append(len(ids))
            seq_lens.append(c + n)
            tables.append(b)
            if i < sched.num_decode_tokens or r.sample:  # a decode computes the newest token: always sampled
                sample_rows.extend(range(len(ids) - 1 - r.num_draft_tokens, len(ids)))
        width = max(len(b) for b in tables)
        block_table = torch.tensor([b + [0] * (width - len(b)) for b in tables], dtype=torch.int32)
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long),
                                 num_decodes=sched.num_decode_tokens, decode_block_tables=None, decode_mask=None,
                                 prefills=[], block_table=block_table,
                                 query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                                 seq_lens=torch.tensor(seq_lens, dtype=torch.int32))
        return StepInputs(torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), meta,
                          sample_rows)

    def _prepare_sdpa(self, sched: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[torch.Tensor] = []
        sample_rows: list[int] = []
        decodes = sched.scheduled_reqs[:sched.num_decode_tokens]
        prefills = sched.scheduled_reqs[sched.num_decode_tokens:]

        decode_tables = decode_mask = None
        if decodes:
            width = max(len(d.block_ids) for d in decodes)
            decode_tables = torch.zeros(len(decodes), width, dtype=torch.long)
            for i, d in enumerate(decodes):
                decode_tables[i, :len(d.block_ids)] = torch.tensor(d.block_ids, dtype=torch.long)
            dpos = torch.tensor([d.num_computed_tokens for d in decodes], dtype=torch.long)
            slots.append(decode_tables.gather(1, (dpos // bs).unsqueeze(1)).squeeze(1) * bs + dpos % bs)
            decode_mask = (torch.arange(width * bs).unsqueeze(0) <= dpos.unsqueeze(1))[:, None, None, :]
            for i, d in enumerate(decodes):
                ids.append(d.token_ids[0])
                sample_rows.append(i)  # a decode computes the newest token: always sampled
            pos.extend(dpos.tolist())

        chunks: list[PrefillChunk] = []
        for d in prefills:
            start, c, n = len(ids), d.num_computed_tokens, d.num_scheduled_tokens
            table = torch.tensor(d.block_ids, dtype=torch.long)
            p = torch.arange(c, c + n)
            slots.append(table[p // bs] * bs + p % bs)
            ids.extend(d.token_ids)
            pos.extend(range(c, c + n))
            chunks.append(PrefillChunk(start, n, c, table[:-(-(c + n) // bs)]))  # also decodes with drafts
            sample_rows.extend(range(start + n - d.num_sample_rows, start + n))

        meta = AttentionMetadata(slot_mapping=torch.cat(slots), num_decodes=len(decodes),
                                 decode_block_tables=decode_tables, decode_mask=decode_mask, prefills=chunks)
        return StepInputs(torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), meta,
                          sample_rows)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> SamplerOutput:
        """Run one step; row i of the result is row i of `sched.sampling_metadata`."""
        inp = self.prepare(sched)
        hidden = self.model(inp.input_ids, inp.positions, self.kv_cache, inp.meta, self.backend)
        if inp.sample_rows:
            out = self.sampler(self.model.compute_logits(hidden[inp.sample_rows]), sched.sampling_metadata)
        else:
            out = SamplerOutput([], [])
        out.prompt_logprobs = self._prompt_logprobs(hidden, sched)
        out.pooled = self._pooled(hidden, sched)
        return out

    @staticmethod
    def _pooled(hidden: torch.Tensor, sched: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Per pooling request, the float32 sum of its marked rows' final hidden states (post final norm)."""
        out: dict[str, torch.Tensor] = {}
        row = 0
        for r in sched.scheduled_reqs:
            if r.pool_offset is not None:
                out[r.req_id] = hidden[row + r.pool_offset:row + r.num_scheduled_tokens].float().sum(0)
            row += r.num_scheduled_tokens
        return out

    def _prompt_logprobs(self, hidden: torch.Tensor, sched: SchedulerOutput) -> dict[str, list[TokenLogprobs]]:
        """Score the prompt rows the scheduler marked (only requests that asked), PROMPT_ROWS_PER_PASS rows of
        logits at a time. Flat rows follow `scheduled_reqs` in order on both attention paths."""
        out: dict[str, list[TokenLogprobs]] = {}
        row = 0
        for r in sched.scheduled_reqs:
            if r.prompt_logprobs is not None:
                first, targets, scored = row + r.prompt_logprob_offset, r.prompt_logprob_targets, []
                for j in range(0, len(targets), PROMPT_ROWS_PER_PASS):
                    part = targets[j:j + PROMPT_ROWS_PER_PASS]
                    logits = self.model.compute_logits(hidden[first + j:first + j + len(part)])
                    scored += score_tokens(logits, part, r.prompt_logprobs)
                out[r.req_id] = scored
            row += r.num_scheduled_tokens
        return out


def _matrix_stats(module: torch.nn.Module) -> tuple[int, int]:
    """(weights, bytes as stored) of the weight matrices under `module`; GGUF blocks count their real size."""
    params = nbytes = 0
    for m in module.modules():
        if isinstance(m, QuantLinear):
            params += m.out_features * m.in_features
            nbytes += cast(torch.Tensor, m.qweight).numel()
    for t in _weights(module):
        if (t.dim() == 2 and t.is_floating_point()) or t.dtype == torch.int8:
            params += t.numel()
            nbytes += t.numel() * t.element_size()
    return params, nbytes


def _weights(module: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers, each storage once (a tied lm_head is the embedding)."""
    seen: set[int] = set()
    out = []
    for t in [*module.parameters(), *module.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out.append(t)
    return out

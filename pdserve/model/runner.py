"""ModelRunner: owns the weights and the KV cache; turns a SchedulerOutput (plain data, pdserve/model/inputs.py)
into batch tensors, runs the model and samples. Batch tensors (input_ids, positions, slot_mapping, block tables,
masks) are built once per step and shared by all layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.config import ModelArchConfig
from pdserve.model.attention import AttentionMetadata, PrefillChunk, get_attention_backend
from pdserve.model.cpu_linear import pack_model_linears, use_onednn
from pdserve.model.inputs import SchedulerOutput
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.quant import quantize_model
from pdserve.model.sampler import Sampler, SamplerOutput
from pdserve.roofline import StepCostModel


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # flat-batch rows whose logits are sampled, in sampling-metadata order


class ModelRunner:
    def __init__(self, arch: ModelArchConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                 num_blocks: int, block_size: int, max_model_len: int, attention_backend: str = "sdpa",
                 quantization: str | None = None, linear_backend: str = "auto") -> None:
        self.arch = arch
        self.dtype = dtype
        self.block_size = block_size
        with torch.device("meta"):
            model = LlamaForCausalLM(arch, max_positions=1)
        model = model.to_empty(device="cpu")
        model.rotary = type(model.rotary)(arch, max_model_len)  # meta tensors cannot hold the table
        if arch.tie_word_embeddings:  # to_empty() allocates each parameter anew, which unties them
            model.lm_head.weight = model.embed_tokens.weight
        model.load_hf_state_dict(state_dict)
        self.model = model.to(dtype).eval()
        if quantization:
            quantize_model(self.model, quantization, packed=use_onednn(linear_backend, dtype))
        elif use_onednn(linear_backend, dtype):
            pack_model_linears(self.model)
        self.backend = get_attention_backend(attention_backend)
        self.sampler = Sampler()
        self.kv_cache = torch.zeros(arch.num_hidden_layers, 2, num_blocks, block_size, arch.num_key_value_heads,
                                    arch.head_dim, dtype=dtype)

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in _weights(self.model))

    def step_cost_model(self) -> StepCostModel:
        """The live roofline's FLOP and byte counts, from the weights as stored (int8 weights count 1 byte)."""
        layers = [t for layer in self.model.layers for t in _weights(layer) if t.dim() == 2]
        head = _weights(self.model.lm_head)
        emb = self.model.embed_tokens.weight
        return StepCostModel.for_model(
            self.arch, layer_params=sum(t.numel() for t in layers),
            layer_weight_bytes=sum(t.numel() * t.element_size() for t in layers),
            lm_head_params=max(t.numel() for t in head), lm_head_bytes=sum(t.numel() * t.element_size() for t in head),
            embed_row_bytes=emb.shape[1] * emb.element_size(), kv_dtype_bytes=self.kv_cache.element_size())

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
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
            chunks.append(PrefillChunk(start, n, c, table[:-(-(c + n) // bs)]))
            if d.sample:
                sample_rows.append(start + n - 1)

        meta = AttentionMetadata(slot_mapping=torch.cat(slots), num_decodes=len(decodes),
                                 decode_block_tables=decode_tables, decode_mask=decode_mask, prefills=chunks)
        return StepInputs(torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), meta,
                          sample_rows)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> SamplerOutput:
        """Run one step; row i of the result is row i of `sched.sampling_metadata`."""
        inp = self.prepare(sched)
        hidden = self.model(inp.input_ids, inp.positions, self.kv_cache, inp.meta, self.backend)
        if not inp.sample_rows:
            return SamplerOutput([], [])
        logits = self.model.compute_logits(hidden[inp.sample_rows])
        return self.sampler(logits, sched.sampling_metadata)


def _weights(module: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers, each storage once (a tied lm_head is the embedding)."""
    seen: set[int] = set()
    out = []
    for t in [*module.parameters(), *module.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out.append(t)
    return out

"""ModelRunner: owns the weights and the KV cache; turns a SchedulerOutput (plain data, pdserve/model/inputs.py)
into batch tensors, runs the model and samples. Batch tensors (input_ids, positions, slot_mapping, block tables,
masks) are built once per step and shared by all layers. Across steps it keeps each running request's sampling
state (input_batch.py); with speculative decoding it owns the drafter, which proposes after each step, and the
rejection sampler that verifies drafts (model/spec)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from pdserve.config import ModelArchConfig
from pdserve.model.architectures import build_loaded_model
from pdserve.model.attention import AttentionMetadata, ForwardContext, PrefillChunk
from pdserve.model.cpu_linear import OneDNNWeight
from pdserve.model.decode_graphs import DecodeGraphRunner
from pdserve.model.input_batch import InputBatch
from pdserve.model.inputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pdserve.model.kv_cache_dtype import kv_row_elements
from pdserve.model.kv_layout import KVCacheLayout
from pdserve.model.kv_prefault import PagePopulator
from pdserve.model.layers.linear import Embedding, Linear
from pdserve.model.layers.moe import SparseMoE
from pdserve.model.lora import LoRAManager
from pdserve.model.native_ops import select_kernels
from pdserve.model.packed_weights import StateDict
from pdserve.model.sampler import Sampler, SamplerOutput, argmax_rows, score_tokens
from pdserve.model.spec.proposer import DraftRequest, Proposer
from pdserve.model.spec.rejection_sampler import RejectionSampler
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


def _table(r: ScheduledRequest, group: int) -> list[int]:
    """The request's block table in KV cache group `group`."""
    return r.block_ids if group == 0 else r.group_block_ids[group - 1]


class ModelRunner:
    def __init__(self, arch: ModelArchConfig, state_dict: StateDict, dtype: torch.dtype,
                 num_blocks: int, block_size: int, max_model_len: int, kernels: str = "torch",
                 quantization: str | None = None, linear_backend: str = "auto", device: str | torch.device = "cpu",
                 attention_backend: str = "auto", max_num_seqs: int = 64,
                 kv_cache_dtype: torch.dtype | None = None, kv_layout: KVCacheLayout | None = None) -> None:
        """`kernels`: "native" (pdserve/kernels: weights packed at load, fused layer ops, paged attention in place;
        `dtype` is then how float weights and the KV cache are stored, activations are float32) or "torch" (the
        PyTorch reference path, everything in `dtype`); the engine resolves "auto" before this. `device`: where
        weights, KV cache, step tensors and sampling live. `attention_backend` (torch kernels): sdpa | flex | auto
        (flex on cuda). `max_num_seqs`: the largest padded batch of decode graphs (enable_decode_graphs).
        `kv_cache_dtype`: how the KV cache stores K/V (None: `dtype`; int8 and fp8: model/kv_cache_dtype.py).
        `kv_layout`: the KV cache groups (model/kv_layout.py; None: one table of every layer)."""
        self.arch = arch
        self.kv_layout = kv_layout or KVCacheLayout.plain(arch.num_hidden_layers)
        self.dtype = dtype
        self.kv_dtype = kv_cache_dtype or dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        on_cpu = self.device.type == "cpu"
        native = kernels == "native"
        if not on_cpu and (native or quantization):
            raise ValueError("native kernels and --quantization are CPU-only; on cuda use --kernels torch and a "
                             "float checkpoint")
        selection = select_kernels(kernels, attention_backend, self.device, bf16_prompt_rows=dtype == torch.bfloat16)
        self.backend = selection.attention
        self.model = build_loaded_model(arch, selection, max_model_len, state_dict, dtype, self.device, quantization,
                                        linear_backend, self.kv_layout)
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()
        self.input_batch = InputBatch(max_num_seqs)
        self.drafter: Proposer | None = None  # speculative decoding (model/spec/drafter.py); set by the engine
        self.decode_graphs: DecodeGraphRunner | None = None
        self._graphs_capture: bool | None = None  # set by enable_decode_graphs
        self._max_num_seqs = max_num_seqs
        self.lora: LoRAManager | None = None  # LoRA adapters (enable_lora)
        self._populator: PagePopulator | None = None  # prefault_blocks
        self.allocate_kv_cache(num_blocks)

    def enable_lora(self, max_loras: int, max_lora_rank: int) -> LoRAManager:
        """Attach LoRA to every target Linear (model/lora.py): steps with adapter rows then add their deltas and
        run the per-layer path; base-only steps run as before."""
        dtype = torch.float32 if self.backend.name == "native" else self.dtype  # native activations are float32
        self.lora = LoRAManager(self.model.layers, max_loras, max_lora_rank, dtype, self.device)
        return self.lora

    def enable_decode_graphs(self, capture: bool | None = None) -> None:
        """Pure-decode steps go through a DecodeGraphRunner at padded batch sizes up to max_num_seqs: CUDA graphs
        (capture None: on cuda), or its eager twin (on cpu; the tests' path). Not with the native kernels."""
        if self.backend.name == "native":
            raise ValueError("decode graphs run the torch kernels; the native kernels are CPU code")
        if self.kv_layout.num_groups > 1:
            raise ValueError("decode graphs read one block table; this KV cache has groups (one table of every layer: "
                             "--disable-hybrid-kv-cache-manager)")
        self._graphs_capture = self.device.type == "cuda" if capture is None else capture
        self.decode_graphs = DecodeGraphRunner(
            self.model, self.kv_cache, self.backend, self.block_size, -(-self.max_model_len // self.block_size),
            self._max_num_seqs, scratch_block=self.num_blocks, capture=self._graphs_capture)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """(Re)allocate the KV cache with `num_blocks` blocks for the block manager, plus one scratch block past
        them (id num_blocks) that padded decode rows write to: never handed out, never read unmasked."""
        arch = self.arch
        shape = (self.kv_layout.layers_per_block, 2, num_blocks + 1, self.block_size, arch.num_key_value_heads,
                 kv_row_elements(self.kv_dtype, arch.head_dim))
        self.kv_cache = torch.empty(0)  # free the old cache first
        if self.device.type == "cpu":
            self.kv_cache = lazy_zeros(shape, self.kv_dtype)
        else:  # zeros as bytes: fp8 dtypes have no fill kernel everywhere
            self.kv_cache = torch.zeros(shape[:-1] + (shape[-1] * self.kv_dtype.itemsize,), dtype=torch.uint8,
                                        device=self.device).view(self.kv_dtype)
        self.num_blocks = num_blocks
        self.decode_graphs = None
        if self._graphs_capture is not None:
            self.enable_decode_graphs(self._graphs_capture)

    def prefault_blocks(self, b0: int, b1: int) -> bool:
        """Commit the KV pages of blocks [b0, b1) in every (layer, K|V) plane ahead of their first write
        (model/kv_prefault.py); False when the OS cannot (nothing on other devices)."""
        if self.device.type != "cpu" or b1 <= b0:
            return self.device.type == "cpu"
        if self._populator is None:
            self._populator = PagePopulator()
        cache = self.kv_cache
        planes = cache.shape[0] * cache.shape[1]
        block_bytes = cache[0, 0, 0].numel() * cache.element_size()
        plane_bytes = cache.shape[2] * block_bytes
        base = cache.data_ptr()
        return all(self._populator.populate(base + p * plane_bytes + b0 * block_bytes, (b1 - b0) * block_bytes)
                   for p in range(planes))

    @staticmethod
    def profile_num_blocks(num_tokens: int, num_seqs: int, block_size: int) -> int:
        """Blocks the profiling step (`profile_activation_bytes`) needs."""
        return -(-num_tokens // block_size) + min(num_seqs, num_tokens)

    @torch.inference_mode()
    def profile_activation_bytes(self, num_tokens: int, num_seqs: int) -> int:
        """Run the largest step the scheduler may send (num_tokens prompt tokens over min(num_seqs, num_tokens)
        sampled sequences, greedy) and return the peak device memory it allocated above what was allocated before
        (0 on cpu, where the cache is not sized this way). Needs profile_num_blocks(...) KV blocks; the KV it
        writes is garbage the caller reallocates."""
        k = max(1, min(num_seqs, num_tokens))
        sizes = [num_tokens // k + (i < num_tokens % k) for i in range(k)]
        reqs, next_block, bs = [], 0, self.block_size
        for i, n in enumerate(sizes):
            nblk = -(-n // bs)
            ids = list(range(next_block, next_block + nblk))
            reqs.append(ScheduledRequest(f"profile-{i}", [0] * n, 0, ids, True,
                                         group_block_ids=[ids] * (self.kv_layout.num_groups - 1)))
            next_block += nblk
        sched = SchedulerOutput(reqs, num_prefill_tokens=num_tokens)
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        assert len(self.greedy_step(sched)) == k
        if not on_cuda:
            return 0
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device) - base)

    @property
    def weight_bytes(self) -> int:
        return _stored_bytes(self.model)

    def step_cost_model(self) -> StepCostModel:
        """The live roofline's FLOP and byte counts, from the weights as stored (int8 weights count 1 byte, GGUF
        blocks their bytes per block)."""
        layer_params = layer_bytes = expert_params = expert_bytes = 0
        for layer in self.model.layers:
            p, b = _matrix_stats(layer)
            for moe in (m for m in layer.modules() if isinstance(m, SparseMoE)):  # experts apart: a token reads k
                ep, eb = _matrix_stats(moe.experts)
                p, b, expert_params, expert_bytes = p - ep, b - eb, expert_params + ep, expert_bytes + eb
            layer_params, layer_bytes = layer_params + p, layer_bytes + b
        head_params, head_bytes = _matrix_stats(self.model.lm_head)
        return StepCostModel.for_model(
            self.arch, layer_params=layer_params, layer_weight_bytes=layer_bytes, lm_head_params=head_params,
            lm_head_bytes=head_bytes, embed_row_bytes=self.model.embed_tokens.row_bytes,
            kv_dtype_bytes=self.kv_cache.shape[-1] * self.kv_cache.element_size() / self.arch.head_dim,
            expert_params=expert_params, expert_bytes=expert_bytes)

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        """The step's tensors, built on the CPU from plain lists and copied to the device once each."""
        groups = range(1, self.kv_layout.num_groups)
        if self.backend.varlen:  # KV cache groups 1..: their own slots and tables, every other tensor shared
            inp = self._prepare_varlen(sched)
            inp.meta.groups = [replace(inp.meta, slot_mapping=self._dev(slots), block_table=self._dev(table))
                               for slots, table in (self._varlen_tables(sched, g) for g in groups)]
        else:  # the reference path builds each group's step whole
            inp = self._prepare_sdpa(sched, 0)
            inp.meta.groups = [self._prepare_sdpa(sched, g).meta for g in groups]
        for meta in [inp.meta] + inp.meta.groups:
            self.backend.prepare(meta, inp.positions, self.kv_cache.shape[2], self.block_size)
        return inp

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    def _prepare_varlen(self, sched: SchedulerOutput) -> StepInputs:
        """One row per sequence (decodes first): the native kernel's block_table / query_start_loc / seq_lens."""
        slots, block_table = self._varlen_tables(sched, 0)
        d = self._dev
        ids: list[int] = []
        pos: list[int] = []
        qsl, seq_lens, prompt_lens = [0], [], []
        sample_rows: list[int] = []
        for i, r in enumerate(sched.scheduled_reqs):
            c, n = r.num_computed_tokens, r.num_scheduled_tokens
            ids.extend(r.token_ids)
            pos.extend(range(c, c + n))
            qsl.append(len(ids))
            seq_lens.append(c + n)
            prompt_lens.append(r.num_prompt_tokens)
            if i < sched.num_decodes or r.sample:  # a decode computes the newest token: always sampled
                sample_rows.extend(range(len(ids) - 1 - r.num_draft_tokens, len(ids)))
        meta = AttentionMetadata(slot_mapping=d(slots), num_decodes=sched.num_decodes, decode_block_tables=None,
                                 decode_mask=None, prefills=[], block_table=d(block_table),
                                 query_start_loc=d(torch.tensor(qsl, dtype=torch.int32)),
                                 seq_lens=d(torch.tensor(seq_lens, dtype=torch.int32)),
                                 prompt_lens=d(torch.tensor(prompt_lens, dtype=torch.int32)))
        return StepInputs(d(torch.tensor(ids, dtype=torch.long)), d(torch.tensor(pos, dtype=torch.long)), meta,
                          sample_rows)

    def _varlen_tables(self, sched: SchedulerOutput, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """KV cache group `group`'s slot_mapping (long [T]) and block_table (int32 [S, W], padded with block 0)."""
        bs = self.block_size
        slots: list[int] = []
        tables = [_table(r, group) for r in sched.scheduled_reqs]
        for r, b in zip(sched.scheduled_reqs, tables):
            c = r.num_computed_tokens
            slots.extend(b[p // bs] * bs + p % bs for p in range(c, c + r.num_scheduled_tokens))
        width = max(len(b) for b in tables)
        return (torch.tensor(slots, dtype=torch.long),
                torch.tensor([b + [0] * (width - len(b)) for b in tables], dtype=torch.int32))

    def _prepare_sdpa(self, sched: SchedulerOutput, group: int) -> StepInputs:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[torch.Tensor] = []
        sample_rows: list[int] = []
        decodes = sched.scheduled_reqs[:sched.num_decodes]
        prefills = sched.scheduled_reqs[sched.num_decodes:]

        decode_tables = decode_mask = None
        if decodes:
            width = max(len(d.block_ids) for d in decodes)
            decode_tables = torch.zeros(len(decodes), width, dtype=torch.long)
            for i, d in enumerate(decodes):
                decode_tables[i, :len(d.block_ids)] = torch.tensor(_table(d, group), dtype=torch.long)
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
            table = torch.tensor(_table(d, group), dtype=torch.long)
            p = torch.arange(c, c + n)
            slots.append(table[p // bs] * bs + p % bs)
            ids.extend(d.token_ids)
            pos.extend(range(c, c + n))
            chunks.append(PrefillChunk(start, n, c, self._dev(table[:-(-(c + n) // bs)])))  # also drafts
            sample_rows.extend(range(start + n - d.num_sample_rows, start + n))

        dev = self._dev
        meta = AttentionMetadata(slot_mapping=dev(torch.cat(slots)), num_decodes=len(decodes),
                                 decode_block_tables=None if decode_tables is None else dev(decode_tables),
                                 decode_mask=None if decode_mask is None else dev(decode_mask), prefills=chunks)
        return StepInputs(dev(torch.tensor(ids, dtype=torch.long)), dev(torch.tensor(pos, dtype=torch.long)), meta,
                          sample_rows)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: forward, sample (verify drafts), then propose drafts for the next step where asked. Row i
        of the result is the i-th sampled request of `sched`."""
        self._update_states(sched)
        sampled = [r for r in sched.scheduled_reqs if r.sample]
        drafts = [r.token_ids[len(r.token_ids) - r.num_draft_tokens:] for r in sampled]
        md = self.input_batch.sampling_metadata([r.req_id for r in sampled], drafts, sched.token_bitmask)
        hidden, logits = self._forward(sched)
        out = ModelRunnerOutput([], [])
        if logits is not None:
            res = (self.rejection_sampler if md.spec is not None else self.sampler)(logits, md)
            self._collect(sampled, res, out)
        if hidden is not None:
            out.prompt_logprobs = self._prompt_logprobs(hidden, sched)
            out.pooled = self._pooled(hidden, sched)
        if self.drafter is not None:
            out.draft_token_ids = self._propose(sched, out)
        return out

    def greedy_step(self, sched: SchedulerOutput) -> list[int]:
        """The argmax token of each sampled row (ScheduledRequest.sample), with no per-request state: the draft
        model's forwards and profiling."""
        with torch.inference_mode():
            _, logits = self._forward(sched)
            return [] if logits is None else argmax_rows(logits).tolist()

    def finish_requests(self, req_ids: list[str]) -> None:
        """These requests left the engine: drop their state (the drafter's too)."""
        for rid in req_ids:
            if rid in self.input_batch:
                if self.drafter is not None:
                    ib = self.input_batch
                    self.drafter.on_finished(rid, ib.all_token_ids(rid), ib.num_prompt_tokens(rid))
                self.input_batch.remove(rid)

    def _update_states(self, sched: SchedulerOutput) -> None:
        for new in sched.new_requests:
            self.input_batch.add(new)
        if self.drafter is not None:
            for rid in sched.preempted_req_ids:
                self.drafter.on_preempted(rid)

    def _forward(self, sched: SchedulerOutput) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The final hidden states (None from decode graphs, which end at the logits) and the sampled rows'
        float32 logits (None: no row samples)."""
        lora = self.lora if self.lora is not None and any(r.lora_id for r in sched.scheduled_reqs) else None
        if lora is None and self.decode_graphs is not None and self.decode_graphs.can_run(sched):
            return None, self.decode_graphs.run(sched)
        inp = self.prepare(sched)
        if lora is None:
            hidden = self.model(inp.input_ids, inp.positions, self.kv_cache, inp.meta)
        else:  # adapter rows: the per-layer path, whose target Linears add the adapters' deltas
            lora.mapping.set_rows([(r.lora_id, r.num_scheduled_tokens) for r in sched.scheduled_reqs], self.device)
            try:
                hidden = self.model.hidden_states(inp.input_ids, inp.positions, ForwardContext(self.kv_cache,
                                                                                                inp.meta))
            finally:
                lora.mapping.clear()
        # the sampled rows' logits are consumed by this step's sampler before any other compute_logits call
        logits = self.model.compute_logits(_rows(hidden, inp.sample_rows), reuse=True) if inp.sample_rows else None
        return hidden, logits

    def _collect(self, sampled: list[ScheduledRequest], res: SamplerOutput, out: ModelRunnerOutput) -> None:
        """Per sampled request: the tokens it emitted, in order, into the output and its kept state; the drafter
        learns how many of the drafts it proposed for the row were verified and accepted (none: not taken)."""
        out.errors = res.errors
        for i, r in enumerate(sampled):
            if res.errors and res.errors[i] is not None:
                out.sampled_token_ids.append([])
                out.logprobs.append([])
                continue
            toks = [res.token_ids[i], *(res.extra_token_ids[i] if res.extra_token_ids else ())]
            out.sampled_token_ids.append(toks)
            out.logprobs.append([res.logprobs[i], *(res.extra_logprobs[i] if res.extra_logprobs else ())])
            self.input_batch.append(r.req_id, toks)
            if self.drafter is not None:  # every sampled row: proposals the scheduler did not take are rolled back
                self.drafter.on_verified(r.req_id, r.num_draft_tokens, len(toks) - 1)

    def _propose(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> dict[str, list[int]]:
        """Drafts for the next step of the rows the scheduler marked (and whose sampling did not fail), from their
        tokens now, within the step's draft budget."""
        assert self.drafter is not None
        ib = self.input_batch
        reqs = [DraftRequest(r.req_id, ib.all_token_ids(r.req_id), ib.num_prompt_tokens(r.req_id), r.propose_drafts)
                for r, toks in zip((r for r in sched.scheduled_reqs if r.sample), out.sampled_token_ids)
                if r.propose_drafts and toks]
        return self.drafter.propose(reqs, sched.draft_budget) if reqs else {}

    @staticmethod
    def _pooled(hidden: torch.Tensor, sched: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Per pooling request, the float32 sum of its marked rows' final hidden states (post final norm)."""
        out: dict[str, torch.Tensor] = {}
        row = 0
        for r in sched.scheduled_reqs:
            if r.pool_offset is not None:
                out[r.req_id] = hidden[row + r.pool_offset:row + r.num_scheduled_tokens].float().sum(0).cpu()
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


def _rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """hidden[rows]: a view when the rows are consecutive (a decode step samples every row), else a gather, by
    numpy on the CPU. ATen's index op runs an OpenMP region whose threads then spin on the cores the native
    kernels' next call (the lm_head) needs: at c=32 that call took ~2x longer after it."""
    first = rows[0]
    if rows[-1] - first + 1 == len(rows) and rows == list(range(first, first + len(rows))):
        return hidden[first:first + len(rows)]
    if hidden.device.type == "cpu" and hidden.dtype == torch.float32:
        return torch.from_numpy(hidden.numpy()[rows])
    return hidden[rows]


def _matrix_stats(module: torch.nn.Module) -> tuple[int, int]:
    """(weights, bytes as stored) of the weight matrices under `module`; packed formats count their real size."""
    linears = [m for m in module.modules() if isinstance(m, Linear)]
    return sum(m.in_features * m.out_features for m in linears), sum(m.stored_bytes for m in linears)


def _stored_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight as stored, each storage once (a tied lm_head is the embedding)."""
    seen: dict[tuple[str, int], int] = {}
    for m in model.modules():
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
            seen["ptr", t.data_ptr()] = t.numel() * t.element_size()
        packed = m.packed if isinstance(m, (Linear, Embedding)) else None
        if isinstance(packed, OneDNNWeight):  # reads the plain weight above its row threshold: one copy
            seen["ptr", packed.weight.data_ptr()] = packed.nbytes
        elif packed is not None:
            seen["obj", id(packed)] = packed.nbytes
    return sum(seen.values())

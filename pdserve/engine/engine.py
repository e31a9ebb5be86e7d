"""LLMEngine: the engine in one process, in vLLM's shape: an input processor (prompts -> validated Requests), the
engine core (schedule -> run -> update: core.py) and an output processor (detokenizing, stop strings,
RequestOutputs). Single-threaded; the engine client (client.py) drives it from its own thread, the offline `LLM`
class directly.

Request state has one writer, the scheduler: it appends tokens, finishes requests and frees blocks; a stop string
the output processor finds is applied by the scheduler before the next step.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.config import EngineConfig, dtype_reason, parse_size
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.core import EngineCore
from pdserve.engine.input_processor import MAX_PRIORITY, InputLimits, InputProcessor, PromptType
from pdserve.engine.kv_offload import KVOffloadStore
from pdserve.engine.messages import EngineCoreOutput, LoRAStats, StepStats
from pdserve.engine.output_processor import OutputProcessor
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.spec_decode import SpecDecoder
from pdserve.engine.step_budget import StepBudget, token_budget
from pdserve.engine.structured import StructuredOutputManager
from pdserve.kernels import attention_path, kernels_description, kernels_isa, resolve_kernels
from pdserve.kv_transfer.base import KVTransfer
from pdserve.kv_transfer.factory import make_kv_transfer
from pdserve.lora_request import LoRARequest
from pdserve.model.device import device_memory, kv_cache_budget, resolve_device
from pdserve.model.kv_cache_dtype import kv_torch_dtype
from pdserve.model.kv_layout import KVCacheLayout
from pdserve.model.load_progress import ProgressFn
from pdserve.model.loader import LoadedModel, load_model
from pdserve.model.lora import PreparedAdapter
from pdserve.model.packed_weights import describe_weights
from pdserve.model.runner import ModelRunner
from pdserve.model.spec.drafter import DraftTarget, make_proposer
from pdserve.outputs import RequestOutput
from pdserve.roofline import DeviceSpec, RooflineMeter
from pdserve.sampling_params import SamplingParams

logger = logging.getLogger("pdserve.engine")

__all__ = ["LLMEngine", "MAX_PRIORITY", "PromptType", "StepResult", "StepStats"]


@dataclass
class StepResult:
    """What one call of `LLMEngine.step()` did: the outputs it produced and its stats."""

    outputs: list[RequestOutput]
    stats: StepStats


class LLMEngine:
    def __init__(self, config: EngineConfig, model: LoadedModel | None = None, tokenizer: Any = None, *,
                 device_peaks: DeviceSpec | None = None, load_progress: ProgressFn | None = None) -> None:
        """`device_peaks`: what the live roofline measures MFU/MBU against (None: no peaks). Callers resolve
        `config.device_peaks` (roofline.resolve_device_peaks), which may benchmark the machine.
        `load_progress(fraction, stage)`: the weights' load progress (model/load_progress.py)."""
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.device = resolve_device(config.device)
        self.kernels = resolve_kernels(config.kernels, config.torch_dtype, config.device)  # "native" | "torch"
        cuda_sized = self.device.type == "cuda" and config.num_kv_blocks is None  # KV from device memory
        free_total = device_memory(self.device) if cuda_sized else (0, 0)
        loaded = model if model is not None else load_model(config.model, dtype=config.torch_dtype,
                                                            keep_quantized=self.kernels == "native",
                                                            progress=load_progress)
        self.arch = loaded.arch
        if config.max_num_batched_tokens is None:  # the default budget follows the model's width
            a = self.arch
            config = self.config = dataclasses.replace(config, max_num_batched_tokens=token_budget(
                a.hidden_size, (a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim))
        assert config.max_num_batched_tokens is not None
        self.max_num_batched_tokens: int = config.max_num_batched_tokens
        self.tokenizer = tokenizer if tokenizer is not None else loaded.tokenizer()
        self.model_name = config.model or "smollm2-135m"
        self.max_model_len = min(config.max_model_len or self.arch.max_position_embeddings,
                                 self.arch.max_position_embeddings)
        self.block_size = config.block_size
        self.kv_layout = self._kv_layout(config)
        num_blocks = ModelRunner.profile_num_blocks(config.max_num_batched_tokens, config.max_num_seqs,
                                                    config.block_size) if cuda_sized else self._num_blocks(config)
        self.runner = ModelRunner(self.arch, loaded.state_dict, config.torch_dtype, num_blocks,
                                  config.block_size, self.max_model_len, self.kernels,
                                  config.quantization, config.linear_backend, self.device, config.attention_backend,
                                  max_num_seqs=config.max_num_seqs,
                                  kv_cache_dtype=kv_torch_dtype(config.kv_storage), kv_layout=self.kv_layout)
        if self.device.type == "cuda" and not config.enforce_eager:
            self.runner.enable_decode_graphs()
        # LoRA adapters registered with the runner, by id (add_lora)
        self.lora_requests: dict[int, LoRARequest] = {}
        self.lora = self.runner.enable_lora(config.max_loras, config.max_lora_rank) if config.enable_lora else None
        if cuda_sized:
            self._size_kv_cache_from_device(config, *free_total)
        self.num_blocks = self.runner.num_blocks
        self.block_manager = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching,
                                          self.kv_layout.windows)
        self._prefaulted, self._prefault_stopped = 0, False  # blocks [0, _prefaulted) committed (prefault_kv)
        # PD disaggregation (prefill/decode roles): KV hand-off over a connector
        self.kv_transfer: KVTransfer | None = None
        if config.kv_role != "both":
            self.kv_transfer = make_kv_transfer(config, self.block_manager, self.runner.kv_cache)
        self.kv_offload = self._make_kv_offload(config)  # the prefix cache's disk tier (--kv-offload-dir)
        self.step_budget = StepBudget(self.runner.step_cost_model(), config.max_step_ms)
        self.step_cost = self.step_budget.cost
        spec_config = config.speculative
        self.spec = None
        if spec_config is not None:  # the runner's drafter (a draft model loads here, with the target's vocabulary)
            target = DraftTarget(config, self.arch, self.tokenizer, self.kernels, self.num_blocks, self.max_model_len)
            self.runner.drafter = make_proposer(spec_config, target)
            self.spec = SpecDecoder(spec_config, predict=self.step_budget.predict)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, self.kv_transfer, config.kv_load_failure_policy,
                                   self.step_budget, config.scheduling_policy, config.priority_aging_s, self.spec,
                                   self.max_model_len, self.arch.vocab_size)
        self.eos_token_ids = self._eos_ids()
        self.structured = StructuredOutputManager(self.tokenizer, self.arch.vocab_size, self.eos_token_ids)
        limits = InputLimits(self.arch.vocab_size, self.max_model_len, self.num_blocks, self.block_size,
                             config.max_num_batched_tokens, config.enable_chunked_prefill,
                             config.scheduling_policy == "priority", self.kv_layout)
        self.input_processor = InputProcessor(self.tokenizer, limits, self.eos_token_ids, self.structured,
                                              self.kv_transfer.check_params if self.kv_transfer is not None else None)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.core = EngineCore(self.scheduler, self.runner, self.step_budget,
                               RooflineMeter(device_peaks, config.torch_dtype), self.kv_transfer, self.spec)
        self.scheduler.kv_offload = self.core.kv_offload = self.kv_offload
        self.roofline, self.step_log = self.core.roofline, self.core.step_log
        self._log_start(config)

    def _log_start(self, config: EngineConfig) -> None:
        logger.info("engine ready: %s, %s, %d KV blocks x %d tokens in %s (%.1f MiB), max_model_len %d, kernels %s",
                    self.model_name, config.torch_dtype, self.num_blocks, self.block_size, config.kv_storage,
                    self.runner.kv_cache.numel() * self.runner.kv_cache.element_size() / 2**20, self.max_model_len,
                    kernels_description(self.kernels))
        if self.kv_layout.frees_blocks:
            logger.info("KV cache groups: %s", self.kv_layout.describe())
        if self.kernels == "native":
            logger.info("native kernels (%s): weights %s; float weights (and KV cache, --kv-cache-dtype auto) in %s "
                        "(--dtype %s: %s)",
                        kernels_isa("native")[0], describe_weights(self.runner.model),
                        str(config.torch_dtype).removeprefix("torch."), config.dtype, dtype_reason(config.dtype))
            arch = self.arch
            prompt, generated = attention_path(config.kv_storage, arch.num_attention_heads // arch.num_key_value_heads,
                                               arch.head_dim, arch.attn_logit_softcapping > 0)
            logger.info("native attention: prompt rows %s; generated rows %s", prompt, generated)

    def _make_kv_offload(self, config: EngineConfig) -> KVOffloadStore | None:
        if config.kv_offload_dir is None or not config.enable_prefix_caching:
            return None
        # the K/V a file holds depend on the weights and how they are multiplied, not only on the layout
        weights = repr([self.model_name, self.arch, config.torch_dtype, self.kernels, config.quantization])
        return KVOffloadStore(config.kv_offload_dir, parse_size(config.kv_offload_max_size), weights,
                              self.runner.kv_cache, self.block_manager)

    def _num_blocks(self, config: EngineConfig) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        per_block = self._block_bytes(config)
        n = parse_size(config.kv_cache_memory) // per_block
        if n < 1:
            raise ValueError(f"kv_cache_memory={config.kv_cache_memory} holds no block of {per_block} bytes")
        return int(n)

    def _block_bytes(self, config: EngineConfig) -> int:
        """Bytes of one block of the pool: a block holds the K/V of the layout's layers_per_block layers."""
        per_layer = self.arch.kv_bytes_per_token(config.kv_storage) // self.arch.num_hidden_layers
        return config.block_size * per_layer * self.kv_layout.layers_per_block

    def _kv_layout(self, config: EngineConfig) -> KVCacheLayout:
        """KV cache groups (model/kv_layout.py): sliding-window layers in groups of their own that free the blocks
        out of their window, unless the hybrid layout is off or a part that moves whole blocks is on."""
        n = self.arch.num_hidden_layers
        windows = [self.arch.layer_window(i) for i in range(n)]
        if not any(windows) or config.disable_hybrid_kv_cache_manager:
            return KVCacheLayout.plain(n)
        spec = config.speculative
        blockers = [name for name, on in (
            ("PD disaggregation", config.kv_role != "both"), ("the disk tier", config.kv_offload_dir is not None),
            ("a draft model", spec is not None and spec.method == "draft_model"),
            ("CUDA graphs", self.device.type == "cuda" and not config.enforce_eager)) if on]
        if blockers:
            logger.info("sliding-window layers keep the whole context's K/V: %s moves whole blocks",
                        " and ".join(blockers))
            return KVCacheLayout.plain(n)
        return KVCacheLayout.plan(windows)

    def _size_kv_cache_from_device(self, config: EngineConfig, free: int, total: int) -> None:
        """vLLM's gpu_memory_utilization: profile the largest step, then give the KV cache what the budget leaves."""
        activations = self.runner.profile_activation_bytes(self.max_num_batched_tokens, config.max_num_seqs)
        plan = kv_cache_budget(total, free, self.runner.weight_bytes, activations, config.gpu_memory_utilization)
        per_block = self._block_bytes(config)
        self.runner.allocate_kv_cache(max(1, plan.num_blocks(per_block) - 1))  # one block is the scratch block
        logger.info("device memory plan: %s", plan)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        eos = self.arch.eos_token_id
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(eos)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ---- requests ------------------------------------------------------------------------------------------
    def make_request(self, prompt: PromptType, params: SamplingParams | None = None, request_id: str | None = None,
                     arrival_time: float | None = None, priority: int = 0) -> Request:
        """Tokenize and validate (InputProcessor.make_request); touches no engine state."""
        return self.input_processor.make_request(prompt, params, request_id, arrival_time, priority)

    def make_requests(self, prompts: list[PromptType], params: SamplingParams, parent_id: str,
                      arrival_time: float | None = None, cache_salt: str | None = None, priority: int = 0,
                      kv_transfer_params: dict[str, Any] | None = None,
                      lora_request: LoRARequest | None = None) -> list[Request]:
        """Fan one API request out into its sequences (InputProcessor.make_requests)."""
        return self.input_processor.make_requests(prompts, params, parent_id, arrival_time, cache_salt, priority,
                                                  kv_transfer_params, lora_request)

    def make_embedding_requests(self, prompts: list[PromptType], parent_id: str,
                                priority: int = 0) -> list[Request]:
        """One pooling request per prompt (InputProcessor.make_embedding_requests)."""
        return self.input_processor.make_embedding_requests(prompts, parent_id, priority)

    def add_request(self, prompt: PromptType | Request, params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> Request:
        """Queue one sequence (a prompt, or a Request from make_request; its LoRA adapter must be registered)."""
        req = prompt if isinstance(prompt, Request) else self.make_request(prompt, params, request_id, arrival_time)
        if req.lora_int_id and req.lora_int_id not in self.lora_requests:
            raise ValueError(f"request {req.request_id!r}: LoRA adapter id {req.lora_int_id} is not loaded")
        self.core.add_request(req)
        self.output_processor.add_request(req)
        return req

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) -----------------------------------------
    def prepare_lora(self, lora_request: LoRARequest) -> PreparedAdapter:
        """Read and check the adapter's files (model/lora.py; LoRAAdapterError). Touches no engine state."""
        if self.lora is None:
            raise ValueError("LoRA adapters need --enable-lora (or serve --lora-modules)")
        return self.lora.prepare(lora_request.lora_int_id, lora_request.lora_path)

    def add_lora(self, lora_request: LoRARequest, prepared: PreparedAdapter | None = None) -> None:
        """Register an adapter (read now unless `prepared`); requests with its id may be added from then on."""
        adapter = prepared if prepared is not None else self.prepare_lora(lora_request)
        assert self.lora is not None and adapter.lora_id == lora_request.lora_int_id
        self.lora.add(adapter)
        self.lora_requests[lora_request.lora_int_id] = lora_request

    def remove_lora(self, lora_id: int) -> bool:
        """Drop an adapter's weights; ValueError while an unfinished request runs with it."""
        if lora_id not in self.lora_requests:
            return False
        if any(r.lora_int_id == lora_id for r in self.scheduler.requests.values()):
            raise ValueError(f"LoRA adapter id {lora_id} is in use by unfinished requests")
        del self.lora_requests[lora_id]
        assert self.lora is not None
        return self.lora.remove(lora_id)

    def list_loras(self) -> list[LoRARequest]:
        return list(self.lora_requests.values())

    def lora_stats(self) -> LoRAStats:
        """The adapters of the running and of the waiting requests (vLLM's lora_requests_info)."""
        def names(reqs: Iterable[Request]) -> tuple[str, ...]:
            return tuple(sorted({self.lora_requests[r.lora_int_id].lora_name for r in reqs
                                 if r.lora_int_id in self.lora_requests}))
        return LoRAStats(names(self.scheduler.running), names(self.scheduler.waiting), self.config.max_loras)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Finish requests as aborted and free their blocks at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        return self._process(self.core.abort_requests(ids))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def prefault_kv(self, max_bytes: int = 4 << 20) -> bool:
        """Idle work (the serving loop calls it between waits): commit the KV pages of ~`max_bytes` more never-used
        blocks (a few ms: a request arriving meanwhile waits that long), up to four full steps' worth of blocks past
        the highest one handed out so far (those below it were written already); True while there is more to do.
        Off with `kv_cache_prefault=False` or where the OS cannot."""
        if not self.config.kv_cache_prefault or self._prefault_stopped:
            return False
        cache = self.runner.kv_cache
        max_blocks = max(1, max_bytes // (cache.numel() * cache.element_size() // cache.shape[2]))
        ahead = 4 * -(-self.max_num_batched_tokens // self.block_size)
        high = self.block_manager.high_water
        target = min(self.num_blocks, high + ahead)
        self._prefaulted = max(self._prefaulted, high)
        if self._prefaulted >= target:
            return False
        end = min(target, self._prefaulted + max_blocks)
        if not self.runner.prefault_blocks(self._prefaulted, end):
            self._prefault_stopped = True
            return False
        self._prefaulted = end
        return end < target

    def close(self) -> None:
        """Stop background parts (the KV connector's threads and sockets; the disk tier's writer, once the blocks
        queued for it are written)."""
        if self.kv_transfer is not None:
            self.kv_transfer.close()
        if self.kv_offload is not None:
            self.kv_offload.close()

    # ---- one iteration -------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        """One engine-core step, its outputs processed; returns the outputs and what the step did (its duration
        includes the output processing)."""
        t0 = time.perf_counter()
        core_out = self.core.step()
        outputs = self._process(core_out.outputs)
        core_out.stats.duration = time.perf_counter() - t0
        return StepResult(outputs, core_out.stats)

    def _process(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """Outputs for the core's news; stop strings and failures found in them go back to the scheduler."""
        processed = self.output_processor.process(core_outputs)
        if processed.stops or processed.failed:
            self.core.apply_output_processing([(s.request_id, s.num_output_tokens, s.stop) for s in processed.stops],
                                              processed.failed)
        return processed.outputs

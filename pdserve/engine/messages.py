"""Plain data between the engine's parts: what the engine core reports per request and per step.

The core (core.py: scheduler + model runner) emits one `EngineCoreOutput` per request that sampled, finished or
failed in a step; the output processor (output_processor.py) turns them into the API's RequestOutputs. Nothing here
refers to a live `Request`, so the core could run in another process and send these as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pdserve.engine.spec_decode.stats import SpecDecodeStats
from pdserve.errors import ErrorCode
from pdserve.model.inputs import StepKind
from pdserve.outputs import RequestTimes, TokenLogprobs


@dataclass
class StepStats:
    """What one step did, for metrics and the live roofline."""

    kind: StepKind
    num_prefill_tokens: int
    num_decode_tokens: int  # decode rows' tokens: one each, 1 + drafts for a speculating decode
    num_preempted: int
    duration: float  # seconds spent in the model step (schedule + run + postprocess)
    model_time: float = 0.0  # seconds in the forward pass and sampling alone
    flops: float = 0.0  # work the step needed, from the model shape (roofline.StepCostModel)
    bytes: float = 0.0
    mfu: float = 0.0  # flops / model_time / peak FLOP/s (0 when no peaks are known)
    mbu: float = 0.0  # bytes / model_time / memory bandwidth
    num_draft_tokens: int = 0  # speculative decoding: drafts verified this step
    num_accepted_tokens: int = 0  # of which accepted


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's news from one step: tokens appended (in order, each already past the stop-token and length
    checks) and, once it finished, why and what it leaves behind. Lists are not copied: they belong to the
    receiver."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None  # one per new token when the request asked for logprobs
    times: RequestTimes  # the request's phase timestamps (the same object every step)
    num_cached_tokens: int = 0
    finish_reason: str | None = None  # RequestStatus value once finished ("stop", "length", "abort", "error")
    stop_reason: int | str | None = None  # the stop token id that ended it
    error: str | None = None
    error_code: ErrorCode | None = None
    # per prompt token (first: None) when prompt logprobs were asked for; complete once the first token is sampled
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    pooled: torch.Tensor | None = None  # a finished pooling request: the mean of its final hidden states
    kv_transfer_result: dict[str, Any] | None = None  # PD: hand-off params (prefill side) or pull stats (decode)
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for this request so far
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineCoreOutputs:
    """What one `EngineCore.step()` did."""

    outputs: list[EngineCoreOutput]
    stats: StepStats


@dataclass
class SchedulerStats:
    """The scheduler's gauges and running totals after a step (or an idle tick), for metrics."""

    num_running: int
    num_waiting: int
    kv_usage: float  # used KV blocks / all
    prefix_cache_queries: int  # totals since start
    prefix_cache_hits: int
    num_preemptions: int
    spec: SpecDecodeStats | None = None  # speculative decoding's totals (None: off)
    # with --enable-lora: the adapter names of the running and of the waiting requests, and --max-loras
    lora: LoRAStats | None = None
    offload: KVOffloadStats | None = None  # the prefix cache's disk tier (None: off)
    kv_window_freed_blocks: int = 0  # total: blocks sliding-window KV groups freed (model/kv_layout.py)
    prefix_inflight_waits: int = 0  # total: requests held for a prefix another request was computing


@dataclass
class KVOffloadStats:
    """Totals since start (metrics: pdserve:kv_offload_*)."""

    blocks_saved: int = 0
    bytes_saved: int = 0
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    lookups: int = 0  # blocks looked up on disk (past the last block in memory)
    hits: int = 0  # of which found and read back
    rejected: int = 0  # files that failed a check (corrupt, foreign): deleted
    evicted: int = 0  # files removed by the size bound
    disk_bytes: int = 0  # bytes of files under this fingerprint now


@dataclass(frozen=True)
class LoRAStats:
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    max_loras: int

"""Plain data between the engine and the model layer, in vLLM's vocabulary: what a step computes
(SchedulerOutput, ScheduledRequest, NewRequestData) and what it produced (ModelRunnerOutput).

Nothing here refers to engine objects: `pdserve.model` imports nothing from `pdserve.engine`. Every step carries
each scheduled request's block_table and the token ids it computes; the runner keeps only what sampling and drafting
need across steps (model/input_batch.py), from a request's first step until it finishes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from pdserve.outputs import TokenLogprobs
from pdserve.sampling_params import SamplingParams


class StepKind(enum.StrEnum):
    """What a step computed: the step-time metric label."""

    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"  # decodes and prefill chunks in one step
    IDLE = "idle"


@dataclass
class ScheduledRequest:
    """One request's work in a step: compute `token_ids` at positions `num_computed_tokens` onwards."""

    req_id: str
    token_ids: list[int]  # the num_scheduled_tokens tokens this step computes
    num_computed_tokens: int  # tokens whose K/V are already cached: the position of token_ids[0]
    block_ids: list[int]  # the request's block_table; covers num_computed_tokens + len(token_ids) tokens
    sample: bool  # token_ids ends at the request's newest token: sample the next one from the last row
    # speculative decoding: the last num_draft_tokens of token_ids are drafts (proposed, not yet the request's);
    # with `sample`, the last 1 + num_draft_tokens rows are sampled (verification, model/spec/rejection_sampler.py)
    num_draft_tokens: int = 0
    # prompt logprobs: rows prompt_logprob_offset .. + len(prompt_logprob_targets) of this chunk score those
    # targets (the next prompt token of each row), with the top `prompt_logprobs`; None: no row is scored
    prompt_logprobs: int | None = None
    prompt_logprob_offset: int = 0
    prompt_logprob_targets: list[int] = field(default_factory=list)
    # pooling (embeddings): sum the final hidden states of rows pool_offset .. the chunk's end; None: not pooled
    pool_offset: int | None = None
    # speculative decoding: after this step, propose up to this many drafts for the request's next step (0: none)
    propose_drafts: int = 0
    # LoRA: the adapter id its rows run with (pdserve/lora_request.py); 0: the base model
    lora_id: int = 0
    # rows at positions below this are prompt rows (native attention and GGUF linears may run them on another
    # kernel: AMX tiles); 0: none. A row's kernel follows from its position only, so a generated token recomputed
    # after a preemption keeps its decode arithmetic.
    num_prompt_tokens: int = 0
    # the block tables of KV cache groups 1.. (model/kv_layout.py), as long as block_ids; empty with one group
    group_block_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_sample_rows(self) -> int:
        """Rows of this chunk whose logits the sampler takes: its last 1 + num_draft_tokens, or none."""
        return 1 + self.num_draft_tokens if self.sample else 0


@dataclass
class NewRequestData:
    """A request the runner has not seen: sent once, with its first scheduled step. The runner keeps what it needs
    (sampling options, tokens) until the request finishes (ModelRunner.finish_requests)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]  # masked below min_tokens (unless ignore_eos)
    constrained: bool = False  # structured output: its grammar alone decides when it may end (no min_tokens ban)
    output_token_ids: list[int] = field(default_factory=list)  # tokens it already has


@dataclass
class SchedulerOutput:
    """What one step computes. `scheduled_reqs` keeps decodes (one token each) first, then decodes that carry draft
    tokens (speculative decoding), then prefill chunks."""

    scheduled_reqs: list[ScheduledRequest] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decodes: int = 0  # decodes without drafts (one token each): the first entries of scheduled_reqs
    num_spec_decodes: int = 0  # decodes with drafts: the entries right after the plain decodes
    num_spec_tokens: int = 0  # their tokens (each 1 + its drafts)
    new_requests: list[NewRequestData] = field(default_factory=list)  # scheduled for the first time
    # structured output: the next-token bitmask (int32 [ceil(vocab / 32)]) of each constrained sampled request
    token_bitmask: dict[str, torch.Tensor] = field(default_factory=dict)
    # tokens a model drafter may compute after this step (its catch-up and draft positions): what the step's own
    # tokens left of the token budget
    draft_budget: int = 0

    @property
    def kind(self) -> StepKind:
        if not self.scheduled_reqs:
            return StepKind.IDLE
        if self.num_prefill_tokens and (self.num_decodes or self.num_spec_decodes):
            return StepKind.MIXED
        return StepKind.PREFILL if self.num_prefill_tokens else StepKind.DECODE


@dataclass
class ModelRunnerOutput:
    """What a step produced. Rows are the step's sampled requests (ScheduledRequest.sample), in order."""

    sampled_token_ids: list[list[int]]  # per row, in order: one token, or accepted drafts then one more; []: failed
    logprobs: list[list[TokenLogprobs | None]]  # per row, one per sampled token (None when not asked for)
    errors: list[str | None] = field(default_factory=list)  # per row, why its sampling failed; empty: none failed
    # request id -> the TokenLogprobs of the prompt tokens its rows scored this step (ScheduledRequest)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # request id -> float32 [hidden]: the sum of its pooled rows' final hidden states this step
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)
    # speculative decoding: request id -> drafts proposed for its next step (ScheduledRequest.propose_drafts)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)

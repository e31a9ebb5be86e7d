"""Plain data the engine hands the model layer each step, in vLLM's vocabulary (SchedulerOutput,
NewRequestData, SamplingMetadata).

Nothing here refers to engine objects: `pdserve.model` imports nothing from `pdserve.engine`. The runner keeps no
per-request state, so every step carries each scheduled request's block_table and the token ids it computes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields

import torch


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
    # with `sample`, the last 1 + num_draft_tokens rows are sampled (verification, model/spec_sampler.py)
    num_draft_tokens: int = 0
    # prompt logprobs: rows prompt_logprob_offset .. + len(prompt_logprob_targets) of this chunk score those
    # targets (the next prompt token of each row), with the top `prompt_logprobs`; None: no row is scored
    prompt_logprobs: int | None = None
    prompt_logprob_offset: int = 0
    prompt_logprob_targets: list[int] = field(default_factory=list)
    # pooling (embeddings): sum the final hidden states of rows pool_offset .. the chunk's end; None: not pooled
    pool_offset: int | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_sample_rows(self) -> int:
        """Rows of this chunk whose logits the sampler takes: its last 1 + num_draft_tokens, or none."""
        return 1 + self.num_draft_tokens if self.sample else 0


@dataclass
class SamplingMetadata:
    """Per sampled row (scheduled order), what the sampler needs. Lists alias the requests' own token lists and
    generators: a seeded request's `torch.Generator` lives with the request, so its draws do not depend on the
    batch."""

    temperature: list[float] = field(default_factory=list)
    greedy: list[bool] = field(default_factory=list)
    top_k: list[int] = field(default_factory=list)  # 0: off
    top_p: list[float] = field(default_factory=list)  # 1: off
    min_p: list[float] = field(default_factory=list)  # 0: off
    repetition_penalty: list[float] = field(default_factory=list)
    presence_penalty: list[float] = field(default_factory=list)
    frequency_penalty: list[float] = field(default_factory=list)
    generators: list[torch.Generator | None] = field(default_factory=list)  # None: the global RNG
    num_logprobs: list[int | None] = field(default_factory=list)  # None: no logprobs for the row
    banned_token_ids: list[list[int]] = field(default_factory=list)  # masked while below min_tokens
    prompt_token_ids: list[list[int]] = field(default_factory=list)  # for the repetition penalty
    output_token_ids: list[list[int]] = field(default_factory=list)  # for all penalties
    logit_bias: list[dict[int, float] | None] = field(default_factory=list)  # token id -> bias; None: none
    # structured output: int32 [ceil(vocab / 32)], bit t set when token t is allowed next; None: unconstrained.
    # Constrained rows' masks are views of one bitmask tensor the engine fills per step.
    token_bitmask: list[torch.Tensor | None] = field(default_factory=list)
    # speculative decoding: the row's draft tokens (empty: a plain row). A row with k drafts has 1 + k logits rows,
    # position j sampled as if drafts[:j] were already output (penalties, min_tokens), and the drafts are verified
    draft_token_ids: list[list[int]] = field(default_factory=list)
    # how many of a row's positions (1 + drafts) banned_token_ids applies to (min_tokens not yet reached)
    banned_positions: list[int] = field(default_factory=list)

    @classmethod
    def greedy_rows(cls, k: int) -> SamplingMetadata:
        """k greedy rows with every option off (profiling and tests)."""
        return cls(temperature=[0.0] * k, greedy=[True] * k, top_k=[0] * k, top_p=[1.0] * k, min_p=[0.0] * k,
                   repetition_penalty=[1.0] * k, presence_penalty=[0.0] * k, frequency_penalty=[0.0] * k,
                   generators=[None] * k, num_logprobs=[None] * k, banned_token_ids=[[] for _ in range(k)],
                   prompt_token_ids=[[] for _ in range(k)], output_token_ids=[[] for _ in range(k)],
                   logit_bias=[None] * k, token_bitmask=[None] * k, draft_token_ids=[[] for _ in range(k)],
                   banned_positions=[0] * k)

    @property
    def num_rows(self) -> int:
        return len(self.temperature)

    def row(self, i: int) -> SamplingMetadata:
        """Row i alone (aliasing the same lists and generator): the sampler's per-row fallback."""
        return SamplingMetadata(**{f.name: getattr(self, f.name)[i:i + 1] for f in fields(self)})

    @property
    def no_penalties(self) -> bool:
        return not any(r != 1 or p or f for r, p, f in zip(self.repetition_penalty, self.presence_penalty,
                                                            self.frequency_penalty))


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
    sampling_metadata: SamplingMetadata = field(default_factory=SamplingMetadata)  # rows: the `sample` requests

    @property
    def kind(self) -> StepKind:
        if not self.scheduled_reqs:
            return StepKind.IDLE
        if self.num_prefill_tokens and (self.num_decodes or self.num_spec_decodes):
            return StepKind.MIXED
        return StepKind.PREFILL if self.num_prefill_tokens else StepKind.DECODE

"""What the sampler applies to each logits row of a step (SamplingMetadata), gathered from the runner's persistent
per-request state (input_batch.py).

Dense options are numpy columns, one entry per logits row; options few requests use are sparse lists of (row,
value), so a batch pays only for what its requests ask. A speculating request has 1 + k logits rows (its newest
token and k drafts): row j is sampled as if drafts[:j] were already output (penalties count them, min_tokens counts
them), and `spec` says which rows belong to which request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

T = TypeVar("T")


def _sparse(items: list[tuple[int, T]], pos: dict[int, int]) -> list[tuple[int, T]]:
    """Sparse (row, value) entries of the kept rows, renumbered."""
    return [(pos[r], v) for r, v in items if r in pos]


@dataclass
class Penalties:
    """Repetition, presence and frequency penalties of every row (only built when a row of the step has one)."""

    repetition: np.ndarray  # float32 [rows]
    presence: np.ndarray  # float32 [rows]
    frequency: np.ndarray  # float32 [rows]
    prompt_token_ids: list[list[int]]  # per row: the repetition penalty's prompt tokens
    output_token_ids: list[list[int]]  # per row: output tokens (a draft row: with the drafts before it)

    def select(self, rows: np.ndarray) -> Penalties:
        return Penalties(self.repetition[rows], self.presence[rows], self.frequency[rows],
                         [self.prompt_token_ids[i] for i in rows], [self.output_token_ids[i] for i in rows])


@dataclass
class SpecRows:
    """Speculative decoding: per sampled request, its first logits row and its drafts (rows start .. start + k)."""

    starts: list[int]
    drafts: list[list[int]]


@dataclass
class SamplingMetadata:
    temperature: np.ndarray  # float32 [rows]
    greedy: np.ndarray  # bool [rows]: argmax (temperature 0 or top_k 1)
    top_k: np.ndarray  # int64 [rows]; 0: off
    top_p: np.ndarray  # float32 [rows]; 1: off
    min_p: np.ndarray  # float32 [rows]; 0: off
    num_logprobs: np.ndarray  # int64 [rows]; -1: no logprobs for the row
    # per row, a seeded request's own torch.Generator (None: the global RNG). Draws of a seeded request do not
    # depend on the batch
    generators: list[torch.Generator | None]
    logit_bias: list[tuple[int, dict[int, float]]] = field(default_factory=list)  # (row, token id -> bias)
    banned: list[tuple[int, list[int]]] = field(default_factory=list)  # (row, ids masked: below min_tokens)
    # structured output: (row, int32 [ceil(vocab / 32)], bit t set when token t is allowed next)
    token_bitmask: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    penalties: Penalties | None = None
    spec: SpecRows | None = None  # None: one logits row per request, no drafts
    all_greedy: bool = False  # every row takes the argmax (no draws)
    any_logprobs: bool = True  # some row wants logprobs

    @classmethod
    def greedy_rows(cls, k: int) -> SamplingMetadata:
        """k greedy rows with every option off (profiling, the draft model, tests)."""
        return cls(np.zeros(k, np.float32), np.ones(k, bool), np.zeros(k, np.int64), np.ones(k, np.float32),
                   np.zeros(k, np.float32), np.full(k, -1, np.int64), [None] * k, all_greedy=True,
                   any_logprobs=False)

    @property
    def num_rows(self) -> int:
        return len(self.temperature)

    def select(self, rows: np.ndarray | list[int]) -> SamplingMetadata:
        """These logits rows alone, renumbered 0.. (the sampler's per-row fallback). `spec` is dropped: the caller
        slices a request's rows and verifies them itself."""
        rows = np.asarray(rows, dtype=np.int64)
        pos = {int(r): i for i, r in enumerate(rows)}
        greedy, num_logprobs = self.greedy[rows], self.num_logprobs[rows]
        return SamplingMetadata(
            self.temperature[rows], greedy, self.top_k[rows], self.top_p[rows], self.min_p[rows], num_logprobs,
            [self.generators[i] for i in rows], _sparse(self.logit_bias, pos), _sparse(self.banned, pos),
            _sparse(self.token_bitmask, pos), None if self.penalties is None else self.penalties.select(rows),
            all_greedy=bool(greedy.all()), any_logprobs=bool((num_logprobs >= 0).any()))

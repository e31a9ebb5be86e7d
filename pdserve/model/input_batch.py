"""The runner's per-request state, kept across steps (vLLM's InputBatch idea).

A request gets a slot when it is first scheduled (SchedulerOutput.new_requests) and keeps it until it finishes
(ModelRunner.finish_requests): its sampling options are written once into per-slot rows of three small matrices
(floats, ints, flags), its tokens appended as the runner samples them. A step's SamplingMetadata gathers its rows'
slots with one numpy index per matrix, not rebuilt from per-request objects; counts of the requests that use an
uncommon option (a seed, a logit bias, penalties, min_tokens bans, logprobs) let a step skip what no request of the
batch asks for. The tokens also feed the drafters (model/spec), which propose from a request's prompt + output.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.model.inputs import NewRequestData
from pdserve.model.sampling_metadata import Penalties, SamplingMetadata, SpecRows

# columns of the three matrices
TEMPERATURE, TOP_P, MIN_P, REPETITION, PRESENCE, FREQUENCY = range(6)  # float32
TOP_K, NUM_LOGPROBS, MIN_TOKENS, NUM_OUTPUT = range(4)  # int64
GREEDY, PENALIZED, SEEDED, BIASED, BANS, LOGPROBS = range(6)  # bool
_COUNTED = (PENALIZED, SEEDED, BIASED, BANS, LOGPROBS)


class InputBatch:
    def __init__(self, capacity: int = 64) -> None:
        self.slots: dict[str, int] = {}
        self._free: list[int] = []
        self.f32 = np.zeros((0, 6), np.float32)
        self.i64 = np.zeros((0, 4), np.int64)
        self.flags = np.zeros((0, 6), np.bool_)
        self.num_flagged = [0] * 6  # live requests with each counted flag
        self.num_random = 0  # live requests that sample (not greedy)
        self.generators: list[torch.Generator | None] = []
        self.logit_bias: list[dict[int, float] | None] = []
        self.ban_ids: list[list[int]] = []  # masked while below min_tokens: stop token ids and EOS
        self.prompt_ids: list[list[int]] = []
        self.output_ids: list[list[int]] = []
        self.token_ids: list[list[int]] = []  # prompt + output
        self._grow(capacity)

    def __len__(self) -> int:
        return len(self.slots)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.slots

    def _grow(self, capacity: int) -> None:
        old = len(self.generators)
        for name in ("f32", "i64", "flags"):
            m = getattr(self, name)
            grown = np.zeros((capacity, m.shape[1]), m.dtype)
            grown[:old] = m
            setattr(self, name, grown)
        self.generators.extend([None] * (capacity - old))
        self.logit_bias.extend([None] * (capacity - old))
        for lists in (self.ban_ids, self.prompt_ids, self.output_ids, self.token_ids):
            lists.extend([] for _ in range(capacity - old))
        self._free.extend(range(capacity - 1, old - 1, -1))

    # ---- requests in and out -------------------------------------------------------------------------------
    def add(self, new: NewRequestData) -> None:
        if new.req_id in self.slots:
            self.remove(new.req_id)
        if not self._free:
            self._grow(2 * len(self.generators))
        s = self.slots[new.req_id] = self._free.pop()
        p = new.sampling_params
        self.f32[s] = (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
                       p.frequency_penalty)
        self.i64[s] = (p.top_k, -1 if p.logprobs is None else p.logprobs, p.min_tokens, len(new.output_token_ids))
        # no stop token (nor EOS) before min_tokens; a constrained row's grammar alone decides when it may end
        bans = [] if new.constrained or not p.min_tokens else \
            list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(new.eos_token_ids))
        penalized = p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0
        self.flags[s] = (p.greedy, penalized, p.seed is not None, bool(p.logit_bias), bool(bans),
                         p.logprobs is not None)
        self._count(s, 1)
        self.ban_ids[s] = bans
        self.generators[s] = None if p.seed is None else torch.Generator().manual_seed(p.seed)
        self.logit_bias[s] = p.logit_bias
        self.prompt_ids[s] = new.prompt_token_ids
        self.output_ids[s] = list(new.output_token_ids)
        self.token_ids[s] = [*new.prompt_token_ids, *new.output_token_ids]

    def remove(self, req_id: str) -> None:
        s = self.slots.pop(req_id, None)
        if s is None:
            return
        self._count(s, -1)
        self.generators[s] = self.logit_bias[s] = None
        self.ban_ids[s], self.prompt_ids[s], self.output_ids[s], self.token_ids[s] = [], [], [], []
        self._free.append(s)

    def _count(self, s: int, delta: int) -> None:
        for f in _COUNTED:
            if self.flags[s, f]:
                self.num_flagged[f] += delta
        if not self.flags[s, GREEDY]:
            self.num_random += delta

    def append(self, req_id: str, tokens: list[int]) -> None:
        """Tokens sampled for the request this step, in order."""
        s = self.slots[req_id]
        self.output_ids[s].extend(tokens)
        self.token_ids[s].extend(tokens)
        self.i64[s, NUM_OUTPUT] += len(tokens)

    def all_token_ids(self, req_id: str) -> list[int]:
        """The request's prompt + output (the list itself: read, do not modify)."""
        return self.token_ids[self.slots[req_id]]

    def num_prompt_tokens(self, req_id: str) -> int:
        return len(self.prompt_ids[self.slots[req_id]])

    # ---- a step's rows -------------------------------------------------------------------------------------
    def sampling_metadata(self, req_ids: list[str], drafts: list[list[int]] | None = None,
                          token_bitmask: dict[str, torch.Tensor] | None = None) -> SamplingMetadata:
        """The rows of these requests, in order: one each, or 1 + k for a request with k drafts (`drafts`, one
        list per request). `token_bitmask`: structured output's next-token masks by request (never drafting)."""
        slots = np.array([self.slots[r] for r in req_ids], np.int64)
        spec = drafts is not None and any(drafts)
        if spec:
            assert drafts is not None
            counts = np.fromiter((1 + len(d) for d in drafts), np.int64, len(drafts))
            rows = np.repeat(slots, counts)
            starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
            offsets = np.arange(len(rows)) - np.repeat(starts, counts)  # position j within its request's rows
        else:
            rows, starts, offsets = slots, None, None
        # ndarray.take: a few microseconds less per call than fancy indexing, which counts at batch 1
        f, i, g, n = self.f32.take(rows, 0), self.i64.take(rows, 0), self.flags.take(rows, 0), self.num_flagged
        md = SamplingMetadata(f[:, TEMPERATURE], g[:, GREEDY], i[:, TOP_K], f[:, TOP_P], f[:, MIN_P],
                              i[:, NUM_LOGPROBS], [self.generators[s] for s in rows] if n[SEEDED] else
                              [None] * len(rows))
        md.all_greedy = not self.num_random or bool(g[:, GREEDY].all())
        md.any_logprobs = bool(n[LOGPROBS]) and bool(g[:, LOGPROBS].any())
        if n[BIASED] and g[:, BIASED].any():
            md.logit_bias = [(int(k), b) for k in np.flatnonzero(g[:, BIASED]) if (b := self.logit_bias[rows[k]])]
        if n[BANS]:
            below = i[:, NUM_OUTPUT] + (0 if offsets is None else offsets) < i[:, MIN_TOKENS]
            md.banned = [(int(k), self.ban_ids[rows[k]]) for k in np.flatnonzero(g[:, BANS] & below)]
        if token_bitmask:
            md.token_bitmask = [(k if starts is None else int(starts[k]), token_bitmask[r])
                                for k, r in enumerate(req_ids) if r in token_bitmask]
        if n[PENALIZED] and g[:, PENALIZED].any():
            md.penalties = self._penalties(rows, f, drafts if spec else None, starts)
        if spec:
            assert drafts is not None and starts is not None
            md.spec = SpecRows([int(x) for x in starts], drafts)
        return md

    def _penalties(self, rows: np.ndarray, f: np.ndarray, drafts: list[list[int]] | None,
                   starts: np.ndarray | None) -> Penalties:
        outputs = [self.output_ids[s] for s in rows]
        if drafts is not None and starts is not None:  # a draft row's penalties count the drafts before it
            for k, d in enumerate(drafts):
                for j in range(1, len(d) + 1):
                    outputs[starts[k] + j] = outputs[starts[k] + j] + d[:j]
        return Penalties(f[:, REPETITION], f[:, PRESENCE], f[:, FREQUENCY], [self.prompt_ids[s] for s in rows],
                         outputs)

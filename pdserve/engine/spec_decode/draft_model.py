"""Draft-model proposer: a second, smaller model with the target's vocabulary drafts k tokens per speculating decode.

The draft runs through the model layer's own runner (ModelRunner: plain SchedulerOutputs, its own weights) with its
own paged KV cache, whose blocks are booked by a BlockManager of its own (no prefix caching): per request, a
`DraftSeq` whose `num_computed_tokens` counts the request's tokens (prompt + output) whose K/V the draft holds.

One `fill` over the step's speculating decodes runs one batched draft forward per draft position:
- position 0 computes every token the draft has not seen, up to the newest (after a verification, the tokens the
  target emitted that the draft had not computed), and takes the argmax after the newest token: draft 1;
- position j > 0 computes draft j at its position and takes the argmax: draft j + 1.
With L tokens before the step and k drafts, the draft then holds K/V of L + k - 1 tokens (draft k is never fed).

The draft's work is charged to the step's token budget (`num_behind` + k tokens). A request far behind (its
prompt, on its first speculating step) catches up in chunks of what the budget leaves (`catch_up`: rows computed
without sampling in the position-0 forward) and drafts from the step after it is caught up, so a long prompt
never makes one step long.

Verification keeps a of the k drafts: the draft's K/V stay valid for L + min(a, k - 1) tokens (the accepted drafts
are the tokens the target appended); the rest is rolled back and blocks past it are freed. Preempted, finished or
aborted requests free all their draft blocks, so the draft pool returns to baseline with the target's.

Drafts are greedy (argmax), a deterministic function of the context: the verifier (model/spec_sampler.py) treats
a draft as a proposal of probability 1, which is then exact rejection sampling for temperature > 0 as well.
When the draft pool cannot hold a request's drafts, or the draft forward fails, that request's slots are filled
with its newest token repeated: verification rejects what is wrong, so the output never changes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from pdserve.config import EngineConfig, ModelArchConfig, SpeculativeConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request
from pdserve.engine.spec_decode.proposer import RESERVED, Proposer
from pdserve.model.inputs import SamplingMetadata, ScheduledRequest, SchedulerOutput
from pdserve.model.loader import LoadedModel, load_model
from pdserve.model.runner import ModelRunner

logger = logging.getLogger(__name__)

SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


@dataclass
class DraftTarget:
    """What a draft model shares with the engine's target model: options, vocabulary, KV block geometry."""

    config: EngineConfig
    arch: ModelArchConfig
    tokenizer: Any
    kernels: str  # resolved: "native" | "torch"
    num_blocks: int
    max_model_len: int


@dataclass
class DraftSeq:
    """The draft model's view of one request (a KVSequence for the draft's BlockManager)."""

    request_id: str
    num_computed_tokens: int = 0  # the request's leading tokens whose K/V the draft holds
    num_tokens_at_fill: int = 0  # the request's length when it was last drafted for
    num_drafted: int = 0  # drafts proposed at that fill, not yet verified (0: none pending)


def check_same_vocabulary(draft: LoadedModel, draft_tokenizer: Any, target: DraftTarget) -> None:
    """A draft must speak the target's token ids: equal vocab sizes, token -> id maps and special ids."""
    name = draft.source
    if draft.arch.vocab_size != target.arch.vocab_size:
        raise ValueError(f"speculative_config: draft model {name} has vocab size {draft.arch.vocab_size}, the "
                         f"target {target.arch.vocab_size}; a draft model must share the target's vocabulary")
    for attr in SPECIAL_IDS:
        a, b = getattr(draft_tokenizer, attr, None), getattr(target.tokenizer, attr, None)
        if a != b:
            raise ValueError(f"speculative_config: draft model {name} has {attr} {a}, the target {b}; a draft "
                             f"model must share the target's tokenizer")
    get_a, get_b = getattr(draft_tokenizer, "get_vocab", None), getattr(target.tokenizer, "get_vocab", None)
    if get_a is not None and get_b is not None and get_a() != get_b():
        raise ValueError(f"speculative_config: draft model {name} maps tokens to other ids than the target; a "
                         f"draft model must share the target's tokenizer")


class DraftModelProposer(Proposer):
    method = "draft_model"
    batched = True

    def __init__(self, runner: ModelRunner, num_blocks: int, block_size: int) -> None:
        self.runner = runner
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.seqs: dict[str, DraftSeq] = {}
        self.pending_catch_up: list[tuple[Request, int]] = []  # booked by catch_up() for the next fill()
        self.num_fallbacks = 0  # requests whose slots were filled without the draft model (pool full, failure)

    @classmethod
    def load(cls, spec: SpeculativeConfig, target: DraftTarget) -> DraftModelProposer:
        """Load the draft through the normal model loader; as many KV blocks as the target (a draft never needs
        more than its request holds in the target's pool, prefix sharing aside), paged in lazily."""
        t0 = time.perf_counter()
        cfg = target.config
        loaded = load_model(spec.model, dtype=cfg.torch_dtype, keep_quantized=target.kernels == "native")
        check_same_vocabulary(loaded, loaded.tokenizer(), target)
        positions = loaded.arch.max_position_embeddings
        if positions < target.max_model_len:
            raise ValueError(f"speculative_config: draft model {loaded.source} takes {positions} positions, fewer "
                             f"than max_model_len {target.max_model_len}")
        runner = ModelRunner(loaded.arch, loaded.state_dict, cfg.torch_dtype, target.num_blocks, cfg.block_size,
                             target.max_model_len, target.kernels, spec.quantization, cfg.linear_backend)
        proposer = cls(runner, target.num_blocks, cfg.block_size)
        kv = runner.kv_cache
        logger.info("draft model ready: %s%s, %.1f MiB weights, %d KV blocks x %d tokens (%.1f MiB, paged in as "
                    "used), loaded in %.1f s", loaded.source, f" ({spec.quantization})" if spec.quantization else "",
                    runner.weight_bytes / 2**20, target.num_blocks, cfg.block_size,
                    kv.numel() * kv.element_size() / 2**20, time.perf_counter() - t0)
        return proposer

    # ---- Proposer ----------------------------------------------------------------------------------------------
    def propose(self, req: Request, k: int) -> list[int]:
        return [RESERVED] * k

    def num_behind(self, req: Request) -> int:
        """Tokens before the newest that the draft has not computed (the prompt, for a request new to it)."""
        seq = self.seqs.get(req.request_id)
        return req.num_tokens - 1 - (seq.num_computed_tokens if seq is not None else 0)

    def catch_up(self, req: Request, max_tokens: int) -> int:
        """Book up to max_tokens of the request's unseen context for this step's fill (no drafts for it this
        step); returns the tokens booked (0: the draft pool has no room)."""
        seq = self.seqs.setdefault(req.request_id, DraftSeq(req.request_id))
        n = min(max_tokens, self.num_behind(req))
        if n <= 0 or not self.block_manager.allocate_slots(seq, n):
            return 0
        self.pending_catch_up.append((req, n))
        return n

    def fill(self, reqs: list[Request]) -> None:
        catch_up, self.pending_catch_up = self.pending_catch_up, []
        active: list[tuple[Request, DraftSeq]] = []
        for req in reqs:
            seq = self.seqs.setdefault(req.request_id, DraftSeq(req.request_id))
            k, length = len(req.spec_token_ids), req.num_tokens
            # cover the request's tokens and drafts 1..k-1: length + k - 1 slots
            if self.block_manager.allocate_slots(seq, length + k - 1 - seq.num_computed_tokens):
                seq.num_tokens_at_fill, seq.num_drafted = length, k
                active.append((req, seq))
            else:
                self._fall_back(req)
        try:
            self._draft(active, catch_up)
        except Exception:  # the draft is only a guess: a failure costs its speedup, never the target's output
            logger.exception("draft model forward failed; %d requests decode with filler drafts", len(active))
            for req, _ in active:
                self._reset(req.request_id)
                self._fall_back(req)
            for req, _ in catch_up:
                self._reset(req.request_id)

    def on_verified(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        seq = self.seqs.get(req.request_id)
        if seq is None or not seq.num_drafted:
            return
        # the accepted drafts are what the target appended; the draft never fed its last one
        seq.num_computed_tokens = seq.num_tokens_at_fill + min(num_accepted, seq.num_drafted - 1)
        seq.num_drafted = 0
        self.block_manager.trim(seq)

    def on_preempted(self, req: Request) -> None:
        self._reset(req.request_id)

    def on_finished(self, req: Request) -> None:
        self._reset(req.request_id)

    # ---- internals ---------------------------------------------------------------------------------------------
    def _draft(self, active: list[tuple[Request, DraftSeq]], catch_up: list[tuple[Request, int]]) -> None:
        """One forward per draft position over the rows that still need a draft at that position; the catch-up
        chunks ride in the first one, unsampled."""
        for j in range(max(max((seq.num_drafted for _, seq in active), default=0), 1 if catch_up else 0)):
            rows: list[tuple[Request, DraftSeq, ScheduledRequest]] = []
            for req, seq in active:
                if seq.num_drafted > j:
                    c = seq.num_computed_tokens
                    tokens = req.all_token_ids[c:] if j == 0 else [req.spec_token_ids[j - 1]]
                    rows.append((req, seq, ScheduledRequest(req.request_id, tokens, c,
                                                            self.block_manager.get_block_ids(req.request_id), True)))
            for req, n in catch_up if j == 0 else ():
                seq = self.seqs[req.request_id]
                c = seq.num_computed_tokens
                rows.append((req, seq, ScheduledRequest(req.request_id, req.all_token_ids[c:c + n], c,
                                                        self.block_manager.get_block_ids(req.request_id), False)))
            rows.sort(key=lambda row: row[2].num_scheduled_tokens > 1 or not row[2].sample)  # decodes first
            batch = [b for _, _, b in rows]
            num_sampled = sum(b.sample for b in batch)
            sched = SchedulerOutput(scheduled_reqs=batch,
                                    num_decodes=sum(b.sample and b.num_scheduled_tokens == 1 for b in batch),
                                    sampling_metadata=SamplingMetadata.greedy_rows(num_sampled))
            sched.num_prefill_tokens = sum(b.num_scheduled_tokens for b in batch) - sched.num_decodes
            tokens_out = iter(self.runner.execute(sched).token_ids)
            for req, seq, b in rows:
                seq.num_computed_tokens += b.num_scheduled_tokens
                if b.sample:
                    req.spec_token_ids[j] = next(tokens_out)

    def _fall_back(self, req: Request) -> None:
        """Fill the request's slots without the draft (its newest token repeated): verified like any draft."""
        self.num_fallbacks += 1
        req.spec_token_ids[:] = [req.all_token_ids[-1]] * len(req.spec_token_ids)

    def _reset(self, request_id: str) -> None:
        self.block_manager.free(request_id)
        self.seqs.pop(request_id, None)


__all__ = ["DraftModelProposer", "DraftSeq", "DraftTarget", "check_same_vocabulary"]

"""Draft-model proposer: a second, smaller model with the target's vocabulary drafts k tokens per request.

The draft runs through a ModelRunner of its own (its weights, its paged KV cache) whose blocks are booked by a
small pool (DraftKVPool: no sharing, no prefix cache): per request, a `DraftSeq` whose `num_computed` counts the
request's tokens (prompt + output) whose K/V the draft holds.

After each target step, one `propose` over the requests to draft for runs one batched draft forward per draft
position:
- position 0 computes every token the draft has not seen, up to the newest (after a verification, the tokens the
  target emitted that the draft had not computed), and takes the argmax after the newest token: draft 1;
- position j > 0 computes draft j at its position and takes the argmax: draft j + 1.
With L tokens and k drafts, the draft then holds K/V of L + k - 1 tokens (draft k is never fed).

The draft's work is charged to the step's token budget (the scheduler's draft_budget: what the target's tokens
left): context it has not seen plus k. A request far behind (its prompt, when it first decodes) catches up in
chunks of what the budget leaves (rows computed without sampling in the position-0 forward) and drafts from the
step after it is caught up, so a long prompt never makes one step long.

Verification keeps a of the k drafts: the draft's K/V stay valid for L + min(a, k - 1) tokens (the accepted drafts
are the tokens the target appended); the rest is rolled back and blocks past it are freed. Preempted, finished or
aborted requests free all their draft blocks, so the draft pool returns to baseline with the target's.

Drafts are greedy (argmax), a deterministic function of the context: the verifier (rejection_sampler.py) treats a
draft as a proposal of probability 1, which is then exact rejection sampling for temperature > 0 as well. When the
draft pool cannot hold a request's drafts, or the draft forward fails, that request gets its newest token repeated
as drafts: verification rejects what is wrong, so the output never changes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from pdserve.config import EngineConfig, ModelArchConfig, SpeculativeConfig
from pdserve.model.inputs import ScheduledRequest, SchedulerOutput
from pdserve.model.loader import LoadedModel, load_model
from pdserve.model.runner import ModelRunner
from pdserve.model.spec.proposer import DraftRequest, Proposer

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
    """The draft model's view of one request."""

    request_id: str
    num_computed: int = 0  # the request's leading tokens whose K/V the draft holds
    num_tokens_at_fill: int = 0  # the request's length when it was last drafted for
    num_drafted: int = 0  # drafts proposed then, not yet verified (0: none pending)


class DraftKVPool:
    """The draft's KV blocks: a free list and, per request, a block table covering the tokens the draft computed.
    Invariant: used + free == num_blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_ids = list(range(num_blocks - 1, -1, -1))  # popped from the end: lowest ids first
        self.tables: dict[str, list[int]] = {}

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return list(self.tables.get(request_id, ()))

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Make the request's table cover num_tokens tokens; all or nothing."""
        table = self.tables.get(request_id, [])
        need = self.blocks_needed(num_tokens) - len(table)
        if need > len(self.free_ids):
            return False
        self.tables[request_id] = table + [self.free_ids.pop() for _ in range(max(need, 0))]
        return True

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Free the blocks past those holding num_tokens tokens."""
        table = self.tables.get(request_id, [])
        while len(table) > self.blocks_needed(num_tokens):
            self.free_ids.append(table.pop())

    def free(self, request_id: str) -> None:
        self.free_ids.extend(reversed(self.tables.pop(request_id, [])))

    def is_at_baseline(self) -> bool:
        return not self.tables and len(self.free_ids) == self.num_blocks

    def check_integrity(self) -> None:
        held = [b for t in self.tables.values() for b in t]
        assert len(set(held)) == len(held) and not set(held) & set(self.free_ids), "a draft block held twice"
        assert len(held) + len(self.free_ids) == self.num_blocks


def check_same_vocabulary(draft: LoadedModel, draft_tokenizer: Any, target: DraftTarget) -> None:
    """A draft must speak the target's token ids: equal vocab sizes, token -> id maps and special ids (both are
    Hugging Face tokenizers, which have all of these)."""
    name = draft.source
    if draft.arch.vocab_size != target.arch.vocab_size:
        raise ValueError(f"speculative_config: draft model {name} has vocab size {draft.arch.vocab_size}, the "
                         f"target {target.arch.vocab_size}; a draft model must share the target's vocabulary")
    for attr in SPECIAL_IDS:
        a, b = getattr(draft_tokenizer, attr), getattr(target.tokenizer, attr)
        if a != b:
            raise ValueError(f"speculative_config: draft model {name} has {attr} {a}, the target {b}; a draft "
                             f"model must share the target's tokenizer")
    if draft_tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError(f"speculative_config: draft model {name} maps tokens to other ids than the target; a "
                         f"draft model must share the target's tokenizer")


class DraftModelProposer(Proposer):
    method = "draft_model"

    def __init__(self, runner: ModelRunner, num_blocks: int, block_size: int) -> None:
        self.runner = runner
        self.pool = DraftKVPool(num_blocks, block_size)
        self.seqs: dict[str, DraftSeq] = {}
        self.num_fallbacks = 0  # requests drafted for without the draft model (pool full, failure)

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
    def propose(self, reqs: list[DraftRequest], budget: int) -> dict[str, list[int]]:
        """In order, each request catches up and drafts k if the budget takes both; else it catches up on what the
        budget leaves (no drafts this step). Then one draft forward per position over all of them."""
        active: list[tuple[DraftRequest, DraftSeq]] = []
        catch_up: list[tuple[DraftRequest, int]] = []
        out: dict[str, list[int]] = {}
        for r in reqs:
            if budget <= 0:
                break
            seq = self.seqs.setdefault(r.req_id, DraftSeq(r.req_id))
            behind = len(r.token_ids) - 1 - seq.num_computed  # context before the newest token
            k = min(r.k, budget - behind)
            if k <= 0:  # too far behind for drafts this step: catch up on what the budget leaves
                n = min(budget, behind)
                if n > 0 and self.pool.allocate(r.req_id, seq.num_computed + n):
                    catch_up.append((r, n))
                    budget -= n
                continue
            budget -= behind + k
            # cover the request's tokens and drafts 1..k-1: L + k - 1 slots
            if self.pool.allocate(r.req_id, len(r.token_ids) + k - 1):
                seq.num_tokens_at_fill, seq.num_drafted = len(r.token_ids), k
                active.append((r, seq))
            else:
                out[r.req_id] = self._fall_back(r, k)
        try:
            out.update(self._draft(active, catch_up))
        except Exception:  # the draft is only a guess: a failure costs its speedup, never the target's output
            logger.exception("draft model forward failed; %d requests decode with filler drafts", len(active))
            for r, seq in active:
                self._reset(r.req_id)
                out[r.req_id] = self._fall_back(r, seq.num_drafted)
            for r, _ in catch_up:
                self._reset(r.req_id)
        return out

    def on_verified(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        seq = self.seqs.get(req_id)
        if seq is None or not seq.num_drafted:
            return
        # the accepted drafts are what the target appended; the draft never fed its last one
        seq.num_computed = seq.num_tokens_at_fill + min(num_accepted, seq.num_drafted - 1)
        seq.num_drafted = 0
        self.pool.trim(req_id, seq.num_computed)

    def on_preempted(self, req_id: str) -> None:
        self._reset(req_id)

    def on_finished(self, req_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        self._reset(req_id)

    # ---- internals ---------------------------------------------------------------------------------------------
    def _draft(self, active: list[tuple[DraftRequest, DraftSeq]],
               catch_up: list[tuple[DraftRequest, int]]) -> dict[str, list[int]]:
        """One forward per draft position over the rows that still need a draft at that position; the catch-up
        chunks ride in the first one, unsampled."""
        drafts: dict[str, list[int]] = {r.req_id: [] for r, _ in active}
        for j in range(max(max((seq.num_drafted for _, seq in active), default=0), 1 if catch_up else 0)):
            rows: list[tuple[DraftSeq, ScheduledRequest]] = []
            for r, seq in active:
                if seq.num_drafted > j:
                    c = seq.num_computed
                    tokens = r.token_ids[c:] if j == 0 else [drafts[r.req_id][j - 1]]
                    rows.append((seq, ScheduledRequest(r.req_id, tokens, c, self.pool.get_block_ids(r.req_id),
                                                       True, num_prompt_tokens=r.num_prompt_tokens)))
            for r, n in catch_up if j == 0 else ():
                seq = self.seqs[r.req_id]
                c = seq.num_computed
                rows.append((seq, ScheduledRequest(r.req_id, r.token_ids[c:c + n], c,
                                                   self.pool.get_block_ids(r.req_id), False,
                                                   num_prompt_tokens=r.num_prompt_tokens)))
            rows.sort(key=lambda row: row[1].num_scheduled_tokens > 1 or not row[1].sample)  # decodes first
            batch = [b for _, b in rows]
            num_decodes = sum(b.sample and b.num_scheduled_tokens == 1 for b in batch)
            sched = SchedulerOutput(scheduled_reqs=batch, num_decodes=num_decodes,
                                    num_prefill_tokens=sum(b.num_scheduled_tokens for b in batch) - num_decodes)
            tokens_out = iter(self.runner.greedy_step(sched))
            for seq, b in rows:
                seq.num_computed += b.num_scheduled_tokens
                if b.sample:
                    drafts[b.req_id].append(next(tokens_out))
        return drafts

    def _fall_back(self, r: DraftRequest, k: int) -> list[int]:
        """Drafts without the draft model (its newest token repeated): verified like any draft."""
        self.num_fallbacks += 1
        return [r.token_ids[-1]] * k

    def _reset(self, request_id: str) -> None:
        self.pool.free(request_id)
        self.seqs.pop(request_id, None)


__all__ = ["DraftKVPool", "DraftModelProposer", "DraftSeq", "DraftTarget", "check_same_vocabulary"]

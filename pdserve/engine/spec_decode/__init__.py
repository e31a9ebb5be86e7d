"""Speculative decoding, engine side: which decodes speculate, their drafts, and the acceptance counters.

A speculating decode row carries its newest token plus k drafted tokens; the model layer verifies the drafts in the
same forward pass (pdserve/model/spec_sampler.py) and returns the accepted drafts followed by one more token (the
correction at the first rejected position, or a bonus token after the last draft). The engine then appends those
tokens in order, as if decoded one by one (stop strings, stop tokens and max_tokens apply to each in turn), counts
only the accepted drafts as computed, and frees the blocks that only rejected drafts used.

Which requests speculate: every decode except those with structured output (their grammar matcher cannot be rolled
back). Logprobs, penalties, min_tokens, logit_bias, seeds and n > 1 are supported (each position is sampled with
the same transforms as a plain decode). A seeded request draws from its own generator; its output is reproducible
for the same drafts, i.e. the same speculative config, batch-size switch and token budget.
"""

from __future__ import annotations

from pdserve.config import SpeculativeConfig
from pdserve.engine.request import Request
from pdserve.engine.spec_decode.draft_model import DraftModelProposer, DraftTarget
from pdserve.engine.spec_decode.guard import SpecGuard
from pdserve.engine.spec_decode.ngram import NgramProposer
from pdserve.engine.spec_decode.policy import Predict, SpecPolicy
from pdserve.engine.spec_decode.proposer import RESERVED, Proposer
from pdserve.engine.spec_decode.stats import SpecDecodeStats
from pdserve.engine.spec_decode.suffix import SuffixProposer


def make_proposer(config: SpeculativeConfig, target: DraftTarget | None = None) -> Proposer:
    """The proposer of `config.method` (config.py's SPEC_METHODS lists the methods that exist); `target`: what a
    draft model must match (the engine's model), for draft_model."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
    if config.method == "draft_model":
        if target is None:
            raise ValueError("speculative_config: draft_model needs the engine's target model to load against")
        return DraftModelProposer.load(config, target)
    raise ValueError(f"speculative_config: method {config.method!r} has no proposer")


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None,
                 predict: Predict | None = None) -> None:
        """`predict`: the step time model (StepBudget.predict) that the `auto` policy weighs drafts with."""
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = proposer if proposer is not None else make_proposer(config)
        self.policy = SpecPolicy(self.k, config.policy == "auto", predict)
        self.guard = SpecGuard() if self.policy.auto else None  # "always" drafts whatever it measures
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k, disabled_steps=self.policy.disabled_steps)

    def enabled_for_step(self, num_decoding: int) -> bool:
        """The batch-size switch: no drafts in a step with more decoding requests than disable_by_batch_size."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_decoding <= limit

    def begin_step(self, decodes: list[Request], num_prefilling: int = 0) -> bool:
        """Plan this step's drafts (policy.py) for its decoding requests; False: none this step.
        num_prefilling: requests with prompt left to compute (in this step or waiting), whom drafts would delay."""
        if decodes and not self.enabled_for_step(len(decodes)):  # every decode counts, speculating or not
            self.policy.off("batch_size")
            return False
        if decodes and self.guard is not None and not self.guard.allow(len(decodes)):
            self.policy.off("measured_slower")  # this batch size runs faster without drafts (guard.py)
            return False
        return self.policy.plan([r for r in decodes if self.eligible(r)], num_prefilling)

    @staticmethod
    def eligible(req: Request) -> bool:
        return req.matcher is None and not req.pooling

    def propose(self, req: Request, max_tokens: int) -> tuple[list[int], int]:
        """Drafts for a decoding request (at most the policy's k and what its max_tokens leaves; a batched
        proposer answers with RESERVED slots that `fill` replaces once the step's decodes are known), and the
        token budget they take, at most max_tokens: the drafts plus the context a draft model must first catch up
        on. A request too far behind for the budget catches up in chunks and drafts in a later step."""
        k = min(self.policy.k_for.get(req.request_id, 0), req.max_tokens - req.num_output_tokens - 1)
        if k <= 0 or max_tokens <= 0 or not self.eligible(req):
            return [], 0
        behind = self.proposer.num_behind(req)
        k = min(k, max_tokens - behind)
        if k <= 0:
            return [], self.proposer.catch_up(req, max_tokens)
        drafts = self.proposer.propose(req, k)
        return drafts, (len(drafts) + behind) if drafts else 0

    def fill(self, reqs: list[Request]) -> None:
        """After scheduling: a batched proposer drafts for the step's speculating decodes at once."""
        if self.proposer.batched:
            self.proposer.fill(reqs)
            assert all(RESERVED not in r.spec_token_ids for r in reqs), "a batched proposer left a slot unfilled"

    def on_verified(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        self.stats.observe(num_drafted, num_accepted)
        self.policy.observe(req, num_drafted, num_accepted)
        self.proposer.on_verified(req, num_drafted, num_accepted)

    def observe_step(self, num_decodes: int, num_emitted: int, num_draft_tokens: int, seconds: float | None,
                     predicted: float | None) -> None:
        """A step with `num_decodes` decode rows emitted `num_emitted` decode tokens in `seconds`, its prefill
        chunks' predicted time left out (guard.py; None: unknown); for a decode-only step, `predicted` is the time
        model's prediction for its rows, from which what drafting costs beyond the model is learned (overhead.py)."""
        if seconds is None:
            return
        if predicted is not None:
            self.policy.observe_step(num_draft_tokens, seconds - predicted)
        if self.guard is not None:
            self.guard.observe(num_decodes, num_emitted, seconds)

    def on_preempted(self, req: Request) -> None:
        self.proposer.on_preempted(req)

    def on_finished(self, req: Request) -> None:
        self.policy.forget(req)
        self.proposer.on_finished(req)


__all__ = ["DraftTarget", "Proposer", "SpecDecodeStats", "SpecDecoder", "make_proposer"]

"""Speculative decoding, engine side: which requests speculate, how many drafts fit a step, and the counters.

Drafts come from the model runner's drafter (pdserve/model/spec): after a step, it proposes drafts for the requests
the scheduler marked (ScheduledRequest.propose_drafts, up to num_speculative_tokens each), and the scheduler keeps
them as the request's `spec_token_ids`. At the request's next step the scheduler puts as many of them as the policy
plans (policy.py, guard.py) and the token budget leaves into its row; the runner verifies them in the same forward
pass (rejection_sampler.py) and returns the accepted drafts followed by one more token (the correction at the first
rejected position, or a bonus token after the last draft). The scheduler then appends those tokens in order, as if
decoded one by one (stop tokens and max_tokens apply to each in turn; stop strings too, found by the output
processor), counts only the accepted drafts as computed, and frees the blocks that only rejected drafts used.

Which requests speculate: every decode except those with structured output (their grammar matcher cannot be rolled
back) and pooling requests. Logprobs, penalties, min_tokens, logit_bias, seeds and n > 1 are supported (each
position is sampled with the same transforms as a plain decode). A seeded request draws from its own generator; its
output is reproducible for the same drafts, i.e. the same speculative config, batch-size switch and token budget.
"""

from __future__ import annotations

from pdserve.config import SpeculativeConfig
from pdserve.engine.request import Request
from pdserve.engine.spec_decode.guard import SpecGuard
from pdserve.engine.spec_decode.policy import PROBE_EVERY, Predict, SpecPolicy
from pdserve.engine.spec_decode.stats import SpecDecodeStats


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, predict: Predict | None = None) -> None:
        """`predict`: the step time model (StepBudget.predict) that the `auto` policy weighs drafts with."""
        self.config = config
        self.k = config.num_speculative_tokens
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

    def num_drafts(self, req: Request, budget: int) -> int:
        """How many of the request's proposals (spec_token_ids) its row takes this step: what the policy planned,
        what its max_tokens leaves (one token always comes from the target) and `budget`."""
        k = min(self.policy.k_for.get(req.request_id, 0), req.max_tokens - req.num_output_tokens - 1, budget)
        return max(min(k, len(req.spec_token_ids)), 0) if self.eligible(req) else 0

    def num_to_propose(self, req: Request, num_decoding: int) -> int:
        """After a step where `num_decoding` requests sample, how many drafts to ask the drafter for this request
        (for its next step): none where the next step will not speculate (the batch-size switch, the guard's
        measurement, an auto policy that is off and owes the request no probe) or its max_tokens leaves no room."""
        if not self.eligible(req) or not self.enabled_for_step(num_decoding):
            return 0
        if self.guard is not None and not self.guard.allow(num_decoding):
            return 0
        p = self.policy
        if p.auto and p.state != "on" and p.idle.get(req.request_id, 0) + 1 < PROBE_EVERY:
            return 0
        return max(0, min(self.k, req.max_tokens - req.num_output_tokens - 2))

    @staticmethod
    def eligible(req: Request) -> bool:
        return req.matcher is None and not req.pooling

    def on_verified(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        self.stats.observe(num_drafted, num_accepted)
        self.policy.observe(req, num_drafted, num_accepted)

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

    def on_finished(self, req: Request) -> None:
        self.policy.forget(req)


__all__ = ["SpecDecodeStats", "SpecDecoder"]

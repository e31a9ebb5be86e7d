"""When to speculate: per step, how many drafts each decoding request gets (0 .. num_speculative_tokens).

A decode step that is bandwidth-bound reads every weight to produce one token per sequence; a draft token rides in
the same weight read and costs only its own compute. The policy weighs that cost against the tokens a draft is
expected to yield, from two measurements:

- the step time model (engine/step_budget.py: t = c0 + c1 · bytes + c2 · FLOPs, fitted online to the steps run):
  t0 = the predicted time of this step's decodes alone, and per request the marginal time of its j-th draft
  (the extra query token: its layer FLOPs, its attention over the context, its sampled row);
- what drafting really costs beyond that prediction (overhead.py, learned from the steps run): a step that carries
  any draft pays e0 once (several query rows, the verification sampler, the proposer's work) and e1 per draft,
  and every step pays a bias b over the model; until measured, these are 0;
- the acceptance rate a: the probability that a draft token is accepted given the ones before it were, an EWMA per
  request whose prior is the proposer's EWMA over all requests. The j-th draft is emitted with probability a^j.

The step's rate is (expected tokens) / (predicted time). Starting from plain decode (B tokens in t0 + b), drafts are
added best first (a^j / marginal time, per request in order j = 1, 2, ...) while each one's tokens per second beat
the step's current rate: adding a term whose ratio exceeds the running ratio raises it, and the terms only get
worse, so the greedy stops at the best set. With the step's fixed cost e0 paid up front, that set is then kept only
if it beats plain decode. The result is k per request; a request whose proposer finds fewer drafts gets fewer.

A draft's time is also a delay for every request whose prompt is still being computed (a chunk in this step or
waiting): with B decodes and P such requests, each draft's time counts (B + P) / B times, so drafts yield while
prompts queue (time to first token does not grow), and count once when every request is decoding. The scheduler
gives drafts only the token budget that prefill chunks left.

Off (k = 0 for the whole step), with the reason counted in `SpecDecodeStats.disabled_steps`:
- `batch_size`: more decoding requests than `disable_by_batch_size`;
- `compute_bound`: the marginal cost of one query token per decode is at least half the predicted step time
  (COMPUTE_BOUND_SHARE): the step is past the roofline's ridge and a draft costs about what a token is worth;
- `low_acceptance`: no draft's expected yield beats the step's rate;
- `prefill_pending`: drafts would beat the step's rate, but not once weighted for the prompts they delay.
Until the time model is fitted (its first steps), every request gets k. A request switched off for
PROBE_EVERY consecutive steps gets one draft in a step that drafts anyway (when the step is not compute-bound), or
after PROBE_ALONE steps in a step that would not (a probe then pays the step's fixed cost alone), so a request whose
text becomes predictable is noticed again.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Sequence

from pdserve.engine.request import Request
from pdserve.engine.spec_decode.overhead import DraftOverhead

logger = logging.getLogger(__name__)

Predict = Callable[[Sequence[tuple[int, int]], int], float | None]  # (seqs (cached, new), rows sampled) -> seconds

COMPUTE_BOUND_SHARE = 0.5
PROBE_EVERY = 16
PROBE_ALONE = 64
PRIOR_RATE = 0.5  # the proposer's acceptance before any verification
PRIOR_WEIGHT = 2.0  # pseudo-trials behind a prior
REQUEST_DECAY = 0.8  # EWMA weight of the past, per verification (a request's text changes character quickly)
PROPOSER_DECAY = 0.98


class AcceptanceRate:
    """EWMA estimate of a draft token's acceptance probability given its predecessors were accepted: accepted drafts
    over trials (accepted drafts + the rejection that ended a run, if any)."""

    def __init__(self, prior: float, decay: float) -> None:
        self.decay = decay
        self.accepted, self.trials = prior * PRIOR_WEIGHT, PRIOR_WEIGHT

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        trials = num_accepted + (1 if num_accepted < num_drafted else 0)
        self.accepted = self.decay * self.accepted + num_accepted
        self.trials = self.decay * self.trials + trials

    @property
    def rate(self) -> float:
        return self.accepted / self.trials if self.trials > 0 else 0.0


class SpecPolicy:
    def __init__(self, k: int, auto: bool, predict: Predict | None) -> None:
        self.k = k
        self.auto = auto and predict is not None
        self.predict = predict
        self.proposer_rate = AcceptanceRate(PRIOR_RATE, PROPOSER_DECAY)
        self.rates: dict[str, AcceptanceRate] = {}
        self.idle: dict[str, int] = {}  # request id -> consecutive steps planned without drafts
        self.k_for: dict[str, int] = {}  # this step's plan
        self.disabled_steps: dict[str, int] = {}
        self.state = "on"
        self.overhead = DraftOverhead()

    def rate(self, req: Request) -> float:
        r = self.rates.get(req.request_id)
        return r.rate if r is not None else self.proposer_rate.rate

    def observe(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        self.proposer_rate.observe(num_drafted, num_accepted)
        r = self.rates.get(req.request_id)
        if r is None:
            r = self.rates[req.request_id] = AcceptanceRate(self.proposer_rate.rate, REQUEST_DECAY)
        r.observe(num_drafted, num_accepted)

    def forget(self, req: Request) -> None:
        self.rates.pop(req.request_id, None)
        self.idle.pop(req.request_id, None)

    def off(self, reason: str) -> None:
        """A step without drafts, and why."""
        self.k_for = {}
        self.disabled_steps[reason] = self.disabled_steps.get(reason, 0) + 1
        self._set_state(reason)

    def _set_state(self, state: str) -> None:
        if state != self.state:
            logger.debug("speculative decoding %s", "on" if state == "on" else f"off: {state}")
            self.state = state

    def plan(self, decodes: list[Request], num_prefilling: int = 0) -> bool:
        """Draft counts for this step's decoding requests (self.k_for); False: no drafts this step.
        num_prefilling: requests with prompt tokens left (this step's chunks and the waiting queue)."""
        if not decodes:
            self.k_for = {}
            return False
        if not self.auto:
            self.k_for = {r.request_id: self.k for r in decodes}
            return True
        assert self.predict is not None
        t0 = self.predict([(r.num_computed_tokens, 1) for r in decodes], len(decodes))
        if t0 is None or t0 <= 0:  # the time model is not fitted yet: speculate, which also feeds it
            self.k_for = {r.request_id: self.k for r in decodes}
            self._set_state("on")
            return True
        costs = {r.request_id: self._marginal(r.num_computed_tokens, 1) for r in decodes}
        if sum(costs.values()) - len(decodes) * self.overhead.per_draft >= COMPUTE_BOUND_SHARE * t0:  # roofline
            self.off("compute_bound")
            return False
        weight = (len(decodes) + num_prefilling) / len(decodes)
        t_plain = max(t0 + self.overhead.bias, 1e-6)
        self.k_for = self._greedy(decodes, t_plain, costs, weight)
        off_reason = "low_acceptance"
        if not any(self.k_for.values()) and weight > 1 and any(self._greedy(decodes, t_plain, costs).values()):
            off_reason = "prefill_pending"  # drafts would pay for the decodes, not for the prompts they delay
        drafting = any(self.k_for.values())
        for r in decodes:
            rid = r.request_id
            self.idle[rid] = 0 if self.k_for[rid] else self.idle.get(rid, 0) + 1
            if self.idle[rid] >= (PROBE_EVERY if drafting else PROBE_ALONE):  # look again: one draft
                self.k_for[rid], self.idle[rid] = 1, 0
        if not any(self.k_for.values()):
            self.off(off_reason)
            return False
        self._set_state("on")
        return True

    def _marginal(self, cached: int, j: int) -> float:
        """Seconds added by a row's j-th draft token (cached: its context): the time model's prediction plus the
        measured per-draft overhead."""
        assert self.predict is not None
        more = self.predict([(cached, 1 + j)], 1 + j) or 0.0
        less = self.predict([(cached, j)], j) or 0.0
        return max(more - less + self.overhead.per_draft, 1e-12)

    def observe_step(self, num_drafts: int, residual: float) -> None:
        """A decode-only step ran: its drafts and measured duration minus predicted time (overhead.py)."""
        self.overhead.observe(num_drafts, residual)

    def _greedy(self, decodes: list[Request], t0: float, first_cost: dict[str, float],
                delay_weight: float = 1.0) -> dict[str, int]:
        """Drafts best first while each beats the step's rate; a draft's time weighs delay_weight times (it also
        delays the requests still prefilling), the step's own time once: this maximises expected tokens over
        t0 + delay_weight * (e0 + drafts' time), and keeps the result only if it beats plain decode."""
        k_for = {r.request_id: 0 for r in decodes}
        tokens, t = float(len(decodes)), t0 + self.overhead.fixed * delay_weight
        heap: list[tuple[float, int, float, float]] = []  # (-gain/cost, request index, gain, cost)
        rates = [self.rate(r) for r in decodes]
        for i, r in enumerate(decodes):
            a, c = rates[i], first_cost[r.request_id]
            heapq.heappush(heap, (-a / (c * delay_weight), i, a, c))
        while heap:
            neg_ratio, i, gain, cost = heapq.heappop(heap)
            if -neg_ratio <= tokens / t:
                break  # the best remaining draft does not beat the step's rate: none does
            req = decodes[i]
            k_for[req.request_id] += 1
            tokens, t = tokens + gain, t + cost * delay_weight
            j = k_for[req.request_id]
            if j < self.k:
                nxt_gain = gain * rates[i]
                nxt_cost = self._marginal(req.num_computed_tokens, j + 1)
                heapq.heappush(heap, (-nxt_gain / (nxt_cost * delay_weight), i, nxt_gain, nxt_cost))
        if tokens / t <= len(decodes) / t0:  # the drafts do not repay the step's fixed cost
            return {rid: 0 for rid in k_for}
        return k_for


__all__ = ["AcceptanceRate", "COMPUTE_BOUND_SHARE", "PROBE_ALONE", "PROBE_EVERY", "SpecPolicy"]

"""Where drafts come from: the proposer interface that the speculative decoder (SpecDecoder) drives.

Two kinds of proposer:
- per-request (`batched = False`: ngram, suffix): `propose(req, k)` answers at once, inside scheduling, and may
  return fewer than k tokens (nothing found: a plain decode);
- batched (`batched = True`: a draft model): scheduling reserves k draft slots per speculating decode, then
  `fill(reqs)` proposes for all of them in one go (one model run per draft position over the whole batch) and
  writes the tokens into `req.spec_token_ids` in place. A batched proposer must fill every reserved slot. A model
  that is behind on a request's context (`num_behind`) catches up first; the scheduler charges that to the token
  budget, and books it in chunks (`catch_up`) when the budget cannot take it with the drafts.

Life-cycle hooks let a proposer keep per-request state (an index, a draft model's KV blocks) in step with the
target: `on_verified` after each verification (how many drafts were accepted: roll back what was not),
`on_preempted` (the target recomputes from scratch), `on_finished` (finished or aborted: free everything).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from pdserve.engine.request import Request

RESERVED = -1  # a reserved draft slot of a batched proposer, until fill() writes the token


class Proposer(ABC):
    method: str = ""
    batched: bool = False

    @abstractmethod
    def propose(self, req: Request, k: int) -> list[int]:
        """Up to k drafts for a decoding request (per-request proposers). A batched proposer returns k RESERVED
        slots (or fewer, or none when it will not draft for this request)."""

    def fill(self, reqs: list[Request]) -> None:  # noqa: B027 (optional hook)
        """Batched proposers: replace the RESERVED slots in each request's spec_token_ids by drafts (and run
        the catch-up booked this step)."""

    def num_behind(self, req: Request) -> int:
        """Context tokens (before the newest) a model-based proposer must compute before it can draft: they cost
        token budget like drafts. 0 for proposers without a model."""
        return 0

    def catch_up(self, req: Request, max_tokens: int) -> int:
        """Book up to max_tokens of the context a proposer is behind on for this step's fill; the tokens booked."""
        return 0

    def on_verified(self, req: Request, num_drafted: int, num_accepted: int) -> None:  # noqa: B027 (optional hook)
        """After verification: num_accepted of num_drafted drafts were kept (the rest are rolled back)."""

    def on_preempted(self, req: Request) -> None:  # noqa: B027 (optional hook)
        """The request lost its KV and will be recomputed."""

    def on_finished(self, req: Request) -> None:  # noqa: B027 (optional hook)
        """The request left the engine (finished, aborted or failed): drop its state."""


__all__ = ["RESERVED", "Proposer"]

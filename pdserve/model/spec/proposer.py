"""Where drafts come from: the proposer interface the model runner drives after each step (vLLM's drafter).

After a step's tokens are sampled, the runner asks its proposer for drafts for the requests the scheduler marked
(ScheduledRequest.propose_drafts): `propose(reqs, budget)` answers per request with up to k tokens that the
scheduler may put in the request's next step. Token proposers (ngram, suffix) look at the request's tokens and
cost no step budget; a model proposer (draft_model) runs a draft model, which first computes the context it has
not seen (its catch-up) and then one forward per draft position, within `budget` tokens per step: a request too
far behind catches up in chunks and drafts in a later step.

Life-cycle hooks keep per-request state (an index, a draft model's KV blocks) in step with the target:
`on_verified` after each verification (how many drafts were accepted: roll back what was not), `on_preempted`
(the target recomputes from scratch), `on_finished` (finished or aborted: free everything).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass
class DraftRequest:
    """A request to draft for: its tokens so far (prompt + output, the newest last; read only) and at most how many
    drafts."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    k: int


class Proposer(ABC):
    method: str = ""

    @abstractmethod
    def propose(self, reqs: list[DraftRequest], budget: int) -> dict[str, list[int]]:
        """Drafts for the requests' next steps (a request may get fewer than its k, or none). `budget`: tokens a
        model proposer may compute now; token proposers ignore it."""

    def on_verified(self, req_id: str, num_drafted: int, num_accepted: int) -> None:  # noqa: B027 (optional)
        """The request sampled again: num_accepted of the num_drafted drafts its row verified were kept (the rest,
        and proposals the scheduler did not put in the row, are rolled back)."""

    def on_preempted(self, req_id: str) -> None:  # noqa: B027 (optional hook)
        """The request lost its KV and will be recomputed."""

    def on_finished(self, req_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:  # noqa: B027
        """The request left the engine (finished, aborted or failed), with these tokens: drop its state."""


__all__ = ["DraftRequest", "Proposer"]

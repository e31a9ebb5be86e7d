"""N-gram prompt lookup: propose what followed the most recent earlier occurrence of the sequence's last n tokens.

For n from `max_n` down to `min_n`, the last n tokens of the prompt + output are looked up among the earlier n-grams
of the same sequence; the first n that matches wins, and its most recent earlier occurrence gives the proposal: the
k tokens that followed it. A continuation that runs into the sequence's end goes on with the proposal itself (the
match then says the text repeats with period L - start, so the period is copied on, as LZ77 copies an
overlapping run): "a b a b" proposes "a b a b ...", not just "a b".

Each sequence keeps an index (`NgramIndex`) from the hash of every earlier n-gram to the position after its most
recent occurrence, extended incrementally as tokens are appended (tokens are only ever appended), so a proposal
costs O(max_n - min_n + k), not a scan of the sequence. A hash collision can only propose a wrong draft, which
verification rejects; it can never change the output.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.model.spec.proposer import DraftRequest, Proposer


class NgramIndex:
    """Per sequence: n-gram hash -> position right after its most recent occurrence, for n in [min_n, max_n]."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tables: dict[int, dict[int, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed = 0  # n-grams ending before this position are indexed

    def extend(self, tokens: Sequence[int]) -> None:
        """Index the n-grams that end before the last token (the suffix itself must not match itself)."""
        end = len(tokens) - 1  # an n-gram ending at e (exclusive) is followed by tokens[e]
        for e in range(max(self.indexed, self.min_n), end + 1):
            for n, table in self.tables.items():
                if e >= n:
                    table[hash(tuple(tokens[e - n:e]))] = e
        self.indexed = max(self.indexed, end + 1)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens following the most recent earlier match of the longest matching suffix."""
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        self.extend(tokens)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self.tables[n].get(hash(tuple(tokens[length - n:])))
            if start is None or tuple(tokens[start - n:start]) != tuple(tokens[length - n:]):
                continue  # no match, or a hash collision
            out: list[int] = []
            for i in range(k):
                p = start + i
                out.append(tokens[p] if p < length else out[p - length])
            return out
        return []


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Stateless form of `NgramIndex.propose` (a fresh index per call): for tests and one-off use."""
    return NgramIndex(min_n, max_n).propose(tokens, k)


class NgramProposer(Proposer):
    """Prompt lookup over the request's own prompt + output (`prompt_lookup_min` .. `prompt_lookup_max`)."""

    method = "ngram"

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[str, NgramIndex] = {}  # request id -> its n-gram index

    def propose(self, reqs: list[DraftRequest], budget: int) -> dict[str, list[int]]:
        out = {}
        for r in reqs:
            index = self.indexes.get(r.req_id)
            if index is None:
                index = self.indexes[r.req_id] = NgramIndex(self.min_n, self.max_n)
            if drafts := index.propose(r.token_ids, r.k):
                out[r.req_id] = drafts
        return out

    def on_finished(self, req_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        self.indexes.pop(req_id, None)

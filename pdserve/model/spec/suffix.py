"""Suffix decoding: propose the most frequent continuation of the longest matching suffix, from the request's own
prompt + output and from recent requests' outputs.

Each sequence is indexed by a depth-bounded suffix trie (`SuffixTrie`): every substring of at most `max_depth` tokens
is a path from the root, and a node counts how often its substring occurs. Appending a token extends the paths of
the (at most max_depth) suffixes that end at the sequence's end: O(max_depth) per token, so an index grows with the
sequence and is never rebuilt. Two tries are consulted per proposal:

- the request's own trie (prompt + output so far), extended with the tokens appended since its last proposal;
- one global trie over the outputs of the last `max_cached_requests` finished requests (least recently finished
  evicted first: its substrings' counts are taken back out).

A proposal (`SuffixTrie.speculate`): find the longest suffix of the context (up to max_depth - 1 tokens) that occurs
with a continuation, then follow the most frequent child while the running product of child/parent frequencies (the
continuation's empirical probability) stays >= `min_token_prob`, for at most `max_spec_factor` x the match length
tokens (a long match earns a long draft; a one-token match, a short one) and at most k. Of the two tries' drafts the
one with the higher score (the sum of its tokens' probabilities: expected accepted tokens) is proposed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pdserve.model.spec.proposer import DraftRequest, Proposer


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0  # occurrences of this node's substring
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Occurrence counts of every substring of at most `max_depth` tokens of the sequences added."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()

    def start(self) -> list[_Node]:
        """The open suffixes of a new sequence (none yet): the state `append` extends."""
        return []

    def append(self, active: list[_Node], token: int) -> list[_Node]:
        """Extend each open suffix (nodes at depth 1 .. max_depth - 1, longest first) and start a new one by
        `token`; returns the new open suffixes. A suffix reaching max_depth is closed."""
        out: list[_Node] = []
        for node in [*active[-(self.max_depth - 1):], self.root] if self.max_depth > 1 else [self.root]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
            child.count += 1
            out.append(child)
        return out[-(self.max_depth - 1):] if self.max_depth > 1 else []

    def add(self, tokens: Sequence[int]) -> None:
        active = self.start()
        for t in tokens:
            active = self.append(active, t)

    def remove(self, tokens: Sequence[int]) -> None:
        """Take a sequence added with `add` back out (its counts; nodes left with no occurrence are dropped)."""
        for i in range(len(tokens)):
            node = self.root
            for t in tokens[i:i + self.max_depth]:
                child = node.children[t]
                child.count -= 1
                if child.count == 0:
                    del node.children[t]  # its whole subtree counted only occurrences being removed
                    break
                node = child

    def _walk(self, tokens: Sequence[int]) -> _Node | None:
        node: _Node | None = self.root
        for t in tokens:
            node = node.children.get(t) if node is not None else None
        return node

    def match(self, context: Sequence[int]) -> tuple[_Node | None, int]:
        """The node of the longest suffix of `context` that occurs followed by some token, and its length (0: none).
        If a suffix occurs with a continuation so do its own suffixes: binary search on the length."""
        lo, hi = 0, min(len(context), self.max_depth - 1)
        best: _Node | None = None
        n = len(context)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            node = self._walk(context[n - mid:])
            if node is not None and node.children:
                lo, best = mid, node
            else:
                hi = mid - 1
        return best, lo

    def speculate(self, context: Sequence[int], k: int, max_spec_factor: float,
                  min_token_prob: float) -> tuple[list[int], float]:
        """(draft, score): the most frequent continuation of the longest matching suffix, and the sum of its tokens'
        empirical probabilities."""
        node, length = self.match(context)
        limit = min(k, int(length * max_spec_factor))
        draft: list[int] = []
        score, prob = 0.0, 1.0
        while node is not None and len(draft) < limit and node.children:
            token, child = max(node.children.items(), key=lambda kv: kv[1].count)
            prob *= child.count / node.count
            if prob < min_token_prob:
                break
            draft.append(token)
            score += prob
            node = child
        return draft, score


class _RequestIndex:
    """A request's own trie and how far it has indexed the request's tokens."""

    def __init__(self, max_depth: int) -> None:
        self.trie = SuffixTrie(max_depth)
        self.active = self.trie.start()
        self.indexed = 0

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens[self.indexed:]:
            self.active = self.trie.append(self.active, t)
        self.indexed = len(tokens)


class SuffixProposer(Proposer):
    """`suffix_decoding_*` keys: max_tree_depth, max_cached_requests (0: no global trie), max_spec_factor,
    min_token_prob (vLLM's names)."""

    method = "suffix"

    def __init__(self, max_tree_depth: int, max_cached_requests: int, max_spec_factor: float,
                 min_token_prob: float) -> None:
        self.max_depth = max_tree_depth
        self.max_cached = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.global_trie = SuffixTrie(max_tree_depth)
        self.cached: OrderedDict[str, list[int]] = OrderedDict()  # request id -> output added to the global trie
        self.indexes: dict[str, _RequestIndex] = {}  # request id -> its own trie

    def propose(self, reqs: list[DraftRequest], budget: int) -> dict[str, list[int]]:
        out = {}
        for r in reqs:
            if drafts := self._propose(r.req_id, r.token_ids, r.k):
                out[r.req_id] = drafts
        return out

    def _propose(self, req_id: str, tokens: list[int], k: int) -> list[int]:
        index = self.indexes.get(req_id)
        if index is None:
            index = self.indexes[req_id] = _RequestIndex(self.max_depth)
        index.extend(tokens)  # only the tokens appended since the last proposal
        context = tokens[-(self.max_depth - 1):]
        draft, score = index.trie.speculate(context, k, self.max_spec_factor, self.min_token_prob)
        if self.cached:
            other, other_score = self.global_trie.speculate(context, k, self.max_spec_factor, self.min_token_prob)
            if other_score > score:
                draft = other
        return draft

    def on_finished(self, req_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        self.indexes.pop(req_id, None)
        output = list(token_ids[num_prompt_tokens:])
        if self.max_cached <= 0 or not output:
            return
        if req_id in self.cached:  # an id reused: replace its old output
            self.global_trie.remove(self.cached.pop(req_id))
        self.global_trie.add(output)
        self.cached[req_id] = output
        while len(self.cached) > self.max_cached:
            _, evicted = self.cached.popitem(last=False)
            self.global_trie.remove(evicted)


__all__ = ["SuffixProposer", "SuffixTrie"]

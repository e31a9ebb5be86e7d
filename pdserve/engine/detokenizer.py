"""Incremental (streaming) detokenization with UTF-8-safe output and multi-token stop strings.

Algorithm: the prefix_offset/read_offset window of vLLM's ``detokenize_incrementally`` (also what
``tokenizers.decoders.DecodeStream`` does internally). Every step decodes only the token window
``ids[prefix_offset:]`` and diffs it against the cached decode of ``ids[prefix_offset:read_offset]``:

* ``prefix_text`` = decode(ids[prefix_offset:read_offset]) -- context whose text was already emitted.
* If decode(ids[prefix_offset:]) is longer than ``prefix_text`` and does not end in U+FFFD, the surplus is
  new, complete text: it is *confirmed*, and the window slides (prefix_offset <- read_offset <- len(ids)).
* Otherwise the tokens after read_offset stay *pending* (an incomplete UTF-8 character whose remaining bytes
  are in future tokens, or tokens that decode to nothing, e.g. skipped special tokens).

Decoding a window instead of single tokens handles byte-level BPE characters split over tokens, SentencePiece
byte-fallback tokens and the leading-space ("▁") quirk: the window starts with a few prompt tokens, so the
first output token is decoded in context, exactly as vLLM's ``convert_prompt_ids_to_tokens`` does.

``tokenizers.decoders.DecodeStream`` (present in tokenizers >= 0.21) implements the same window, but it is
opaque: it cannot flush a trailing incomplete character when the request ends, and its window grows without
bound while the decode keeps ending in U+FFFD (a model emitting invalid bytes). Hence this implementation,
which is equivalent chunk-for-chunk on well-formed text (checked in tests) and adds both.

Stop strings are searched only in confirmed text, and only in the region new text could have completed: the
last ``max_stop_len - 1`` confirmed characters plus the new text, and only those ending with a character of the
new text. Streaming (``get_delta``) holds back that
many trailing characters, so no part of a stop string is ever streamed (unless include_stop_str_in_output).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

# Prompt tokens kept as decoding context (vLLM: INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5).
_PROMPT_CONTEXT = 5
# A genuinely incomplete character has at most 3 bytes pending, so it lies in the last 3 (non-empty)
# byte-level / byte-fallback tokens. Tokens the decode drops (special tokens under skip_special_tokens) never enter
# the window: a character's bytes join across them, as in tokenizer.decode.
_MAX_CHAR_TOKENS = 3
# If more tokens than this are pending and the decode still ends in U+FFFD, the earlier bytes are invalid,
# not incomplete: confirm them (as U+FFFD, like tokenizer.decode) to bound the window.
_MAX_PENDING = 8
# Drop consumed ids once this many precede the window, so memory and slicing stay O(window).
_COMPACT_AT = 64


class IncrementalDetokenizer:
    """Per-request streaming detokenizer.

    Invariants:
      * ``output_text`` (before a flush) is the decode of the output tokens up to the last point where the
        decode ended on a complete character; text of pending tokens is never in it.
      * Concatenation of all ``get_delta`` results is always a prefix of ``output_text``; at the end (after
        ``get_delta(finished=True)``) it equals ``output_text``.
      * Without a stop match, after flushing, ``output_text == tokenizer.decode(output_ids,
        skip_special_tokens=...)`` for tokenizers whose decoder is context-free at the window start (byte-level
        BPE such as GPT-2/Llama-3/SmolLM2; no ``clean_up_tokenization_spaces``, like vLLM).
      * With a stop match, ``output_text`` ends right before the earliest stop string occurrence (or right after
        it with include_stop_str_in_output); tokens after that are ignored. No match is reported (nor text cut)
        before the output has ``min_tokens`` tokens.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.skip_special_tokens = skip_special_tokens
        # Stop strings only count once the output has >= min_tokens tokens (the engine ignores them before, so
        # the text must not be cut either); occurrences completed earlier are not matched later (as vLLM).
        self.min_tokens = min_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        # "" would match everywhere; duplicates would only cost time (the first listed wins ties anyway)
        self.stop: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        # An occurrence completed by new text ends with one of its characters: index the strings by last
        # character, so a step only searches the strings that can end there.
        self._stop_by_last: dict[str, list[int]] = {}
        for i, s in enumerate(self.stop):
            self._stop_by_last.setdefault(s[-1], []).append(i)
        max_stop_len = max((len(s) for s in self.stop), default=0)
        # Characters of confirmed text that may still be the start of a stop string.
        self._stop_ctx_len = max(max_stop_len - 1, 0)
        # With include_stop_str_in_output the cut lies after the match, which is never before already
        # confirmed text, so nothing needs holding back (as vLLM's stop_buffer_length).
        self._holdback = 0 if include_stop_str_in_output else self._stop_ctx_len

        # Prefer the Rust tokenizer directly: no Python-level overhead of transformers' decode().
        backend = tokenizer if isinstance(tokenizer, Tokenizer) else getattr(tokenizer, "backend_tokenizer", None)
        if isinstance(backend, Tokenizer):
            self._decode_fn = backend.decode
        else:
            self._decode_fn = tokenizer.decode
        self._skipped = special_ids(tokenizer) if skip_special_tokens else frozenset()

        # Window state: ids[prefix_offset:read_offset] already emitted (context), ids[read_offset:] pending.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:]) if _PROMPT_CONTEXT else []
        self._prefix_text = self._decode(self._ids)
        # A prompt ending in an incomplete character would swallow the output's first bytes: drop such tokens
        # from the context, so the output decodes on its own (as tokenizer.decode(output_ids) does).
        while self._ids and self._prefix_text.endswith("\ufffd"):
            self._ids.pop()
            self._prefix_text = self._decode(self._ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

        self._chunks: list[str] = []  # confirmed output text, joined lazily by output_text
        self._unsent = ""  # suffix of the confirmed text not yet returned by get_delta
        self._stop_ctx = ""  # last _stop_ctx_len chars of confirmed text (stop strings may start there)
        self.num_output_tokens = 0
        self.stop_str: str | None = None  # the stop string that matched, if any
        self.finished = False  # a stop matched or the tail was flushed: later tokens are ignored

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, skip_special_tokens=self.skip_special_tokens)

    # ------------------------------------------------------------------ public API

    def update(self, new_token_ids: list[int], finished_by_engine: bool = False) -> str | None:
        """Append newly generated tokens (usually one, may be several).

        Returns the stop string matched, if any (text is then truncated at it, or just after it with
        include_stop_str_in_output), else None. ``finished_by_engine=True`` marks these as the request's last
        tokens (EOS, max_tokens, ...): the pending tail, including an incomplete character (as U+FFFD, like
        ``tokenizer.decode``), is flushed into the output and stop-checked too. After a stop match or a flush,
        further calls are no-ops returning None.
        """
        if self.finished:
            return None
        if new_token_ids:
            self.num_output_tokens += len(new_token_ids)
            # One token at a time (as vLLM): the window then slides at every character boundary, so the
            # chunking and the pending-token bound do not depend on how tokens were batched.
            parts: list[str] = []
            for tid in new_token_ids:
                if tid in self._skipped:  # decodes to nothing, wherever it stands
                    continue
                self._ids.append(tid)
                full = self._decode(self._ids[self._prefix_offset :])
                if len(full) > len(self._prefix_text) and not full.endswith("\ufffd"):
                    parts.append(full[len(self._prefix_text) :])  # complete text: confirm it
                    self._slide(len(self._ids))
                elif len(self._ids) - self._read_offset > _MAX_PENDING:
                    # Too long to be one incomplete character: invalid bytes (or tokens decoding to nothing).
                    # Confirm all but the last _MAX_CHAR_TOKENS tokens, which may hold the start of a character.
                    cut = len(self._ids) - _MAX_CHAR_TOKENS
                    text = self._decode(self._ids[self._prefix_offset : cut])
                    if len(text) > len(self._prefix_text):
                        parts.append(text[len(self._prefix_text) :])
                    self._slide(cut)
            # One stop check for all the new text (earliest occurrence wins).
            if parts and self._append("".join(parts)):
                return self.stop_str
        if finished_by_engine:
            self._flush()
            return self.stop_str
        return None

    @property
    def output_text(self) -> str:
        """Full decoded output so far (truncated at a stop string if one matched). Amortized O(1) if called
        rarely; for streaming use get_delta."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def get_delta(self, finished: bool) -> str:
        """Text not yet returned that is safe to stream.

        While not finished, holds back pending tokens (incomplete trailing character) and the last
        ``max(len(s) for s in stop) - 1`` characters, which may become the start of a stop string (nothing with
        include_stop_str_in_output, where no streamed text can be cut). When finished, flushes and returns
        everything remaining (minus what a matched stop string removed).
        """
        if finished:
            self._flush()
            delta, self._unsent = self._unsent, ""
            return delta
        n = len(self._unsent) - self._holdback
        if n <= 0:
            return ""
        delta, self._unsent = self._unsent[:n], self._unsent[n:]
        return delta

    # ------------------------------------------------------------------ internals

    def _slide(self, read_to: int) -> None:
        """Mark ids[:read_to] as emitted; the window now starts at the old read_offset."""
        self._prefix_offset = self._read_offset
        self._read_offset = read_to
        if self._prefix_offset >= _COMPACT_AT:  # keep self._ids O(window); amortized O(1) per token
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])

    def _flush(self) -> None:
        """Confirm the pending tail as is (may end in U+FFFD) and stop accepting tokens."""
        if self.finished:
            return
        if self._read_offset < len(self._ids):
            full = self._decode(self._ids[self._prefix_offset :])
            tail = full[len(self._prefix_text) :]
            self._slide(len(self._ids))
            self._append(tail)
        self.finished = True

    def _append(self, new: str) -> bool:
        """Confirm ``new`` text and check stop strings in the region it could complete. True if a stop hit."""
        if not new:
            return False
        if self.stop:
            ctx = self._stop_ctx
            region = ctx + new
            best_i, best_s = -1, ""
            # Cost per call: O(len(new)) plus, per candidate s, a find over len(s) - 1 + len(new) characters:
            # at most O(total stop characters) per new token, whatever the number of stop strings.
            candidates = sorted({k for c in set(new) for k in self._stop_by_last.get(c, ())})
            for k in candidates:  # in listed order
                s = self.stop[k]
                # An occurrence must end inside `new` (older ones were found earlier).
                i = region.find(s, max(0, len(ctx) - len(s) + 1))
                if i != -1 and (best_i == -1 or i < best_i):  # earliest start wins; ties: first listed
                    best_i, best_s = i, s
            if best_i != -1 and self.num_output_tokens >= self.min_tokens:
                cut = best_i + len(best_s) if self.include_stop_str_in_output else best_i
                self._push(new)
                self._truncate(len(region) - cut)
                self.stop_str = best_s
                self.finished = True
                return True
            if self._stop_ctx_len:
                self._stop_ctx = region[-self._stop_ctx_len :]
        self._push(new)
        return False

    def _push(self, text: str) -> None:
        self._chunks.append(text)
        self._unsent += text  # bounded by holdback + text since the last get_delta

    def _truncate(self, n: int) -> None:
        """Remove the last ``n`` confirmed characters (all still unsent thanks to the holdback)."""
        if n <= 0:
            return
        # Holdback guarantees n <= len(self._unsent) unless get_delta(finished=True) was already called.
        self._unsent = self._unsent[: max(len(self._unsent) - n, 0)]
        while n > 0 and self._chunks:
            last = self._chunks[-1]
            if len(last) <= n:
                n -= len(last)
                self._chunks.pop()
            else:
                self._chunks[-1] = last[: len(last) - n]
                n = 0


_SPECIAL_IDS: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids decode(skip_special_tokens=True) drops: the special added tokens of the `tokenizers.Tokenizer` (or
    a transformers tokenizer's backend), else the tokenizer's all_special_ids; computed once per tokenizer object."""
    try:
        return _SPECIAL_IDS[tokenizer]
    except (KeyError, TypeError):
        pass
    backend = tokenizer if isinstance(tokenizer, Tokenizer) else getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
    else:
        ids = frozenset(getattr(tokenizer, "all_special_ids", ()))
    try:
        _SPECIAL_IDS[tokenizer] = ids
    except TypeError:  # not weakly referenceable: computed per detokenizer
        pass
    return ids

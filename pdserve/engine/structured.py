"""Constrained decoding with xgrammar: compile a request's constraint to a grammar, give each sequence a matcher,
and build the per-step token bitmask of the constrained rows.

xgrammar is imported lazily, on the first constrained request: unconstrained serving never loads it. Compiling
runs where `InputProcessor.make_requests` runs (a server worker thread), never on the engine thread, and is cached by
(kind, spec). A matcher's state is the output tokens it accepted; preemption recomputes those tokens' KV but never
samples them again, so the matcher stays valid as it is.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from pdserve.errors import ErrorCode, RequestRejected
from pdserve.sampling_params import StructuredOutputs

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept (LRU); xgrammar's own cache is off so this bound holds
# and their bytes (xgrammar's memory_size_bytes: token-mask caches; 128 small tools compile to ~2.5 MB, so the
# count alone would let the cache keep ~640 MB)
GRAMMAR_CACHE_BYTES = 64 * 2**20
MAX_GRAMMAR_BYTES = 16 * 2**20  # one compiled constraint larger than this is refused (400), never cached


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF for exactly one of `choices`. JSON string literals are valid EBNF string literals (same escapes), and
    keep CJK characters as they are."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class StructuredOutputManager:
    """Compiles constraints for one tokenizer/vocabulary. Thread-safe: server worker threads compile concurrently."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)  # EOS is allowed exactly when the grammar is complete
        self._lock = threading.Lock()
        self._compiler: Any = None  # xgrammar.GrammarCompiler, built on first use (tokenizer scan: ~0.2 s)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cache_bytes = 0  # memory_size_bytes of the cached grammars
        self.num_compiled = 0  # cache misses, for tests and metrics
        self.max_grammar_bytes, self.cache_bytes = MAX_GRAMMAR_BYTES, GRAMMAR_CACHE_BYTES

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1),
                                                     cache_enabled=False)
            return self._compiler

    def compile(self, so: StructuredOutputs) -> Any:
        """The compiled grammar for `so` (cached); RequestRejected (invalid_structured_output) if it does not
        compile."""
        key = (so.kind, so.spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiler = self._get_compiler()
        try:
            compiled = self._compile(compiler, so)
        except Exception as e:  # xgrammar raises RuntimeError (and sometimes others) with a parser message
            raise RequestRejected(f"the {so.kind} constraint does not compile: {_short(e)}", so.param or so.kind,
                                  ErrorCode.INVALID_STRUCTURED_OUTPUT) from e
        size = int(getattr(compiled, "memory_size_bytes", 0))
        if size > self.max_grammar_bytes:
            raise RequestRejected(f"the {so.kind} constraint compiles to {size} bytes; at most "
                                  f"{self.max_grammar_bytes} are accepted (fewer or simpler tools or schemas)",
                                  so.param or so.kind, ErrorCode.INVALID_STRUCTURED_OUTPUT)
        with self._lock:
            self.num_compiled += 1
            if key not in self._cache:
                self._cache[key] = compiled
                self._cache_bytes += size
            while len(self._cache) > GRAMMAR_CACHE_SIZE or self._cache_bytes > self.cache_bytes:
                _, old = self._cache.popitem(last=False)
                self._cache_bytes -= int(getattr(old, "memory_size_bytes", 0))
        return compiled

    @staticmethod
    def _compile(compiler: Any, so: StructuredOutputs) -> Any:
        kind = so.kind
        # compact JSON (no free whitespace): a weak model cannot pad forever between tokens
        if kind == "json":
            return compiler.compile_json_schema(so.spec, any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(so.spec)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(so.choice or []))
        if kind == "structural_tag":
            return compiler.compile_structural_tag(so.spec)
        return compiler.compile_grammar(so.spec)

    @staticmethod
    def json_schema_error(schema: dict[str, Any]) -> str | None:
        """Why `schema` cannot constrain output (xgrammar's message), or None. Converts to a grammar only (no
        token masks): cheap enough to check every tool's parameters on each request."""
        import xgrammar as xgr

        try:
            xgr.Grammar.from_json_schema(json.dumps(schema, ensure_ascii=False), any_whitespace=False)
        except Exception as e:  # RuntimeError (and sometimes others) with a parser message
            return _short(e)
        return None

    @staticmethod
    def new_matcher(compiled: Any) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)


def _short(e: Exception) -> str:
    """xgrammar's error message: its last line, without the "[time] file:line" prefix."""
    msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return msg.split("] ", 1)[-1] if msg.startswith("[") else msg


def fill_bitmask(matchers: Sequence[Any], vocab_size: int) -> torch.Tensor:
    """int32 [len(matchers), ceil(vocab / 32)]: bit t of row i set when matchers[i] allows token t next."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab_size)
    for i, m in enumerate(matchers):
        m.fill_next_token_bitmask(bitmask, i)
    return bitmask

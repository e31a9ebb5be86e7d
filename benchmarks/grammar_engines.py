"""xgrammar against llguidance on this CPU: how long a JSON schema takes to compile and how long filling the
next-token masks of a batch takes per decode step, with the default model's tokenizer (49,152 tokens).

    pip install --no-deps --target /tmp/llgpkg llguidance==1.9.1      # once, outside pdserve's dependencies
    PYTHONPATH=/tmp/llgpkg .venv/bin/python benchmarks/grammar_engines.py [--batch 32] [--steps 48]

Compile: a fresh compiler/matcher per schema (xgrammar: GrammarCompiler.compile_json_schema without its cache;
llguidance: grammar_from_json_schema + LLMatcher, which compiles lazily, so its first mask is included). Masks: B
matchers of one schema advance together for --steps tokens; each step fills all B rows (one call per row, as
pdserve's engine does), then every matcher consumes a token it allows (a seeded pseudo-random pick among the allowed
ones, so both engines walk valid but different outputs); reported is the median wall time of a step's B fills.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from pdserve.model.loader import load_tokenizer

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from structured_cost import LONG, SCHEMAS  # noqa: E402


def allowed(bitmask_row: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = bitmask_row.view(torch.int32).unsqueeze(-1).bitwise_right_shift(torch.arange(32)).bitwise_and(1)
    return bits.flatten()[:vocab].nonzero().flatten()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Any, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr, self.vocab = xgr, vocab
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)

    def compile(self, schema: dict[str, Any]) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema, ensure_ascii=False), any_whitespace=False)

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def bitmask(self, n: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(n, self.vocab)

    def fill(self, m: Any, bitmask: torch.Tensor, i: int) -> None:
        m.fill_next_token_bitmask(bitmask, i)

    def consume(self, m: Any, t: int) -> bool:
        return bool(m.accept_token(t))

    def done(self, m: Any) -> bool:
        return bool(m.is_terminated())


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Any, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll, self.llt, self.vocab = llguidance, llguidance.torch, vocab
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema, ensure_ascii=False))
        m = self.ll.LLMatcher(self.tok, grammar)
        self.fill(m, self.bitmask(1), 0)  # compiles lazily: the first mask is part of the cost
        return grammar

    def matchers(self, grammar: Any, n: int) -> list[Any]:
        return [self.ll.LLMatcher(self.tok, grammar) for _ in range(n)]

    def bitmask(self, n: int) -> torch.Tensor:
        return self.llt.allocate_token_bitmask(n, self.vocab)

    def fill(self, m: Any, bitmask: torch.Tensor, i: int) -> None:
        self.llt.fill_next_token_bitmask(m, bitmask, i)

    def consume(self, m: Any, t: int) -> bool:
        return bool(m.consume_token(t))

    def done(self, m: Any) -> bool:
        return bool(m.is_stopped())


def run(engine: Any, batch: int, steps: int, eos: int, closers: torch.Tensor) -> dict[str, Any]:
    out: dict[str, Any] = {"engine": engine.name}
    for label, schema in [*SCHEMAS.items(), ("long array", LONG)]:
        t0 = time.perf_counter()
        compiled = engine.compile(schema)
        out[f"compile {label} ms"] = (time.perf_counter() - t0) * 1e3
    compiled = engine.compile(LONG)
    ms = engine.matchers(compiled, batch)
    bitmask = engine.bitmask(batch)
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        live = [(i, m) for i, m in enumerate(ms) if not engine.done(m)]
        if len(live) < batch:  # a finished row would make the step cheaper: stop at the first one
            break
        for i, m in live:
            engine.fill(m, bitmask, i)
        times.append(time.perf_counter() - t0)
        for i, m in live:
            ok = allowed(bitmask[i], engine.vocab)
            closing = ok[(ok != eos) & ~torch.isin(ok, closers)] if len(ok) > 1 else ok
            ok = closing if len(closing) else ok  # keep the array open: the step cost is measured mid-output
            if len(ok):
                engine.consume(m, int(ok[torch.randint(len(ok), (1,), generator=gen)]))
    out[f"mask fill, batch {batch}, median ms/step"] = statistics.median(times) * 1e3
    out["steps measured"] = len(times)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(2)
    tok = load_tokenizer(None)
    vocab = 49152
    rows = []
    for cls in (XGrammar, LLGuidance):
        try:
            engine = cls(tok, vocab)
        except ImportError as e:
            print(f"# {cls.name}: not installed ({e})")
            continue
        closers = torch.tensor([t for t in range(vocab) if "]" in tok.decode([t])])
        rows.append(run(engine, args.batch, args.steps, tok.eos_token_id, closers))
        print(json.dumps(rows[-1]), flush=True)
    keys = [k for k in rows[0] if k != "engine"] if rows else []
    print("\n| measure | " + " | ".join(r["engine"] for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{r[k]:.2f}" for r in rows) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

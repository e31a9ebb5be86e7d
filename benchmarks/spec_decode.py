"""Speculative decoding against no speculation, per proposer, workload and concurrency, against a real server.

    .venv/bin/python benchmarks/spec_decode.py [--concurrency 1 4 16] [--output-len 96] [--methods none ngram suffix]

Workloads, built offline from files on this machine (no downloads), chat-templated (/v1/chat/completions):
- `edit`: "rewrite this source file with a change" over ~40-line excerpts of the Python standard library's modules
  (the answer mostly repeats the prompt: where speculation should pay);
- `docs`: "summarize with quotes" and "continue this document" over docstrings of the same modules;
- `random`: prompts of random words, greedy (little to find in the prompt, but a small model soon repeats
  itself, which drafts do find);
- `random-t1`: the same prompts sampled at temperature 1 (seeded): drafts are rarely right, so the auto policy
  should turn speculation off and cost nothing.
For each method (`none`, `ngram`, `suffix`, and `draft_model` when config.py lists it: otherwise skipped with a
message) one server is started (`pdserve serve --speculative-config ...`, the auto policy unless --policy), all at
once and fresh in each of `--rounds` rounds (the speed of one server process varies by up to ~15 % from one start
to the next on a shared machine); in each round every workload runs at each concurrency (`c` streaming clients,
each sending its share of the requests in turn), the methods interleaved. Reported: output tok/s (median of rounds), the
ratio to `none` (median over rounds of the ratio within a round, with its range: the machine's drift hits both
sides of a ratio), ITL p50/p99 (between streamed chunks; a speculating step delivers several tokens in one chunk),
TTFT p50, the mean acceptance length and the draft tokens and steps the policy turned off (from the server's
spec_decode counters). The table is printed as markdown for BENCHMARKS.md.

`--target gguf` (default) serves the shipped Q4_1 GGUF; `--target fp32` serves its weights converted once to a
float32 Hugging Face directory, for every method, so that `draft_model` (the Q4_1 GGUF drafting) is a smaller draft
for a larger target, as the method is meant to be used. With `--target gguf`, `draft_model` drafts with the target
itself (acceptance near 1 but no cheaper draft): a bound on what acceptance can give, not a speedup.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import os
import random
import subprocess
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import torch

from pdserve.bench.server_metrics import parse_metrics, server_deltas
from pdserve.config import SPEC_METHODS
from pdserve.launch import start_server
from pdserve.model.convert import convert_gguf_to_hf
from pdserve.model.loader import resolve_model_path

MODULES = ["textwrap", "shlex", "fnmatch", "glob", "bisect", "heapq", "colorsys", "calendar", "difflib", "string",
           "statistics", "fractions", "base64", "queue", "sched", "graphlib", "secrets", "keyword", "copy", "enum"]
EDITS = ["Rename every local variable `i` to `index` and otherwise keep the code unchanged.",
         "Add a one-line comment above each function and otherwise keep the code unchanged.",
         "Replace every single-quoted string with a double-quoted one and otherwise keep the code unchanged."]


def stdlib_sources() -> list[tuple[str, str]]:
    """(module, source) of some pure-Python standard library modules."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(m, (root / f"{m}.py").read_text()) for m in MODULES if (root / f"{m}.py").exists()]


def code_excerpt(source: str, rng: random.Random, lines: int = 40) -> str:
    """A run of `lines` lines starting at a top-level def or class (whole functions, not a cut mid-way)."""
    rows = source.splitlines()
    starts = [i for i, r in enumerate(rows) if r.startswith(("def ", "class "))] or [0]
    i = rng.choice(starts)
    return "\n".join(rows[i:i + lines])


def docstrings(source: str) -> list[str]:
    tree = ast.parse(source)
    out = [ast.get_docstring(n) for n in ast.walk(tree)
           if isinstance(n, ast.Module | ast.FunctionDef | ast.ClassDef)]
    return [d for d in out if d and len(d) > 300]


def workloads(n: int, seed: int = 0) -> dict[str, list[list[dict[str, str]]]]:
    rng = random.Random(seed)
    sources = stdlib_sources()
    docs = [d for _, s in sources for d in docstrings(s)]
    edit, doc, rand = [], [], []
    words = sorted({w for _, s in sources for w in s.split() if w.isalpha()})
    for i in range(n):
        name, src = sources[i % len(sources)]
        edit.append([{"role": "user", "content": f"{EDITS[i % len(EDITS)]}\n\n```python\n"
                                                 f"{code_excerpt(src, rng)}\n```"}])
        text = docs[i % len(docs)][:1500]
        ask = ("Summarize this text, quoting its key sentences word for word." if i % 2 == 0 else
               "Continue this document in the same style.")
        doc.append([{"role": "user", "content": f"{ask}\n\n{text}"}])
        rand.append([{"role": "user", "content": " ".join(rng.choice(words) for _ in range(120))}])
    return {"edit": edit, "docs": doc, "random": rand, "random-t1": rand}


TEMPERATURE = {"random-t1": 1.0}  # workloads not listed: greedy


@dataclass
class Cell:
    tokens: int = 0
    seconds: float = 0.0
    itl: list[float] | None = None
    ttft: list[float] | None = None
    mean_accept: float | None = None
    draft_tokens: float = 0.0
    steps_off: float = 0.0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


async def one(http: httpx.AsyncClient, url: str, messages: list[dict[str, str]], n: int,
              cell: Cell, temperature: float = 0.0, seed: int = 0) -> None:
    body = {"messages": messages, "max_tokens": n, "temperature": temperature, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    arrivals: list[float] = []
    async with http.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                cell.tokens += chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter())
    assert cell.itl is not None and cell.ttft is not None
    if arrivals:
        cell.ttft.append(arrivals[0] - t0)
        cell.itl.extend(b - a for a, b in zip(arrivals, arrivals[1:]))


async def run_cell(base: str, prompts: list[list[dict[str, str]]], concurrency: int, n: int,
                   temperature: float = 0.0) -> Cell:
    cell = Cell(itl=[], ttft=[])
    url = base + "/v1/chat/completions"
    queue = list(enumerate(prompts))

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            i, messages = queue.pop(0)
            await one(http, url, messages, n, cell, temperature, seed=i)

    async with httpx.AsyncClient(timeout=900) as http:
        before = parse_metrics((await http.get(base + "/metrics")).text)
        t0 = time.perf_counter()
        await asyncio.gather(*[client(http) for _ in range(concurrency)])
        cell.seconds = time.perf_counter() - t0
        after = parse_metrics((await http.get(base + "/metrics")).text)
    st = server_deltas(before, after)
    cell.mean_accept = st.spec_mean_acceptance_length if st is not None else None
    for name in ("draft_tokens", "steps_off"):
        metric = {"draft_tokens": "spec_decode_num_draft_tokens_total",
                  "steps_off": "spec_decode_disabled_steps_total"}[name]
        key = f"{after.prefix}:{metric}"
        setattr(cell, name, after.values.get(key, 0.0) - before.values.get(key, 0.0))
    return cell


def spec_config(method: str, policy: str) -> dict[str, object] | None:
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 5, "prompt_lookup_min": 2,
                "policy": policy}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": 8, "policy": policy}
    return {"method": "draft_model", "model": resolve_model_path(None), "num_speculative_tokens": 4, "policy": policy}


def pct(xs: list[float] | None, q: float) -> float:
    return float(np.percentile(xs, q)) * 1000 if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests-per-client", type=int, default=2, help="requests = concurrency x this (c=1: x2)")
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--methods", nargs="+", default=["none", "ngram", "suffix", "draft_model"])
    ap.add_argument("--workloads", nargs="+", default=["edit", "docs", "random", "random-t1"])
    ap.add_argument("--policy", default="auto", choices=["auto", "always"])
    ap.add_argument("--rounds", type=int, default=3, help="runs of each cell, methods interleaved")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--target", default="gguf", choices=["gguf", "fp32"],
                    help="the served model: the shipped Q4_1 GGUF, or its weights in float32")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as model_tmp:
        model_args: list[str] = []
        if args.target == "fp32":
            convert_gguf_to_hf(resolve_model_path(None), model_tmp, dtype=torch.float32)
            model_args = ["--model", model_tmp]
        run(args, model_args)


def run(args: argparse.Namespace, model_args: list[str]) -> None:
    """Each round starts every method's server and runs every cell once per method, the methods interleaved; a
    method's ratio is the median over rounds of its rate over `none`'s in the same round (the machine's drift hits
    both sides of a ratio)."""
    methods = []
    for m in args.methods:
        if m != "none" and m not in SPEC_METHODS:
            print(f"# skipped {m}: not among this build's speculative methods {list(SPEC_METHODS)}")
        else:
            methods.append(m)
    most = max(args.concurrency) * args.requests_per_client
    loads = {k: v for k, v in workloads(max(most, 2 * args.requests_per_client)).items() if k in args.workloads}
    results: dict[tuple[str, str, int], list[Cell]] = {}
    load0 = os.getloadavg()[0]
    for r in range(args.rounds):  # fresh servers each round: a process's own speed varies from start to start
        with tempfile.TemporaryDirectory() as tmp:
            servers = {}
            try:
                for method in methods:
                    extra = [] if method == "none" else ["--speculative-config",
                                                         json.dumps(spec_config(method, args.policy))]
                    servers[method] = start_server(Path(tmp), *model_args, "--dtype", args.dtype,
                                                   "--kv-cache-memory", "2GiB", "--max-num-seqs",
                                                   str(max(args.concurrency)), "--num-threads", str(args.threads),
                                                   *extra)
                    asyncio.run(run_cell(servers[method].base_url, loads[next(iter(loads))][:2], 2, 8))  # warm-up
                for name, prompts in loads.items():
                    for c in args.concurrency:
                        count = c * args.requests_per_client if c > 1 else 2 * args.requests_per_client
                        for method in methods:
                            cell = asyncio.run(run_cell(servers[method].base_url, prompts[:count], c,
                                                        args.output_len, TEMPERATURE.get(name, 0.0)))
                            results.setdefault((method, name, c), []).append(cell)
                            print(f"# round {r}: {method} {name} c={c}: {cell.tok_s:.1f} tok/s", flush=True)
            finally:
                for srv in servers.values():
                    srv.stop()
    cpu = subprocess.run(["sh", "-c", "lscpu | grep 'Model name' | cut -d: -f2"], capture_output=True, text=True)
    print(f"\n# spec_decode: policy {args.policy}, output {args.output_len} tokens, temperature 0 "
          f"(random-t1: 1, seeded), {args.threads} threads, dtype {args.dtype}, target {args.target}; "
          f"{cpu.stdout.strip()}; {time.strftime('%Y-%m-%d')}; {args.rounds} rounds, methods interleaved "
          f"{methods}; load average {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    print("| workload | c | method | output tok/s (median) | vs none (median of rounds) | ITL p50 / p99 ms | "
          "TTFT p50 ms | mean accepted length | draft tokens / steps off |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in loads:
        for c in args.concurrency:
            base = results.get(("none", name, c))
            for method in methods:
                cells = results[(method, name, c)]
                rate = float(np.median([x.tok_s for x in cells]))
                ratios = [x.tok_s / b.tok_s for x, b in zip(cells, base or []) if b.tok_s]
                ratio = f"{float(np.median(ratios)):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-"
                itl = [v for x in cells for v in x.itl or []]
                ttft = [v for x in cells for v in x.ttft or []]
                acc = [x.mean_accept for x in cells if x.mean_accept]
                acc_s = f"{float(np.mean(acc)):.2f}" if acc else "-"
                spec = "-" if method == "none" else (f"{sum(x.draft_tokens for x in cells):.0f} / "
                                                     f"{sum(x.steps_off for x in cells):.0f}")
                print(f"| {name} | {c} | {method} | {rate:.1f} | {ratio} | {pct(itl, 50):.1f} / {pct(itl, 99):.1f} | "
                      f"{pct(ttft, 50):.0f} | {acc_s} | {spec} |")


if __name__ == "__main__":
    main()

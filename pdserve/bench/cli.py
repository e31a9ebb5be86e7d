"""`pdserve bench`: the command line over BenchConfig and run_benchmark.

Wiring: `add_bench_parser(subparsers)` registers the subcommand with func=run_bench_cli. Heavy imports (httpx,
numpy, transformers, matplotlib) happen only when the command runs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import re
import sys
from pathlib import Path
from typing import Any

from pdserve.bench.config import DATASETS, BenchConfig, BenchError, parse_goodput
from pdserve.bench.datasets import DatasetError

DESCRIPTION = """Benchmark a running OpenAI-compatible server (pdserve or vLLM) with streaming requests and print
vLLM's result block (TTFT, TPOT, ITL, E2EL percentiles), plus the server-side split of TTFT into queue and prefill
read from its /metrics."""


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmark a running server (vLLM-style serving benchmark)",
                              description=DESCRIPTION)
    d = BenchConfig()
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default=d.base_url, help="server root, e.g. http://127.0.0.1:8000")
    g.add_argument("--endpoint", default=d.endpoint, choices=["/v1/completions", "/v1/chat/completions"])
    g.add_argument("--model", default=None, help="model name in requests (default: the first of GET /v1/models)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer for synthetic prompts and length counts: smollm2-135m, a .gguf, a HF dir or id "
                        "(default: the served model)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")

    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=DATASETS, default=None,
                   help="default: random, or the format of --dataset-path (ShareGPT if it has 'conversations')")
    g.add_argument("--dataset-path", default=None, help='JSONL rows {"prompt": ..., "output_len": ...} or ShareGPT')
    g.add_argument("--encoding", default=d.encoding, help="text encoding of --dataset-path (e.g. gbk)")
    g.add_argument("--num-prompts", type=int, default=d.num_prompts)
    g.add_argument("--random-input-len", type=int, default=d.random_input_len)
    g.add_argument("--random-output-len", type=int, default=d.random_output_len)
    g.add_argument("--random-range-ratio", type=float, default=d.random_range_ratio,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=d.prefix_repetition_prefix_len)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=d.prefix_repetition_suffix_len)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=d.prefix_repetition_num_prefixes)
    g.add_argument("--prefix-repetition-output-len", type=int, default=d.prefix_repetition_output_len)
    g.add_argument("--output-len", type=int, default=None,
                   help="file datasets: max_tokens of every request (default: the row's output_len, or 128)")
    g.add_argument("--prompt-token-ids", action="store_true",
                   help="random/prefix-repetition: send token ids instead of text (exact lengths; completions)")

    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=d.request_rate, help="requests/s, or inf (all at once)")
    g.add_argument("--burstiness", type=float, default=d.burstiness,
                   help="gamma shape of arrival gaps: 1 = Poisson, < 1 burstier, > 1 more regular")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    g.add_argument("--num-warmups", type=int, default=d.num_warmups, help="requests sent (and not measured) first")
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens tokens")
    g.add_argument("--temperature", type=float, default=d.temperature)
    g.add_argument("--top-p", type=float, default=d.top_p, help="nucleus sampling (sent when below 1)")
    g.add_argument("--seed", type=int, default=d.seed, help="seeds the dataset and the arrival schedule")
    g.add_argument("--request-timeout", type=float, default=d.request_timeout,
                   help="seconds without data from the server before a request fails")

    g = p.add_argument_group("report")
    g.add_argument("--goodput", nargs="+", metavar="NAME:MS", default=None,
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (names: ttft, tpot, e2el)")
    g.add_argument("--metric-percentiles", default="90,99", help="comma-separated percentiles to report")
    g.add_argument("--save-result", nargs="?", const="", default=None, metavar="PATH",
                   help="write the result JSON (every request's record included); no PATH: a name from the run")
    g.add_argument("--plot", dest="plot_dir", default=None, metavar="DIR", help="write ttft/itl/timeline PNGs")
    g.add_argument("--no-server-metrics", dest="server_metrics", action="store_false",
                   help="do not read the server's /metrics")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=run_bench_cli)
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    names = {f.name for f in dataclasses.fields(BenchConfig)}
    kw = {k: v for k, v in vars(args).items() if k in names and k not in ("goodput", "metric_percentiles")}
    try:
        pcts = tuple(float(x) for x in args.metric_percentiles.split(",") if x.strip())
    except ValueError:
        raise BenchError(f"--metric-percentiles takes numbers like 90,99; got {args.metric_percentiles!r}") from None
    return BenchConfig(**kw, goodput=parse_goodput(args.goodput), metric_percentiles=pcts)


def default_result_name(cfg: BenchConfig, model: str, date: str) -> str:
    """vLLM's pattern: <backend>-<rate>qps-concurrency<n>-<model>-<date>.json"""
    backend = "openai-chat" if cfg.is_chat else "openai"
    rate = "inf" if math.isinf(cfg.request_rate) else f"{cfg.request_rate:g}"
    safe_model = re.sub(r"[^A-Za-z0-9._-]+", "_", model.rsplit("/", 1)[-1])
    return f"{backend}-{rate}qps-concurrency{cfg.max_concurrency or 'inf'}-{safe_model}-{date}.json"


def run_bench_cli(args: argparse.Namespace) -> int:
    """0 when at least one request succeeded, 1 when none did, 2 for a benchmark that could not run."""
    from pdserve.bench.runner import run_benchmark

    try:
        cfg = config_from_args(args)
        result = asyncio.run(run_benchmark(cfg))
    except (BenchError, DatasetError) as e:
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 2
    print(result.format(), flush=True)
    if cfg.save_result is not None:
        path = Path(cfg.save_result or default_result_name(cfg, result.model, result.date))
        print(f"pdserve bench: wrote {result.save(path)}", file=sys.stderr)
    if cfg.plot_dir:
        from pdserve.bench.plots import write_plots

        for p in write_plots(result, cfg.plot_dir):
            print(f"pdserve bench: wrote {p}", file=sys.stderr)
    return 0 if result.summary()["completed"] else 1

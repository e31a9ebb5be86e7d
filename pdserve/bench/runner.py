"""Drive a benchmark: find the model and tokenizer, build the prompts, warm up, send on an arrival schedule under
a concurrency cap, and read the server's /metrics before and after.

The /metrics "before" read happens after the warm-up, so the server-side deltas cover exactly the measured
requests (on an otherwise idle server). A server updates its counters before it sends a request's last chunk, so
the "after" read, taken when every stream has ended, sees all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from pdserve.bench import datasets
from pdserve.bench.client import Clock, RequestRecord, Target, error_message, send_request
from pdserve.bench.config import BenchConfig, BenchError
from pdserve.bench.datasets import SampleRequest
from pdserve.bench.report import BenchResult
from pdserve.bench.server_metrics import scrape, server_deltas


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send offsets in seconds, the first at 0. Gaps are Gamma(shape=burstiness, scale=1/(rate*burstiness)): mean
    1/rate; burstiness 1 is a Poisson process, < 1 burstier, > 1 more regular. An infinite rate sends all at 0."""
    if n <= 0:
        return np.zeros(0)
    if np.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


# ---- set-up ----------------------------------------------------------------------------------------------------
async def discover_model(http: httpx.AsyncClient, base_url: str) -> str:
    """The first model of GET /v1/models."""
    try:
        resp = await http.get(base_url + "/v1/models", timeout=30.0)
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {base_url}: {type(e).__name__}: {e}") from None
    if resp.status_code != 200:
        raise BenchError(f"GET {base_url}/v1/models: {error_message(resp.status_code, resp.content)}; "
                         "pass --model")
    data = resp.json().get("data") or []
    if not data:
        raise BenchError(f"{base_url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])


def load_bench_tokenizer(name: str) -> Any:
    """pdserve's loader first (the default model, a .gguf, a HF directory; cached on disk), then transformers."""
    from pdserve.model.loader import load_tokenizer

    try:
        return load_tokenizer(name)
    except Exception as first:  # noqa: BLE001 - fall back to a Hugging Face id
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(name)
        except Exception:  # noqa: BLE001
            raise BenchError(f"cannot load tokenizer {name!r}: {first}; pass --tokenizer") from None


def resolve_tokenizer(cfg: BenchConfig, model: str) -> tuple[Any, str | None]:
    """(tokenizer, its name). Synthetic datasets need one; file datasets use one when it loads (prompt lengths,
    ShareGPT output lengths, counting output tokens of a server that sends no usage)."""
    name = cfg.tokenizer or model
    try:
        return load_bench_tokenizer(name), name
    except BenchError as e:
        if cfg.dataset_kind in ("random", "prefix-repetition"):
            raise
        print(f"pdserve bench: warning: {e}; prompt lengths will come only from the server's usage",
              file=sys.stderr)
        return None, None


def build_samples(cfg: BenchConfig, tokenizer: Any) -> list[SampleRequest]:
    kind = cfg.dataset_kind
    if kind == "random":
        return datasets.random_dataset(tokenizer, cfg.num_prompts, cfg.random_input_len, cfg.random_output_len,
                                       cfg.random_range_ratio, cfg.seed, cfg.prompt_token_ids)
    if kind == "prefix-repetition":
        return datasets.prefix_repetition_dataset(
            tokenizer, cfg.num_prompts, cfg.prefix_repetition_prefix_len, cfg.prefix_repetition_suffix_len,
            cfg.prefix_repetition_num_prefixes, cfg.prefix_repetition_output_len, cfg.seed, cfg.prompt_token_ids)
    assert cfg.dataset_path is not None  # BenchConfig checks it for file datasets
    samples = datasets.load_file(cfg.dataset_path, kind, cfg.encoding, tokenizer, cfg.output_len, cfg.num_prompts)
    if cfg.is_chat and any(isinstance(s.prompt, list) for s in samples):
        raise BenchError(f"{cfg.dataset_path}: token-id prompts need --endpoint /v1/completions")
    return samples


def fill_output_counts(records: Sequence[RequestRecord], tokenizer: Any) -> None:
    """Output tokens of successes whose server sent no usage: count the text with the tokenizer, else chunks."""
    for r in records:
        if r.success and r.output_len_source == "none":
            if tokenizer is not None:
                r.output_len = len(tokenizer.encode(r.generated_text, add_special_tokens=False))
                r.output_len_source = "tokenizer"
            else:
                r.output_len, r.output_len_source = r.num_chunks, "chunks"


# ---- load ------------------------------------------------------------------------------------------------------
def _slot(limit: asyncio.Semaphore | None) -> contextlib.AbstractAsyncContextManager[Any]:
    return limit if limit is not None else contextlib.nullcontext()


async def warm_up(http: httpx.AsyncClient, target: Target, samples: Sequence[SampleRequest],
                  cfg: BenchConfig, clock: Clock = time.perf_counter) -> list[str]:
    """Send cfg.num_warmups requests (the first samples) and wait for them; returns their errors (also printed)."""
    if cfg.num_warmups == 0:
        return []
    limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    t0 = time.perf_counter()

    async def one(i: int) -> RequestRecord:
        s = samples[i % len(samples)]
        async with _slot(limit):
            return await send_request(http, target, s, RequestRecord(-1 - i, s.prompt_len, s.output_len), t0,
                                      clock)

    recs = await asyncio.gather(*(one(i) for i in range(cfg.num_warmups)))
    errors = [r.error for r in recs if not r.success]
    if errors:
        print(f"pdserve bench: warning: {len(errors)} of {len(recs)} warm-up requests failed; first: {errors[0]}",
              file=sys.stderr)
    return errors


async def run_load(http: httpx.AsyncClient, target: Target, samples: Sequence[SampleRequest],
                   cfg: BenchConfig, clock: Clock = time.perf_counter) -> tuple[list[RequestRecord], float]:
    """Send every sample at its scheduled arrival, at most cfg.max_concurrency in flight; (records in sample
    order, duration from the first arrival to the last request's end). Arrivals and the duration are wall time;
    `clock` stamps each request's latencies (see send_request)."""
    offsets = arrival_times(len(samples), cfg.request_rate, cfg.burstiness, cfg.seed)
    limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = tqdm(total=len(samples), disable=cfg.disable_tqdm, file=sys.stderr, unit="req", desc="pdserve bench")
    failed = 0
    t0 = time.perf_counter()

    async def one(i: int, sample: SampleRequest, offset: float) -> RequestRecord:
        nonlocal failed
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        rec = RequestRecord(i, sample.prompt_len, sample.output_len, arrival=float(offset))
        async with _slot(limit):
            await send_request(http, target, sample, rec, t0, clock)
        if not rec.success:
            failed += 1
            bar.set_postfix(failed=failed, refresh=False)
        bar.update(1)
        return rec

    try:
        records = await asyncio.gather(*(one(i, s, float(o)) for i, (s, o) in enumerate(zip(samples, offsets))))
    finally:
        bar.close()
    return list(records), time.perf_counter() - t0


async def run_benchmark(cfg: BenchConfig, samples: Sequence[SampleRequest] | None = None,
                        clock: Clock = time.perf_counter) -> BenchResult:
    """Run one benchmark against cfg.base_url. `samples` replaces the configured dataset (for callers that build
    their own prompts, e.g. ablations); cfg.num_prompts then does not apply. `clock` stamps the latencies (TTFT,
    ITL, E2EL); wall time unless a caller injects another (tests: the server's CPU time, which load does not
    stretch)."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    timeout = httpx.Timeout(cfg.request_timeout, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=cfg.max_concurrency or 100)
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as http:
        model = cfg.model or await discover_model(http, cfg.base_url)
        tokenizer, tokenizer_id = await asyncio.to_thread(resolve_tokenizer, cfg, model)
        if samples is None:
            samples = await asyncio.to_thread(build_samples, cfg, tokenizer)
        if not samples:
            raise BenchError("no requests to send")
        target = Target(cfg.base_url + cfg.endpoint, model, cfg.is_chat, cfg.temperature, cfg.ignore_eos,
                        top_p=cfg.top_p)
        warmup_errors = await warm_up(http, target, samples, cfg, clock)
        before = await scrape(http, cfg.base_url) if cfg.server_metrics else None
        records, duration = await run_load(http, target, samples, cfg, clock)
        after = await scrape(http, cfg.base_url) if cfg.server_metrics else None
    fill_output_counts(records, tokenizer)
    return BenchResult(cfg, model, tokenizer_id, records, duration, server_deltas(before, after), date,
                       warmup_errors)

"""The three ablations `pdserve diagnose` runs against a server, and `diagnose()`, which runs and judges them.

    from pdserve.bench.diagnose import DiagnoseConfig, diagnose
    result = asyncio.run(diagnose(DiagnoseConfig(base_url=..., scale=0.25)))
    result.verdict, result.knee_concurrency, result.findings

Every prompt is random token ids of an exact length sent to /v1/completions with ignore_eos, so lengths are exact;
each run draws its own ids, so the prefix cache never hits across runs:
  (a) prompt-shape ablation: the same total prompt tokens T as 1×T, 2×T/2 and 4×T/4 prompts, all sent at once,
      short outputs. Reads TTFT (mean, max) and the server's split of TTFT into queue and prefill time.
  (b) output-length ablation: one stream (concurrency 1), outputs 128 / 512 / 2048 tokens. Reads TPOT, ITL, tokens/s.
  (c) concurrency sweep: fixed prompt/output lengths, `2 × level` requests at each level with at most `level` in
      flight. Reads median/p99 TTFT, ITL, E2EL, throughput, server queue time, preemptions, and the peaks of the
      `kv_cache_usage_perc` / `num_requests_waiting` gauges sampled from /metrics during the run.
`--scale` multiplies every prompt and output length (not the concurrency levels). The rules that judge the
numbers are in `rules.py`.
"""

from __future__ import annotations

import asyncio
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from pdserve.bench.client import Clock
from pdserve.bench.config import COMPLETIONS_ENDPOINT, BenchConfig
from pdserve.bench.diagnose.config import DiagnoseConfig
from pdserve.bench.diagnose.deployment import ServerFacts, facts_from_server, pd_advice
from pdserve.bench.diagnose.report import DiagnoseResult, build_result, write_report
from pdserve.bench.diagnose.stats import RunStats, stats_from_result

GAUGES = ("kv_cache_usage_perc", "num_requests_waiting", "num_requests_running")


class _Session:
    """What every run shares: the target, the model, its tokenizer, and the seed stream."""

    def __init__(self, cfg: DiagnoseConfig, model: str, max_model_len: int | None, tokenizer: Any,
                 clock: Clock) -> None:
        self.cfg, self.model, self.max_model_len, self.tokenizer = cfg, model, max_model_len, tokenizer
        self.clock = clock
        self.runs = 0

    def bench_config(self, concurrency: int | None, server_metrics: bool = True) -> BenchConfig:
        c = self.cfg
        return BenchConfig(base_url=c.base_url, endpoint=c.endpoint, model=self.model,
                           tokenizer=c.tokenizer or self.model, api_key=c.api_key, ignore_eos=True,
                           max_concurrency=concurrency, disable_tqdm=True, seed=c.seed,
                           request_timeout=c.request_timeout, server_metrics=server_metrics)

    def samples(self, n: int, prompt_len: int, output_len: int) -> list[Any]:
        """Fresh random prompts: every call uses its own seed, so no run hits another's prefix cache."""
        from pdserve.bench.datasets import random_dataset

        self.runs += 1
        seed = self.cfg.seed * 1000 + self.runs
        chat = self.cfg.endpoint != COMPLETIONS_ENDPOINT
        return random_dataset(self.tokenizer, n, prompt_len, output_len, 0.0, seed, token_ids=not chat)

    def fit(self, prompt_len: int, output_len: int) -> tuple[int, int]:
        """Clip (prompt, output) so prompt + output <= the server's max_model_len (prompt first kept)."""
        if self.max_model_len is None or prompt_len + output_len <= self.max_model_len:
            return prompt_len, output_len
        prompt_len = min(prompt_len, self.max_model_len - 2)
        return prompt_len, max(2, self.max_model_len - prompt_len)

    async def run(self, label: str, n: int, prompt_len: int, output_len: int, concurrency: int | None,
                  sample_gauges: bool = False) -> RunStats:
        from pdserve.bench.runner import run_benchmark

        print(f"pdserve diagnose: {label}: {n} requests, prompt {prompt_len}, output {output_len}, "
              f"concurrency {concurrency or 'all'}", file=sys.stderr, flush=True)
        samples = await asyncio.to_thread(self.samples, n, prompt_len, output_len)
        gauges: list[dict[str, float]] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(self._sample(stop, gauges)) if sample_gauges else None
        try:
            res = await run_benchmark(self.bench_config(concurrency), samples, self.clock)
        finally:
            stop.set()
            if sampler is not None:
                await sampler
        return stats_from_result(res, label, prompt_len, output_len, concurrency, gauges if sampler else None,
                                 self.cfg.thresholds.kv_full)

    async def _sample(self, stop: asyncio.Event, gauges: list[dict[str, float]]) -> None:
        """Append one {gauge: value} sample of GAUGES every gauge_interval_s while the run lasts."""
        import httpx

        from pdserve.bench.server_metrics import scrape

        async with httpx.AsyncClient() as http:
            while not stop.is_set():
                s = await scrape(http, self.cfg.base_url)
                if s is not None and s.prefix:
                    gauges.append({g: v for g in GAUGES if (v := s.values.get(f"{s.prefix}:{g}")) is not None})
                try:
                    await asyncio.wait_for(stop.wait(), self.cfg.gauge_interval_s)
                except TimeoutError:
                    pass


async def _server_info(cfg: DiagnoseConfig) -> tuple[str, int | None, dict[str, Any], dict[str, Any]]:
    """(model, max_model_len, its GET /v1/models entry, GET /version) ({} where the server has none)."""
    import httpx

    from pdserve.bench.runner import discover_model

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    async with httpx.AsyncClient(headers=headers) as http:
        model = cfg.model or await discover_model(http, cfg.base_url)
        entry: dict[str, Any] = {}
        version: dict[str, Any] = {}
        try:
            data = (await http.get(cfg.base_url + "/v1/models", timeout=30.0)).json().get("data") or []
            entry = next((d for d in data if d.get("id") == model), {})
            resp = await http.get(cfg.base_url + "/version", timeout=30.0)
            version = resp.json() if resp.status_code == 200 else {}
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
    max_len = entry.get("max_model_len") if isinstance(entry, dict) else None
    return model, int(max_len) if max_len else None, entry, version if isinstance(version, dict) else {}


async def _facts(cfg: DiagnoseConfig, entry: dict[str, Any], version: dict[str, Any]) -> ServerFacts:
    """The server's facts for the PD advice; its /metrics read after the runs (hand-offs they caused count)."""
    import httpx

    from pdserve.bench.server_metrics import scrape

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    async with httpx.AsyncClient(headers=headers) as http:
        s = await scrape(http, cfg.base_url)
    return facts_from_server(version, entry, s.values if s is not None else None)


async def run_shapes(s: _Session) -> list[RunStats]:
    c = s.cfg
    piece_unit = c.scaled(c.shape_total_tokens // max(c.shape_pieces), 4)  # the smallest piece
    total = piece_unit * max(c.shape_pieces)
    out_len = c.scaled(c.shape_output_len, 4)
    total, out_len = s.fit(total, out_len)
    runs = []
    for k in c.shape_pieces:
        plen = total // k
        runs.append(await s.run(f"(a) {k}×{plen}", k, plen, out_len, None))
    return runs


async def run_output_lengths(s: _Session) -> list[RunStats]:
    c = s.cfg
    runs = []
    lengths = sorted(c.decode_output_lens)
    for i, n in enumerate([*lengths, lengths[0]] if len(lengths) > 1 else lengths):
        plen, olen = s.fit(c.scaled(c.decode_prompt_len, 8), c.scaled(n, 4))
        again = " again" if i == len(lengths) else ""  # the shortest, repeated last: a baseline against drift
        runs.append(await s.run(f"(b) output {olen}{again}", 1, plen, olen, 1))
    return runs


async def run_sweep(s: _Session) -> list[RunStats]:
    c = s.cfg
    # >= 16 output tokens: the median ITL must be a decode step, not the few steps that mix in others' prefills
    plen, olen = s.fit(c.scaled(c.sweep_prompt_len, 8), c.scaled(c.sweep_output_len, 16))
    runs = []
    for level in c.concurrency_levels:
        n = max(1, round(c.requests_per_level * level))
        runs.append(await s.run(f"(c) concurrency {level}", n, plen, olen, level, sample_gauges=True))
    return runs


async def diagnose(cfg: DiagnoseConfig, clock: Clock = time.perf_counter) -> DiagnoseResult:
    """Run cfg.experiments against cfg.base_url, judge them, and write the report (when cfg.out_dir is set or
    by default to ./diagnose-<date>). `clock` stamps every latency (see run_benchmark): wall time, or in tests one
    that a busy machine does not stretch."""
    from pdserve.bench.runner import load_bench_tokenizer, run_benchmark

    model, max_len, entry, version = await _server_info(cfg)
    tokenizer = await asyncio.to_thread(load_bench_tokenizer, cfg.tokenizer or model)
    s = _Session(cfg, model, max_len, tokenizer, clock)
    t0 = time.perf_counter()
    warm = await asyncio.to_thread(s.samples, 1, 8, 2)  # first-request costs (allocations) out of the numbers
    await run_benchmark(s.bench_config(None, server_metrics=False), warm, clock)
    a = await run_shapes(s) if "a" in cfg.experiments else []
    b = await run_output_lengths(s) if "b" in cfg.experiments else []
    c = await run_sweep(s) if "c" in cfg.experiments else []
    target = {"model": model, "base_url": cfg.base_url, "max_model_len": max_len, "scale": cfg.scale,
              "duration_s": time.perf_counter() - t0}
    advice = pd_advice(c, await _facts(cfg, entry, version), cfg.pd_rules) if c else None
    result = build_result(a, b, c, cfg.thresholds, target, advice)
    out = Path(cfg.out_dir or f"diagnose-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    result.report_path = await asyncio.to_thread(write_report, result, out)
    return result

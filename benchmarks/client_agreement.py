"""Do third-party benchmark clients see the same TTFT and ITL as pdserve's own timings?

Runs the same load (random prompts, chat endpoint, fixed concurrency) with several clients against one server, and
compares each client's mean TTFT and ITL with the server's own histograms over the same run
(`pdserve:time_to_first_token_seconds`, `pdserve:inter_token_latency_seconds`; behind a router,
`pdserve:router_time_to_first_token_seconds`):

- `pdserve bench` (this package's client),
- vLLM's serving benchmark (`vllm.benchmarks.serve`, from the venv `benchmarks/setup_peers.sh --vllm` makes),
- GuideLLM (`guidellm run`, optional: `PEERS_DIR/guidellm-venv`, see below).

    .venv/bin/python benchmarks/client_agreement.py [--topology colocated|pd|both] [--num-prompts 32]

Clients that stamp TTFT at the first SSE chunk (vLLM's rule) book the whole prefill as TTFT only if the server sends
nothing before the first token; a chunk sent early would show as a near-zero TTFT and one huge inter-token gap.
GuideLLM: `python3 -m venv $PEERS_DIR/guidellm-venv && $PEERS_DIR/guidellm-venv/bin/pip install torch==2.13.0
guidellm==0.8.1`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from pdserve.launch import ServerProc, free_port, start_pdserve
from pdserve.roofline import machine_info

REPO = Path(__file__).resolve().parent.parent
PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "pdserve-peers"))
VLLM_BENCH = ("import argparse, sys; from vllm.benchmarks.serve import add_cli_args, main; "
              "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def metric(text: str, name: str) -> float:
    """Sum of a metric's samples (all label sets) in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


class ServerClock:
    """Mean TTFT and ITL from a server's own histograms, over the window between two scrapes."""

    def __init__(self, url: str, ttft_name: str, itl_name: str | None) -> None:
        self.url, self.names = url, {"ttft": ttft_name, "itl": itl_name}
        self.before = ""

    def start(self) -> None:
        self.before = httpx.get(self.url + "/metrics", timeout=10).text

    def stop(self) -> dict[str, float | None]:
        after = httpx.get(self.url + "/metrics", timeout=10).text
        out: dict[str, float | None] = {}
        for key, name in self.names.items():
            if name is None:
                out[f"server_mean_{key}_ms"] = None
                continue
            n = metric(after, name + "_count") - metric(self.before, name + "_count")
            s = metric(after, name + "_sum") - metric(self.before, name + "_sum")
            out[f"server_mean_{key}_ms"] = 1e3 * s / n if n else None
        return out


def run_pdserve_bench(url: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    path = out / "pdserve_bench.json"
    subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "--base-url", url, "--endpoint",
                    "/v1/chat/completions", "--dataset-name", "random", "--random-input-len", str(args.input_len),
                    "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
                    "--max-concurrency", str(args.concurrency), "--ignore-eos", "--num-warmups", "0",
                    "--metric-percentiles", "50,99", "--save-result", str(path), "--disable-tqdm",
                    "--no-server-metrics"], check=True, stdout=subprocess.DEVNULL)
    r = json.loads(path.read_text())
    return {k: r[k] for k in ("mean_ttft_ms", "median_ttft_ms", "mean_itl_ms", "p99_itl_ms", "mean_tpot_ms")}


def run_vllm_bench(url: str, args: argparse.Namespace, out: Path, model: str) -> dict[str, Any] | None:
    py = PEERS_DIR / "vllm-venv" / "bin" / "python"
    if not py.exists():
        print(f"# vLLM client skipped: no {py} (benchmarks/setup_peers.sh --vllm)", file=sys.stderr)
        return None
    hf = PEERS_DIR / "smollm2-135m-hf"  # its tokenizer: vLLM's random dataset counts tokens with it
    if not (hf / "config.json").exists():
        subprocess.run([sys.executable, "-m", "pdserve.cli", "convert", "--dtype", "float32", "smollm2-135m",
                        str(hf)], check=True)
    subprocess.run([str(py), "-c", VLLM_BENCH, "--backend", "openai-chat", "--base-url", url, "--endpoint",
                    "/v1/chat/completions", "--model", model, "--tokenizer", str(hf), "--dataset-name", "random",
                    "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                    "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
                    "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                    "--save-result", "--result-dir", str(out), "--result-filename", "vllm_bench.json",
                    "--disable-tqdm"], check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    r = json.loads((out / "vllm_bench.json").read_text())
    return {k: r.get(k) for k in ("mean_ttft_ms", "median_ttft_ms", "mean_itl_ms", "p99_itl_ms", "mean_tpot_ms")}


def run_guidellm(url: str, args: argparse.Namespace, out: Path, model: str) -> dict[str, Any] | None:
    exe = PEERS_DIR / "guidellm-venv" / "bin" / "guidellm"
    if not exe.exists():
        print(f"# GuideLLM skipped: no {exe}", file=sys.stderr)
        return None
    hf = PEERS_DIR / "smollm2-135m-hf"
    path = out / "guidellm.json"
    proc = subprocess.run(
        [str(exe), "run", "--backend",
         f"kind=openai_http,target={url},model={model},request_format=/v1/chat/completions",
         "--profile", f"kind=concurrent,streams={args.concurrency}",
         "--constraint", f"kind=max_requests,count={args.num_prompts}",
         "--data", f"kind=synthetic_text,prompt_tokens={args.input_len},output_tokens={args.output_len}",
         "--tokenizer", f"kind=huggingface_auto,model={hf}",
         "--output", f"kind=json,path={path}", "--disable-console-interactive"],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0 or not path.exists():
        print(f"# GuideLLM failed ({proc.returncode}):\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return guidellm_summary(json.loads(path.read_text()))


def guidellm_summary(report: dict[str, Any]) -> dict[str, Any]:
    """TTFT/ITL means from a GuideLLM JSON report (its first benchmark)."""
    m = report["benchmarks"][0]["metrics"]

    def stat(name: str, key: str) -> float | None:
        v = m.get(name, {}).get("successful", {})
        return v.get(key) if isinstance(v, dict) else None

    return {"mean_ttft_ms": stat("time_to_first_token_ms", "mean"),
            "median_ttft_ms": stat("time_to_first_token_ms", "median"),
            "mean_itl_ms": stat("inter_token_latency_ms", "mean"),
            "p99_itl_ms": (m.get("inter_token_latency_ms", {}).get("successful", {}).get("percentiles", {})
                           .get("p99")),
            "mean_tpot_ms": stat("time_per_output_token_ms", "mean")}


def start_topology(tmp: Path, topology: str) -> tuple[list[ServerProc], str, ServerClock]:
    common = ["--kv-cache-memory", "512MiB", "--log-level", "warning"]
    if topology == "colocated":
        port = free_port()
        srv = start_pdserve(tmp, "serve", ["serve", "--port", str(port), *common], f"http://127.0.0.1:{port}", 240)
        return [srv], srv.base_url, ServerClock(srv.base_url, "pdserve:time_to_first_token_seconds",
                                                "pdserve:inter_token_latency_seconds")
    procs: list[ServerProc] = []
    try:
        for role in ("prefill", "decode"):
            port = free_port()
            procs.append(start_pdserve(tmp, role, ["serve", "--port", str(port), "--role", role, "--num-threads", "1",
                                                   *common], f"http://127.0.0.1:{port}", 240))
        port = free_port()
        procs.append(start_pdserve(tmp, "router", ["router", "--port", str(port), "--prefill", procs[0].base_url,
                                                   "--decode", procs[1].base_url, "--log-level", "warning"],
                                   f"http://127.0.0.1:{port}", 60))
    except BaseException:
        for p in reversed(procs):
            p.stop()
        raise
    # TTFT as the router relays it; ITL from the decode instance's own clock
    return procs, procs[2].base_url, ServerClock(procs[2].base_url, "pdserve:router_time_to_first_token_seconds",
                                                 None)


def measure(topology: str, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    procs, url, clock = start_topology(tmp, topology)
    rows = []
    try:
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        clients = {"pdserve bench": lambda: run_pdserve_bench(url, args, tmp),
                   "vLLM bench serve": lambda: run_vllm_bench(url, args, tmp, model),
                   "GuideLLM": lambda: run_guidellm(url, args, tmp, model)}
        for name, run in clients.items():
            if name not in args.clients:
                continue
            clock.start()
            res = run()
            server = clock.stop()
            if res is not None:
                rows.append({"topology": topology, "client": name, **res, **server})
                print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        for p in reversed(procs):
            p.stop()
    return rows


def fmt(v: Any) -> str:
    return "–" if v is None else f"{v:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", choices=["colocated", "pd", "both"], default="both")
    ap.add_argument("--clients", nargs="+", default=["pdserve bench", "vLLM bench serve", "GuideLLM"])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    info = machine_info()
    print(f"# client_agreement: {args.num_prompts} chat requests, {args.input_len} in / {args.output_len} out, "
          f"concurrency {args.concurrency}; {info.get('cpu')}, {info.get('date')}")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for topology in (["colocated", "pd"] if args.topology == "both" else [args.topology]):
            rows += measure(topology, args, Path(d))
    print("| topology | client | mean TTFT | server mean TTFT | client/server | median TTFT | mean ITL | "
          "server mean ITL | p99 ITL | mean TPOT |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ratio = (f"{r['mean_ttft_ms'] / r['server_mean_ttft_ms']:.2f}x"
                 if r.get("mean_ttft_ms") and r.get("server_mean_ttft_ms") else "–")
        print(f"| {r['topology']} | {r['client']} | {fmt(r['mean_ttft_ms'])} | {fmt(r['server_mean_ttft_ms'])} | "
              f"{ratio} | {fmt(r['median_ttft_ms'])} | {fmt(r['mean_itl_ms'])} | {fmt(r['server_mean_itl_ms'])} | "
              f"{fmt(r['p99_itl_ms'])} | {fmt(r['mean_tpot_ms'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

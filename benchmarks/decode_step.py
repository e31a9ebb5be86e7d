"""Batch-1 decode step of the default model, this checkout against another one, alternating in one run.

    .venv/bin/python benchmarks/decode_step.py --baseline /path/to/other/checkout [--rounds 6] [--steps 300]
        [--model smollm2-135m|FILE.gguf] [--dtype auto|float32|bfloat16] [--baseline-dtype ...]

Each round starts one process per checkout (its own `pdserve`, its own native build), loads the model (default
smollm2-135m; `--dtype`, and `--baseline-dtype` for the other checkout, default the same) and decodes one greedy
request for `--steps` tokens, timing every `LLMEngine.step()` and, inside it, `ModelRunner.execute()` (batch
tensors, forward, sampling), in wall time and in the CPU time of the engine's thread (which, with `--threads 1`,
is all the step's work and hardly depends on how busy the host is). It prints each process's medians and, at the
end, the median of the rounds' medians per checkout and their ratios. Processes alternate (A, B, A, B, ...) so that
load from other users of the machine falls on both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import json, statistics, sys, time
from pdserve import SamplingParams
from pdserve.llm import LLM

steps, dtype, threads, model = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
llm = LLM(model, dtype=dtype, device_peaks="off", num_threads=threads or None, kv_cache_memory="256MiB")
eng = llm.engine
runner = eng.runner
inner = []
execute = runner.execute

def timed(sched):
    t0 = time.perf_counter()
    out = execute(sched)
    inner.append(time.perf_counter() - t0)
    return out

runner.execute = timed
prompt = {"prompt_token_ids": llm.get_tokenizer().encode("The history of the printing press begins")}
eng.add_request(prompt, SamplingParams(max_tokens=steps + 20, temperature=0, ignore_eos=True))
outer, cpu = [], []
while eng.has_unfinished_requests():
    t0, c0 = time.perf_counter(), time.thread_time()
    eng.step()
    outer.append(time.perf_counter() - t0)
    cpu.append(time.thread_time() - c0)
skip = 20  # the prefill and the first decodes (allocator, caches)
print(json.dumps({"step_ms": 1e3 * statistics.median(outer[skip:]), "cpu_ms": 1e3 * statistics.median(cpu[skip:]),
                  "execute_ms": 1e3 * statistics.median(inner[skip:]), "kernels": eng.kernels,
                  "kv": str(runner.kv_cache.dtype)}))
"""


def run_one(tree: Path, steps: int, dtype: str, threads: int, model: str) -> dict[str, float]:
    python = tree / ".venv" / "bin" / "python"
    out = subprocess.run([str(python), "-c", WORKER, str(steps), dtype, str(threads), model], cwd=tree,
                         capture_output=True, text=True, check=True, timeout=900)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="another checkout (with .venv and built kernels)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--model", default="smollm2-135m", help="a model argument of LLM (name or .gguf path)")
    ap.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 (what each checkout makes of it)")
    ap.add_argument("--baseline-dtype", default=None, help="the baseline's --dtype (default: --dtype)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice; 1 on a crowded host, "
                    "where a spinning OpenMP team waits on descheduled threads)")
    args = ap.parse_args()
    trees = {"baseline": args.baseline.resolve(), "this": Path(__file__).resolve().parent.parent}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, tree in trees.items():
            dtype = args.baseline_dtype or args.dtype if name == "baseline" else args.dtype
            res = run_one(tree, args.steps, dtype, args.threads, args.model)
            results[name].append(res)
            print(f"round {r} {name:8s} step {res['step_ms']:.3f} ms (main thread CPU {res['cpu_ms']:.3f} ms)  "
                  f"execute {res['execute_ms']:.3f} ms  ({res['kernels']}, KV {res['kv']})", flush=True)
    keys = ("step_ms", "cpu_ms", "execute_ms")
    med = {name: {k: statistics.median(x[k] for x in rs) for k in keys} for name, rs in results.items()}
    for name, m in med.items():
        print(f"{name:8s} median of medians: step {m['step_ms']:.3f} ms (CPU {m['cpu_ms']:.3f} ms), execute "
              f"{m['execute_ms']:.3f} ms")
    for k in keys:
        print(f"this / baseline {k}: {med['this'][k] / med['baseline'][k]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

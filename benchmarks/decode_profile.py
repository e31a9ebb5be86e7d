"""Where a batched decode step's time goes, or a prompt's prefill: the native program's op profile
(`NativeProgram.set_profiling` / `op_times`) against the engine's whole step (the lm_head, sampling and the engine's
Python run outside the program).

    .venv/bin/python benchmarks/decode_profile.py [--model smollm2-135m] [--batch 32] [--prompt-len 128]
        [--warmup 20] [--steps 100] [--prefill] [--kv-cache-dtype auto] [--dtype auto]

`--batch` requests of `--prompt-len` random token ids (seeded) are admitted together; after `--warmup` steps (their
prompts are in and every step is a decode of all of them) the next `--steps` steps are timed. Prints the step's p50
and mean (wall time), the program's share, and per op kind its mean ms a step. With `--prefill` each timed step is
instead the prefill of one new `--prompt-len`-token prompt (one request at a time, `--warmup` of them untimed first;
the step budget must hold the prompt; between prefills the engine commits KV pages ahead of use, as a server does
while idle), so the table is where TTFT's compute goes.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pdserve import SamplingParams
from pdserve.llm import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--prefill", action="store_true", help="time one prompt's prefill a step instead of decodes")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-threads", type=int, default=None)
    args = ap.parse_args()
    llm = LLM(args.model, max_num_seqs=max(args.batch, 4), kv_cache_dtype=args.kv_cache_dtype,
              dtype=args.dtype, **({"num_threads": args.num_threads} if args.num_threads else {}))
    eng = llm.engine
    program = eng.runner.model.program
    if program is None:
        raise SystemExit("this model runs without a native program (no op profile): use the native kernels")
    rng = random.Random(1)
    vocab = eng.arch.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=args.warmup + args.steps + 8, ignore_eos=True)
    def prompt() -> dict:
        return {"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.prompt_len)]}

    def prefill(i: int) -> float:
        # One prompt alone, aborted after its prefill step so the next starts from an empty pool.
        eng.add_request(prompt(), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), request_id=f"f{i}")
        t = time.perf_counter()
        eng.step()
        t = time.perf_counter() - t
        eng.abort_request(f"f{i}")
        while eng.has_unfinished_requests():
            eng.step()
        while eng.prefault_kv():  # idle work, as the serving loop does between requests: pages ahead of use
            pass
        return t

    if args.prefill:
        for i in range(args.warmup):
            prefill(-1 - i)
    else:
        for i in range(args.batch):
            eng.add_request(prompt(), sp, request_id=f"p{i}")
        for _ in range(args.warmup):
            eng.step()
    program.set_profiling(True)
    times = []
    t0 = time.perf_counter()
    for i in range(args.steps):
        if args.prefill:
            times.append(prefill(i))
            continue
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    wall = sum(times) if args.prefill else time.perf_counter() - t0
    ops = program.op_times()
    program.set_profiling(False)
    total = sum(s for _, s in ops.values())
    if args.prefill:
        print(f"{args.model}: {args.steps} prefills of {args.prompt_len} tokens, KV cache {args.kv_cache_dtype}")
    else:
        print(f"{args.model}: batch {args.batch}, context {args.prompt_len + args.warmup}-"
              f"{args.prompt_len + args.warmup + args.steps} tokens, {args.steps} decode steps")
    print(f"step p50 {statistics.median(times) * 1e3:.2f} ms, mean {wall / args.steps * 1e3:.2f} ms; "
          f"program {total / args.steps * 1e3:.2f} ms a step ({total / wall:.0%})")
    print("| op | calls a step | ms a step |\n|---|---:|---:|")
    for kind, (calls, secs) in sorted(ops.items(), key=lambda kv: -kv[1][1]):
        print(f"| {kind} | {calls / args.steps:.0f} | {secs / args.steps * 1e3:.2f} |")
    print(f"| (outside the program: lm_head, sampling, engine) | | {(wall - total) / args.steps * 1e3:.2f} |")


if __name__ == "__main__":
    main()

"""How close pdserve gets to the physical floors on this machine, from the engine's own live roofline.

    .venv/bin/python benchmarks/roofline_floors.py [--quantization int8] [--batches 1,8,32]

Floors (pdserve.roofline; peaks from `--device-peaks auto`: a quiet measurement of this machine, cached and
re-validated at start, or measured now; the second header line says which, when and how): a decode step cannot beat
(weight bytes + KV bytes) / memory bandwidth, a prefill cannot beat FLOPs / peak matmul rate. For each case the
engine runs real requests (random token prompts, greedy, ignore_eos) and the table gives the median measured model
time per step, the floor, and floor / measured (= the MBU or MFU of that step).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

from pdserve import LLM, SamplingParams


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[tuple[str, float, float, float]]:
    """(kind, model seconds, flops, bytes) of every step."""
    eng = llm.engine
    for p in prompts:
        eng.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    steps = []
    while eng.has_unfinished_requests():
        s = eng.step().stats
        if s.kind != "idle":
            steps.append((s.kind, s.model_time, s.flops, s.bytes))
    return steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=512)
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, quantization=args.quantization, max_num_seqs=64, max_num_batched_tokens=4096)
    meter = llm.engine.roofline
    dev = meter.device
    if dev is None:
        print("no device peaks (device_peaks=off)")
        return 1
    rng = random.Random(0)
    vocab = llm.engine.arch.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    run(llm, [prompt(32)], 4)  # warm-up
    mode = args.dtype + (f" + {args.quantization}" if args.quantization else "")
    print(f"# {mode}; peaks {meter.peak_flops / 1e9:.1f} GFLOP/s, {dev.mem_bandwidth / 1e9:.1f} GB/s ({dev.name})")
    print(f"# peaks from: {dev.describe_source()}")
    print("| case | steps | measured ms/step (median) | floor ms | bound | floor / measured |")
    print("|---|---|---|---|---|---|")
    # prefill: one whole prompt per step (budget 4096), nothing else in the batch
    steps = [s for s in run(llm, [prompt(args.prefill_len)], 1) if s[0] == "prefill"]
    for _ in range(2):
        steps += [s for s in run(llm, [prompt(args.prefill_len)], 1) if s[0] == "prefill"]
    _row(f"prefill {args.prefill_len} tokens", steps, meter.peak_flops, dev.mem_bandwidth)
    for b in (int(x) for x in args.batches.split(",")):
        steps = [s for s in run(llm, [prompt(args.prompt_len) for _ in range(b)], args.decode_steps + 1)
                 if s[0] == "decode"]
        _row(f"decode batch {b}, context {args.prompt_len}-{args.prompt_len + args.decode_steps}", steps,
             meter.peak_flops, dev.mem_bandwidth)
    return 0


def _row(name: str, steps: list[tuple[str, float, float, float]], peak: float, bw: float) -> None:
    t = statistics.median(s[1] for s in steps)
    flops = statistics.median(s[2] for s in steps)
    nbytes = statistics.median(s[3] for s in steps)
    compute, memory = flops / peak, nbytes / bw
    floor = max(compute, memory)
    print(f"| {name} | {len(steps)} | {t * 1e3:.1f} | {floor * 1e3:.1f} | "
          f"{'compute' if compute > memory else 'bandwidth'} | {floor / t:.0%} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""What constrained decoding costs: grammar compile time, and decode-step time and throughput of a constrained batch
against the same batch unconstrained, on the default model.

    .venv/bin/python benchmarks/structured_cost.py [--batches 1 16 32] [--max-tokens 48]

Compile: each schema cold (a fresh cache) and cached. Steps: B requests with a JSON-schema constraint whose output
runs long (an array of up to 64 enum words), against the same B prompts unconstrained (ignore_eos, same max_tokens);
the mean time of decode steps that carry all B rows, and output tokens per second of the whole run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from pdserve import SamplingParams
from pdserve.engine.engine import StepStats
from pdserve.llm import LLM
from pdserve.roofline import machine_info
from pdserve.sampling_params import StructuredOutputs

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat (4 fields)": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["北京", "上海", "Paris"]}, "ok": {"type": "boolean"}},
        "required": ["name", "age", "city", "ok"]},
    "nested + arrays": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {
            "type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "maxItems": 5}},
            "required": ["id", "tags"]},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "maxItems": 8}},
        "required": ["user", "scores"]},
}
LONG = {"type": "object", "properties": {"words": {"type": "array", "maxItems": 64, "items": {
    "type": "string", "enum": ["alpha", "beta", "gamma", "delta", "晴天", "雨天"]}}}, "required": ["words"]}


def compile_times(llm: LLM) -> None:
    mgr = llm.engine.structured
    for name, schema in SCHEMAS.items():
        so = StructuredOutputs(json=schema)
        t0 = time.perf_counter()
        mgr.compile(so)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        mgr.compile(so)
        cached = time.perf_counter() - t0
        print(f"| compile {name} | {cold * 1e3:.2f} ms cold | {cached * 1e6:.0f} µs cached |")


def run_batch(llm: LLM, b: int, max_tokens: int, constrained: bool) -> tuple[float, float, int]:
    """(mean ms of decode steps with all b rows, output tok/s, output tokens)."""
    so = StructuredOutputs(json=LONG) if constrained else None
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=max_tokens, ignore_eos=not constrained,
                            structured_outputs=so)
    prompts = [f"List some words, request {i}: " for i in range(b)]
    steps: list[StepStats] = []
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, on_step=steps.append)
    wall = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    full = [s.duration for s in steps if s.kind == "decode" and s.num_decode_tokens == b]
    return (statistics.mean(full) * 1e3 if full else float("nan")), n / wall, n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    info = machine_info()
    print(f"# structured_cost: default model, fp32; {info.get('cpu')}, {info.get('date')}")
    llm = LLM(kv_cache_memory="1GiB", device_peaks="off")
    t0 = time.perf_counter()
    llm.engine.structured.compile(StructuredOutputs(json_object=True))  # tokenizer scan + compiler
    print(f"| first constraint (tokenizer scan + builtin JSON) | {(time.perf_counter() - t0) * 1e3:.0f} ms | |")
    compile_times(llm)
    run_batch(llm, 4, 8, True)  # warm-up
    print("\n| batch | decode step, unconstrained | constrained | ratio | tok/s unconstrained | constrained |")
    print("| --- | --- | --- | --- | --- | --- |")
    for b in args.batches:
        free_ms, free_tps, _ = run_batch(llm, b, args.max_tokens, False)
        con_ms, con_tps, n = run_batch(llm, b, args.max_tokens, True)
        print(f"| {b} | {free_ms:.1f} ms | {con_ms:.1f} ms | {con_ms / free_ms:.2f}x | {free_tps:.1f} | "
              f"{con_tps:.1f} ({n} tokens) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

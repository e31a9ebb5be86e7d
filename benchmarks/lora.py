"""Decode step time with LoRA adapters: base-only steps against steps that mix two adapters with the base model.

    .venv/bin/python benchmarks/lora.py [--model smollm2-135m] [--batch 8] [--steps 64] [--rank 16] [--rounds 3]

Loads the model twice in this process: without LoRA (today's path) and with `enable_lora` and two random adapters
of rank `--rank` on all seven target modules (written as PEFT directories, lora_alpha = 2r). Each round times, on
each engine, `--batch` greedy requests decoding `--steps` tokens, and reports the median decode-step time of:

- `off`: LoRA not enabled, base-only batch;
- `base`: LoRA enabled, base-only batch (must equal `off`: base-only steps never touch the adapters);
- `layers`: LoRA enabled, base-only batch through the per-layer path (the native program switched off): what a
  step with adapter rows pays before its deltas;
- `mixed`: LoRA enabled, a third of the batch on each adapter and the rest on the base model (batch 8: 4, 2, 2):
  the per-layer path with the adapters' grouped deltas (model/lora.py);
- `one`: LoRA enabled, the whole batch on adapter 1 (no gather/scatter: every row is the adapter's).

Configurations alternate within a round, so load from other users of the machine falls on all alike; the load
average is printed with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pdserve import SamplingParams
from pdserve.llm import LLM
from pdserve.lora_request import LoRARequest, next_lora_id

MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(arch: Any, out: Path, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter for `arch` on all seven targets (no peft needed: the files as PEFT saves them)."""
    h, hd, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q, kv = arch.num_attention_heads * hd, arch.num_key_value_heads * hd
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
              "up_proj": (h, inter), "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(arch.num_hidden_layers):
        for block, names in MODULES.items():
            for name in names:
                fan_in, fan_out = shapes[name]
                p = f"base_model.model.model.layers.{i}.{block}.{name}."
                tensors[p + "lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
                tensors[p + "lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": [n for v in MODULES.values()
                                                                                    for n in v], "bias": "none"}))


def decode_ms(llm: LLM, loras: list[LoRARequest | None], steps: int) -> tuple[float, float]:
    """Median wall and engine-thread CPU time (ms) of the steps that decode every request of the batch (one per
    `loras` entry). With `--threads 1` the thread's CPU time is all of a step's work, and hardly depends on how
    busy the host is."""
    eng = llm.engine
    prompt = {"prompt_token_ids": llm.get_tokenizer().encode("The history of the printing press begins")}
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    for i, lr in enumerate(loras):
        for req in eng.make_requests([prompt], params, f"bench-{time.monotonic_ns()}-{i}", lora_request=lr):
            eng.add_request(req)
    wall, cpu = [], []
    while eng.has_unfinished_requests():
        t0, c0 = time.perf_counter(), time.thread_time()
        res = eng.step()
        if res.stats.kind.value == "decode" and res.stats.num_decode_tokens == len(loras):
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
    return 1e3 * statistics.median(wall[4:]), 1e3 * statistics.median(cpu[4:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the step's CPU time is the engine "
                    "thread's; 0: torch's choice, then only wall times mean something)")
    args = ap.parse_args()
    opts: dict[str, Any] = dict(device_peaks="off", kv_cache_memory="256MiB", num_threads=args.threads or None)
    off = LLM(args.model, **opts)
    on = LLM(args.model, enable_lora=True, max_lora_rank=args.rank, **opts)
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-lora-bench-"))
    a1, a2 = (LoRARequest(f"a{k}", next_lora_id(), str(tmp / f"a{k}")) for k in (1, 2))
    for k, lr in enumerate((a1, a2)):
        write_adapter(on.engine.arch, Path(lr.lora_path), args.rank, k)
        on.engine.add_lora(lr)
    b = args.batch
    third = [None] * (b - 2 * (b // 3)) + [a1] * (b // 3) + [a2] * (b // 3)
    cases = {"off": (off, [None] * b), "base": (on, [None] * b), "layers": (on, [None] * b), "mixed": (on, third),
             "one": (on, [a1] * b)}
    model = on.engine.runner.model
    wall: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(args.rounds):
        for name, (llm, loras) in cases.items():
            program = model.program
            if name == "layers":
                model.program = None
            try:
                w, c = decode_ms(llm, loras, args.steps)
            finally:
                model.program = program
            wall[name].append(w)
            cpu[name].append(c)
        print(f"round {r}: " + ", ".join(f"{k} {cpu[k][-1]:.2f} ms cpu ({wall[k][-1]:.2f} wall)" for k in cases),
              flush=True)
    med = {k: statistics.median(v) for k, v in cpu.items()}
    print(json.dumps({"model": args.model, "kernels": on.engine.kernels, "batch": b, "rank": args.rank,
                      "threads": args.threads, "decode_step_cpu_ms": {k: round(v, 2) for k, v in med.items()},
                      "decode_step_wall_ms": {k: round(statistics.median(v), 2) for k, v in wall.items()},
                      "mixed_over_off": round(med["mixed"] / med["off"], 3),
                      "one_over_off": round(med["one"] / med["off"], 3),
                      "layers_over_off": round(med["layers"] / med["off"], 3),
                      "base_over_off": round(med["base"] / med["off"], 3),
                      "loadavg": [round(x, 2) for x in os.getloadavg()]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The engine's step time with many requests decoding together, greedy or sampled (temperature 0.8, top_p 0.95), and
A/B switches that put back two older behaviours of the step, so a change is measured in one build.

    .venv/bin/python benchmarks/sampled_step.py MODEL CONCURRENCY greedy|topp
    WHOLE_SORT=1 ...   top-k/top-p masks from the whole-row pass only (no candidate sets)
    OLD_GATHER=1 ...   the sampled rows gathered by ATen's index op instead of a view / numpy
    TORCH_SAMPLING=1 ... random rows drawn by the PyTorch path instead of the native kernel (csrc/sampling.cpp)

Prompts: 128-token pieces of README.md; 128 output tokens each; 30 steps timed after 30 (wall time, the mean;
run A and B alternately, each in its own process).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from pdserve import SamplingParams
from pdserve.llm import LLM
from pdserve.model import runner, sampler


def main() -> None:
    model, c, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if os.environ.get("WHOLE_SORT"):
        sampler.NUCLEUS_CANDIDATES = ()
    if os.environ.get("TORCH_SAMPLING"):
        sampler.NATIVE_SAMPLING = False
    if os.environ.get("OLD_GATHER"):
        runner._rows = lambda hidden, rows: hidden[rows]  # type: ignore[assignment]
    llm = LLM(model, device_peaks="off", max_num_seqs=c, kv_cache_memory="1GiB")
    eng = llm.engine
    words = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8").split()
    sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True) if mode == "greedy" else \
        SamplingParams(temperature=0.8, top_p=0.95, max_tokens=128, ignore_eos=True)
    for i in range(c):
        ids = eng.tokenizer.encode(" ".join(words[i * 60:i * 60 + 90]))[:128]
        eng.add_request({"prompt_token_ids": ids}, sp, request_id=str(i))
    for _ in range(30):
        eng.step()
    t = time.perf_counter()
    for _ in range(30):
        eng.step()
    switches = " ".join(f"{k.lower()}={bool(os.environ.get(k))}" for k in ("WHOLE_SORT", "OLD_GATHER",
                                                                         "TORCH_SAMPLING"))
    print(f"{os.path.basename(model)} c={c} {mode} {switches}: step {(time.perf_counter() - t) / 30 * 1e3:.1f} ms")


if __name__ == "__main__":
    main()

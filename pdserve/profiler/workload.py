"""Offline profiling: drive an in-process engine with a synthetic workload of one phase and profile N steps.

  decode   `batch` requests with short prompts, profiled once all decode (every step a decode step)
  prefill  a queue of long prompts that each end after their first token (every step a prefill chunk)
  mixed    `batch` decoding requests while long prompts keep arriving (decodes and chunks share steps)
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from pdserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # phase.py loads torch: imported when a workload runs, not when the command line lists WORKLOADS
    from pdserve.profiler.phase import ProfileResult

WORKLOADS = ("decode", "prefill", "mixed")
WARMUP_STEPS = 3


def _prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def profile_workload(engine: Any, workload: str, steps: int, out_dir: str | None = None, batch: int = 8,
                     prompt_tokens: int = 512, seed: int = 0) -> ProfileResult:
    """Run `workload` on `engine` (an LLMEngine), profile `steps` steps after warm-up, abort what is left."""
    from pdserve.profiler.phase import PhaseProfiler

    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}")
    rng, vocab = random.Random(seed), engine.arch.vocab_size
    total = WARMUP_STEPS + steps + 8
    long_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ids = []
    if workload in ("decode", "mixed"):
        params = SamplingParams(max_tokens=total + 64, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            ids.append(engine.add_request(_prompt(rng, vocab, 16), params, f"profile-decode-{i}").request_id)
        while any(engine.scheduler.requests[r].num_output_tokens == 0 for r in ids):  # all in decode first
            engine.step()
    n_long = 0 if workload == "decode" else total
    for i in range(n_long):  # never run dry: queued long prompts are served in order
        ids.append(engine.add_request(_prompt(rng, vocab, prompt_tokens), long_params, f"profile-prefill-{i}")
                   .request_id)
    for _ in range(WARMUP_STEPS):
        engine.step()
    prof = PhaseProfiler(steps, out_dir, engine.roofline.device, engine.config.torch_dtype)
    try:
        while not prof.done and engine.has_unfinished_requests():
            prof.step(engine.step)
    finally:
        result = prof.stop()
        engine.abort_request([r for r in ids if r in engine.scheduler.requests])
    return result

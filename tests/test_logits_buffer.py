"""A step's sampled rows' logits land in a buffer the model keeps (CausalLM.compute_logits(reuse=True)): the bits
of a fresh tensor, and no page faults per step. [rows, vocab] float32 is 6 MB at 32 rows of a 49k vocabulary; with
the server's allocator settings (a 1 MiB mmap threshold, server/allocator.py) a fresh tensor that large was mmapped
and zero-filled by the OS on every decode step (~1,500 page faults a step at c=32)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch


def test_reused_logits_are_the_bits_of_a_new_tensor(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(kernels="native")
    model = llm.engine.runner.model
    assert model.lm_head.writes_into
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, model.cfg.hidden_size, generator=g)
    fresh = model.compute_logits(h)
    kept = model.compute_logits(h, reuse=True)
    assert torch.equal(kept, fresh)
    again = model.compute_logits(h[:3], reuse=True)  # fewer rows: the same buffer
    assert again.data_ptr() == kept.data_ptr() and torch.equal(again, fresh[:3])
    wide = torch.randn(40, model.cfg.hidden_size, generator=g)  # more rows than it holds: a larger one
    assert torch.equal(model.compute_logits(wide, reuse=True), model.compute_logits(wide))


FAULTS_SCRIPT = """
import random, resource, sys
from pdserve.server.allocator import tune_allocator
tune_allocator()  # first, as `pdserve serve` does: every block from 1 MiB up is mmapped
from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams
llm = LLM("smollm2-135m", device_peaks="off", max_step_ms=0)
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(64)]} for _ in range(32)]
params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
llm.generate(prompts, params)  # warm: the buffer and the KV pages exist
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
llm.generate(prompts, params)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_decode_steps_do_not_fault_in_a_logits_tensor() -> None:
    """In a process set up as the server is (the allocator tuned before anything is allocated; a test process has
    freed large blocks into its heap already, which malloc reuses whatever the threshold), 24 steps of 32 greedy
    decodes of the default model: a fresh [32, 49152] float32 tensor a step faulted ~1,540 pages a step."""
    run = subprocess.run([sys.executable, "-c", FAULTS_SCRIPT], capture_output=True, text=True, timeout=300,
                         check=True)
    faults = int(run.stdout.strip().splitlines()[-1])
    assert faults < 24 * 300, faults

"""Committing KV pages ahead of use (model/kv_prefault.py, LLMEngine.prefault_kv): populated pages take no fault when
first written and keep what they hold; the engine commits a bounded window past the blocks it has handed out, and
nothing with `kv_cache_prefault=False`. Page faults are counted with getrusage (minor faults of this process)."""

from __future__ import annotations

import mmap
import resource
import sys
from typing import Any

import pytest
import torch

from pdserve.model.kv_prefault import PagePopulator
from pdserve.model.runner import lazy_zeros
from pdserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise populate is Linux's")


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def populate_available() -> bool:
    t = lazy_zeros((1 << 16,), torch.uint8)
    return PagePopulator().populate(t.data_ptr(), t.numel())


def fresh_pages(nbytes: int) -> torch.Tensor:
    """An anonymous mapping of its own: never-touched pages (a heap buffer may reuse memory a test touched)."""
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def test_populated_pages_take_no_fault_and_keep_their_contents() -> None:
    if not populate_available():
        pytest.skip("this kernel refuses MADV_POPULATE_WRITE (before Linux 5.14)")
    lazy, ahead = fresh_pages(32 << 20), fresh_pages(32 << 20)
    ahead[5000:5010] = 7  # a page already written: populate must not touch its bytes
    assert PagePopulator().populate(ahead.data_ptr() + 1, ahead.numel() - 1)  # unaligned: widened to pages
    f0 = minor_faults()
    lazy[::4096] = 1
    lazy_faults = minor_faults() - f0
    assert int(ahead[5000:5010].sum()) == 70 and int(ahead[:5000].sum()) == 0
    f0 = minor_faults()
    ahead[::4096] = 1
    assert minor_faults() - f0 == 0 < lazy_faults


def test_engine_commits_a_bounded_window_past_the_used_blocks(make_llm: Any) -> None:
    if not populate_available():
        pytest.skip("this kernel refuses MADV_POPULATE_WRITE (before Linux 5.14)")
    llm = make_llm(num_kv_blocks=200, max_num_batched_tokens=64)
    eng = llm.engine
    window = 4 * (64 // eng.block_size)
    while eng.prefault_kv(max_bytes=1):  # one block per call
        pass
    assert eng._prefaulted == window and eng.block_manager.high_water == 0
    prompt = {"prompt_token_ids": list(range(3, 120))}
    first = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0))[0].outputs[0].token_ids
    used = eng.block_manager.high_water
    assert used > 0
    while eng.prefault_kv():
        pass
    assert eng._prefaulted == min(eng.num_blocks, max(window, used + window))
    # the committed blocks include ones that hold cached KV: the prefix cache still serves them unchanged
    again = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0))[0].outputs[0].token_ids
    assert again == first
    assert eng.block_manager.stats.hits > 0


def test_prefault_off(make_llm: Any) -> None:
    llm = make_llm(num_kv_blocks=64, kv_cache_prefault=False)
    assert llm.engine.prefault_kv() is False and llm.engine._prefaulted == 0

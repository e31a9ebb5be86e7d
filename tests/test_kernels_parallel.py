"""The kernels' parallel loop (csrc/parallel.h): every index runs exactly once, chunk boundaries are fixed, a loop
finishes when the pool's workers never run (the property that keeps a busy machine from stalling every op), errors
reach the caller, and loops started from several threads at once all finish."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from kernel_levels import module


@pytest.fixture(scope="module")
def mod() -> Any:
    return module()


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def covered(chunks: list[tuple[int, int, bool]]) -> list[int]:
    return [i for b, e, _ in chunks for i in range(b, e)]


@pytest.mark.parametrize("begin,end,grain", [(0, 1, 1), (0, 7, 1), (3, 1000, 1), (0, 1000, 64), (5, 6, 8),
                                             (0, 100_003, 16), (10, 10, 1)])
def test_every_index_once_at_fixed_boundaries(mod: Any, two_threads: None, begin: int, end: int, grain: int) -> None:
    first = mod.parallel_chunks(begin, end, grain)
    assert covered(first) == list(range(begin, end))
    assert all(e - b >= min(grain, end - begin) for b, e, _ in first)
    for _ in range(20):  # whichever thread ran a chunk, the chunks are the same
        assert [(b, e) for b, e, _ in mod.parallel_chunks(begin, end, grain)] == [(b, e) for b, e, _ in first]


def test_single_chunk_runs_on_the_caller(mod: Any, two_threads: None) -> None:
    assert mod.parallel_chunks(0, 8, 8) == [(0, 8, True)]


def test_one_thread_runs_inline(mod: Any) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert mod.parallel_chunks(0, 1000, 1) == [(0, 1000, True)]
    finally:
        torch.set_num_threads(before)


def test_loop_finishes_without_the_workers(mod: Any, two_threads: None) -> None:
    """The caller never waits for a worker that claimed nothing: with the workers held, it runs every chunk."""
    mod.set_parallel_workers_paused(True)
    try:
        for _ in range(50):
            chunks = mod.parallel_chunks(0, 4096, 1)
            assert covered(chunks) == list(range(4096))
            assert all(on_caller for _, _, on_caller in chunks)
    finally:
        mod.set_parallel_workers_paused(False)


def test_workers_take_part(mod: Any, two_threads: None) -> None:
    """With two threads a worker runs chunks: the caller's chunk waits for one (a busy machine may wake it late)."""
    chunks = mod.parallel_chunks(0, 1 << 16, 1, wait_for_worker_s=60.0)
    assert covered(chunks) == list(range(1 << 16))
    assert any(not on_caller for _, _, on_caller in chunks), "no chunk ran on a pool worker within 60 s"


def test_error_in_a_chunk_reaches_the_caller(mod: Any, two_threads: None) -> None:
    for at in (0, 500, 999):
        with pytest.raises(RuntimeError, match="failed on purpose"):
            mod.parallel_chunks(0, 1000, 1, throw_at=at)
    assert covered(mod.parallel_chunks(0, 1000, 1)) == list(range(1000))  # the pool still works


def test_loops_from_many_threads_at_once(mod: Any, two_threads: None) -> None:
    """One loop owns the pool at a time; a loop started meanwhile runs on its own thread, and all finish."""
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            for i in range(200):
                n = 1 + (seed * 7919 + i * 104729) % 5000
                assert covered(mod.parallel_chunks(0, n, 1)) == list(range(n))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a loop never finished"
    assert errors == []


def test_omp_backend_on_request(mod: Any) -> None:
    """PDSERVE_PARALLEL=omp hands the loops to ATen's OpenMP team (comparisons, a way out); the pool otherwise."""
    assert mod.parallel_backend() == ("omp" if os.environ.get("PDSERVE_PARALLEL") == "omp" else "pool")
    code = ("import torch; import pdserve.kernels as K; m = K.load(); torch.set_num_threads(2); "
            "c = m.parallel_chunks(0, 1000, 1); "
            "assert [i for b, e, _ in c for i in range(b, e)] == list(range(1000)); print(m.parallel_backend())")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PDSERVE_PARALLEL": "omp"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "omp"


@pytest.mark.usefixtures("two_threads")
def test_back_to_back_loops_never_share_a_chunk(mod: Any) -> None:
    """Loops of 2 and 64 chunks back to back (a step's ops): no chunk runs twice, never, or after its loop returned.
    Before the pool closed a finished job's epoch, a worker could claim a chunk of the finished job with the next
    job's fields and count it into the next job, which then returned with that chunk still running (a crash in
    serving: bf16_activations' chunk on a returned frame); without the fix 20,000 loops showed it in 2 runs of 5."""
    assert mod.parallel_race_check(100_000) == 0

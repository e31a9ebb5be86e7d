"""Shared by the native-kernel tests: the built module and fixtures running a test on every ISA level the CPU has.

`LEVELS` are the levels of the kernel families written before avx512_bf16 and amx existed (a CPU with those runs
their avx512 entries, so testing the higher levels again adds nothing); `ALL_LEVELS` every level, for families with
entries of their own up to amx (`isa_all`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import pdserve.kernels as K

LEVELS = ("generic", "avx2", "avx512")
ALL_LEVELS = ("generic", "avx2", "avx512", "avx512_bf16", "amx")


def module() -> Any:
    mod = K.load()
    if mod is None:
        pytest.skip("native kernels are not built (python -m pdserve.kernels)")
    return mod


def machine_levels(levels: tuple[str, ...] = ALL_LEVELS) -> list[str]:
    """The levels of `levels` this CPU runs."""
    mod = module()
    return [lv for lv in levels if mod.cpu_supports(lv)]


def lowered(mod: Any, level: str) -> Iterator[Any]:
    """Run with the kernels' active ISA lowered to `level` (skipped where the CPU lacks it), then restore it."""
    if not mod.cpu_supports(level):
        pytest.skip(f"this CPU has no {level}")
    before = mod.active_isa()
    mod.set_active_isa(level)
    try:
        yield mod
    finally:
        mod.set_active_isa(before)


@pytest.fixture(params=LEVELS)
def isa(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The kernel module with its active ISA lowered to the parameter (skipped above what the CPU runs)."""
    yield from lowered(module(), request.param)


@pytest.fixture(params=ALL_LEVELS)
def isa_all(request: pytest.FixtureRequest) -> Iterator[Any]:
    """As `isa`, over every level up to amx."""
    yield from lowered(module(), request.param)

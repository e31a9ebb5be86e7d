"""Shared by the native-kernel tests: the built module and a fixture running a test on every ISA level the CPU has."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import pdserve.kernels as K

LEVELS = ("generic", "avx2", "avx512")


def module() -> Any:
    mod = K.load()
    if mod is None:
        pytest.skip("native kernels are not built (python -m pdserve.kernels)")
    return mod


@pytest.fixture(params=LEVELS)
def isa(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The kernel module with its active ISA lowered to the parameter (skipped above what the CPU runs)."""
    mod = module()
    level = request.param
    if LEVELS.index(level) > LEVELS.index(mod.cpu_isa()):
        pytest.skip(f"this CPU has no {level}")
    before = mod.active_isa()
    mod.set_active_isa(level)
    try:
        yield mod
    finally:
        mod.set_active_isa(before)

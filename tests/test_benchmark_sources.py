"""The C++ benchmarks under benchmarks/ still compile against the kernel sources they use: qgemm_fp_steps.cpp
includes qgemm_avx512.cpp and times its tiles, so a kernel renamed or re-typed breaks this test instead of the next
measurement that needs the benchmark."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The ISA the benchmarks are written for, named rather than -march=native: the sources compile on any x86 machine
# (running them needs AVX-512 VNNI).
FLAGS = ["-std=c++20", "-fsyntax-only", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
         "-mavx512bf16", "-mfma", "-mf16c"]

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None,
                                reason="x86 C++ sources, built with g++")


@pytest.mark.parametrize("name", ["qgemm_fp_steps.cpp", "vnni_fp_pipes.cpp"])
def test_benchmark_source_compiles(name: str) -> None:
    cmd = ["g++", *FLAGS, "-I", str(ROOT / "pdserve" / "kernels" / "csrc"), str(ROOT / "benchmarks" / name)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]

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
# Each source compiled to an object (inline assembly is checked there, not by -fsyntax-only) with the flags its
# header comment names; -march=native is spelled out as the ISA it stands for on the machines the benchmark runs on,
# so the sources compile on any x86 machine (running them needs AVX-512 VNNI).
AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx512bf16", "-mfma", "-mf16c"]
FLAGS = {"qgemm_fp_steps.cpp": ["-std=c++20", *AVX512], "vnni_fp_pipes.cpp": []}

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None,
                                reason="x86 C++ sources, built with g++")


@pytest.mark.parametrize("name", sorted(FLAGS))
def test_benchmark_source_compiles(name: str, tmp_path: Path) -> None:
    cmd = ["g++", "-O0", "-c", *FLAGS[name], "-I", str(ROOT / "pdserve" / "kernels" / "csrc"),
           str(ROOT / "benchmarks" / name), "-o", str(tmp_path / "out.o")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]

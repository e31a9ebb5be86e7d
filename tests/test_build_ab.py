"""benchmarks/build_ab.py: each run loads the build it names (one build per process), and the metric summary
compares the builds round by round."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pdserve.kernels as K
from pdserve.kernels.build import built_library

pytestmark = pytest.mark.skipif(not K.available(), reason="native kernels not built (python -m pdserve.kernels)")

ROOT = Path(__file__).resolve().parent.parent


def test_each_run_loads_the_build_it_names(tmp_path: Path) -> None:
    lib = built_library()
    assert lib is not None
    a, b = tmp_path / "a" / lib.name, tmp_path / "b" / lib.name
    for copy in (a, b):
        copy.parent.mkdir()
        shutil.copy(lib, copy)
    script = tmp_path / "which.py"
    script.write_text("import sys\nimport pdserve.kernels as K\nf = K.require().__file__\n"
                      "print('loaded', f, sys.argv[1:])\nprint('value', 3.0 if '/b/' in f else 1.0)\n")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "build_ab.py"), "--builds", f"{a},{b}",
                          "--rounds", "2", "--metric", r"value ([0-9.]+)", "--", str(script), "x"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    loaded = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("loaded ")]
    assert loaded == [str(a), str(b), str(a), str(b)]
    assert all(line.endswith("['x']") for line in out.stdout.splitlines() if line.startswith("loaded "))
    assert f"{a}: 1 (1.000x)" in out.stdout and f"{b}: 3 (3.000x)" in out.stdout

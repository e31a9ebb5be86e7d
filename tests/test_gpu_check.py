"""Smoke test of benchmarks/gpu_check.py, the script a GPU machine runs: its python part end to end on cpu with tiny
shapes (`--quick`): greedy equality with transformers, decode / throughput / prefill rows, the markdown table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(tmp_path: Path, *extra: str) -> dict[str, list[list[str]]]:
    """Run the script on cpu with --quick; its table's rows by section."""
    out = tmp_path / "table.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu",
                           "--quick", "--peaks", "1e12,1e11", "--out", str(out), *extra], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    by_section: dict[str, list[list[str]]] = {}
    for r in out.read_text().splitlines()[2:]:
        cells = r.split(" | ")
        by_section.setdefault(cells[0].removeprefix("| "), []).append(cells)
    return by_section


def test_gpu_check_quick_on_cpu(tmp_path: Path) -> None:
    by_section = _run(tmp_path)
    assert by_section["equality"][0][3] == "3/3 identical"
    assert len(by_section["decode batch 1"]) == 2  # the given model and a random-weight one
    for r in by_section["decode batch 1"]:
        assert float(r[3].split()[0]) > 0 and r[4].startswith("MBU ")
    assert [r[2].split(", ")[1] for r in by_section["throughput"]] == ["batch 1", "batch 4"]
    assert all(float(r[3].split()[0]) > 0 for r in by_section["throughput"])
    assert by_section["prefill"][0][4].startswith("MFU ")


@pytest.mark.slow
def test_gpu_check_on_the_default_model(tmp_path: Path) -> None:
    """`--model` with the default model's GGUF (dequantized): greedy equality with transformers on its weights,
    English and CJK prompts through its tokenizer."""
    from pdserve.model.loader import resolve_model_path

    by_section = _run(tmp_path, "--model", resolve_model_path(None))
    assert by_section["equality"][0][1] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert by_section["equality"][0][3] == "3/3 identical"

"""A/B of kernel builds: a benchmark script run once per build, the builds alternating process by process.

    .venv/bin/python benchmarks/build_ab.py --builds /tmp/a.so,/tmp/b.so [--rounds 4] \\
        [--metric 'step p50 ([0-9.]+) ms'] -- benchmarks/decode_profile.py --batch 32

Copy `pdserve/kernels/_build/pdserve_kernels*.so` aside after each build (`python -m pdserve.kernels`), then name the
copies here. Each run loads its build in place of the one the source hash selects (`pdserve.kernels.built_library`).
One build per process: Python keeps one extension module per name, so a second build loaded into the same process
with importlib is the first one again, and an "in-process" A/B compares a build with itself. Each run's output is
printed; with `--metric` (a regular expression whose first group is a number; every match counts, in order) the
median of each build and the median over rounds of its ratio to the first build's, match by match.
"""

from __future__ import annotations

import argparse
import os
import re
import runpy
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = "PDSERVE_BUILD_AB_LIBRARY"


def run_child() -> None:
    """In the child: load the kernels from the named build, then run the script as __main__."""
    import pdserve.kernels as kernels

    path = Path(os.environ[CHILD])

    def library() -> Path | None:
        return path

    kernels.built_library = library
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--builds", required=True, help="comma-separated paths of built pdserve_kernels .so files")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--metric", default=None, help="regex; its first group is a number to compare")
    ap.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py [args]")
    args = ap.parse_args()
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    builds = args.builds.split(",")
    if not script or any(not os.path.isfile(b) for b in builds):
        ap.error("name existing builds and a script after --")
    values: dict[str, list[list[float]]] = {b: [] for b in builds}
    for r in range(args.rounds):
        for b in builds:
            env = dict(os.environ, **{CHILD: os.path.abspath(b)})
            out = subprocess.run([sys.executable, __file__, *script], env=env, capture_output=True, text=True)
            print(f"--- round {r + 1}, {b} (exit {out.returncode})\n{out.stdout}{out.stderr[-2000:]}", flush=True)
            if args.metric:
                values[b].append([float(m.group(1)) for m in re.finditer(args.metric, out.stdout)])
    if not args.metric:
        return
    base = values[builds[0]]
    for b in builds:
        per_match = list(zip(*values[b]))
        ratios = [statistics.median(x[i] / y[i] for x, y in zip(values[b], base)) for i in range(len(per_match))]
        print(f"{b}: " + ", ".join(f"{statistics.median(v):.4g} ({q:.3f}x)" for v, q in zip(per_match, ratios)))


if __name__ == "__main__":
    if CHILD in os.environ:
        run_child()
    else:
        main()

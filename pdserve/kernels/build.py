"""Build the native kernel library with torch's C++ extension tooling (ninja, the system C++ compiler).

`python -m pdserve.kernels` compiles `csrc/*.cpp` into `_build/pdserve_kernels*.so` next to this file and
records a hash of the sources; `make install` runs it, and `pdserve.kernels.load()` imports the library only when
the hash matches (a stale build is reported, never silently used). One build runs on every x86-64 CPU: the
ISA-specific files raise their own target with `#pragma GCC target`, and the kernels pick a level at run time.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

MODULE = "pdserve_kernels"
CSRC = Path(__file__).resolve().parent / "csrc"
BUILD_DIR = Path(os.environ.get("PDSERVE_KERNELS_BUILD_DIR") or Path(__file__).resolve().parent / "_build")
STAMP = "sources.sha256"
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-Wall", "-Wno-unused-function"]
LDFLAGS = ["-fopenmp"]


def sources() -> list[Path]:
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".cpp", ".h"))


def sources_hash() -> str:
    h = hashlib.sha256()
    for p in sources():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    return h.hexdigest()


def built_library() -> Path | None:
    """The built shared library if it exists and matches the current sources, else None."""
    stamp = BUILD_DIR / STAMP
    if not stamp.is_file() or stamp.read_text().strip() != sources_hash():
        return None
    libs = sorted(BUILD_DIR.glob(f"{MODULE}*.so"))
    return libs[0] if libs else None


def build(verbose: bool = False) -> Path:
    """Compile (incrementally: ninja rebuilds only what changed) and return the library path."""
    import torch  # noqa: F401  (the extension links against the already-loaded torch)
    from torch.utils.cpp_extension import load

    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    cpp = [str(p) for p in sources() if p.suffix == ".cpp"]
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    # copies: load() appends to the flag lists it is given
    load(name=MODULE, sources=cpp, build_directory=str(BUILD_DIR), extra_cflags=list(CFLAGS),
         extra_ldflags=list(LDFLAGS), verbose=verbose, is_python_module=True)
    (BUILD_DIR / STAMP).write_text(sources_hash() + "\n")
    lib = built_library()
    assert lib is not None, f"build finished but no {MODULE}*.so in {BUILD_DIR}"
    return lib


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.kernels", description=__doc__)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--if-needed", action="store_true", help="do nothing when the build matches the sources")
    args = ap.parse_args(argv)
    if args.if_needed and built_library() is not None:
        return 0
    t0 = time.perf_counter()
    lib = build(verbose=args.verbose)
    print(f"pdserve kernels: built {lib} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


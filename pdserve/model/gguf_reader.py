"""A fast reader of GGUF headers: key/values and tensor infos, tensor payloads memory-mapped.

gguf.GGUFReader builds a numpy memmap view for every part of every field; a tokenizer of 49k tokens and 49k merges
makes that about a million views and five seconds. This reader walks the same layout with `struct` over one
memoryview (tens of milliseconds) and yields the same values: `fields` as GGUFReader's `contents()` (str, int,
float, bool, lists of them), tensor data as the same numpy views (numeric types in reversed-ne shape, quantized
types as uint8 [..., bytes_per_row]). Layout (little-endian, GGUF v2/v3):

    "GGUF" u32 version, u64 n_tensors, u64 n_kv
    n_kv x   (string key, u32 value type, value)          string = u64 length + UTF-8 bytes
    n_tensors x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset from the data start)
    padding to general.alignment (default 32), then the tensor data
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.model.file_errors import ModelFileError, ModelFileErrorCode

# GGUF value types -> struct format of a scalar
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# ggml types GGUFReader exposes with their element dtype (others: raw bytes per row)
_TENSOR_DTYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
                  28: np.float64}
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class RawTensor:
    name: str
    ggml_type: int
    ne: tuple[int, ...]  # ggml order, innermost first
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.scalar("I"), self.scalar("Q")
            if etype in _NUMPY:
                arr = np.frombuffer(self.buf, dtype=np.dtype(_NUMPY[etype]).newbyteorder("<"), count=n,
                                    offset=self.pos)
                self.pos += arr.nbytes
                return arr.tolist()
            return [self.value(etype) for _ in range(n)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype} at byte {self.pos}")
        return self.scalar(_SCALARS[vtype])


def read_gguf(path: str) -> tuple[dict[str, Any], dict[str, RawTensor]]:
    """(key/values, tensors by name) of a GGUF file; raises ValueError for a file that is not GGUF v2/v3."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    mm = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm.data))
    try:
        if bytes(mm[:4]) != b"GGUF":
            raise ValueError("bad magic")
        cur.pos = 4
        version = cur.scalar("I")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version} (or a big-endian file)")
        n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")
        fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            fields[key] = cur.value(cur.scalar("I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            ne = tuple(cur.scalar("Q") for _ in range(cur.scalar("I")))
            infos.append((name, ne, cur.scalar("I"), cur.scalar("Q")))
    except struct.error as e:
        raise ValueError(f"truncated GGUF header ({e})") from e
    align = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
    start = cur.pos + (-cur.pos % align)
    tensors: dict[str, RawTensor] = {}
    for name, ne, gtype, offset in infos:
        shape = tuple(reversed(ne))
        if gtype not in GGMLQuantizationType._value2member_map_:
            raise ModelFileError(f"GGUF tensor {name} has ggml type {gtype}, which the installed gguf package does "
                                 f"not know (a newer format?); pdserve cannot read it",
                                 ModelFileErrorCode.UNSUPPORTED_TENSOR_TYPE)
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(gtype)]
        nbytes = int(np.prod(ne, dtype=np.int64)) * type_size // block
        raw = mm[start + offset:start + offset + nbytes]
        if len(raw) != nbytes:
            raise ValueError(f"tensor {name} runs past the end of the file")
        if gtype in _TENSOR_DTYPES:
            data = raw.view(_TENSOR_DTYPES[gtype]).reshape(shape)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(shape, GGMLQuantizationType(gtype)))
        tensors[name] = RawTensor(name, gtype, ne, data)
    return fields, tensors

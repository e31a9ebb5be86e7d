"""GGUF MoE expert tensors (llama.cpp: blk.N.ffn_{gate,up,down}_exps.weight, [n_expert, rows, cols] in HF order)
cut into one GGUFMatrix per expert: views of the stored bytes (no float copy, no copy at all), each kept in its
stored type so an expert's Linear can be packed as stored. Not yet wired into the loader (see the branch's report).
"""

from __future__ import annotations

import numpy as np

from pdserve.model.packed_weights import GGUFMatrix


def expert_matrices(data: np.ndarray, ggml_type: int, n_expert: int, rows: int, cols: int) -> list[GGUFMatrix]:
    """`data`: the tensor's bytes (uint8, any shape, n_expert*rows*row_bytes in all) -> per-expert [rows, cols]
    views. Invariant: each expert's rows are contiguous in the file (ggml's outermost dimension is the expert)."""
    flat = data.reshape(-1)
    if flat.dtype != np.uint8 or flat.size % (n_expert * rows):
        raise ValueError(f"expert tensor of {flat.size} bytes ({flat.dtype}) does not split into "
                         f"{n_expert} experts x {rows} rows")
    per_expert = flat.reshape(n_expert, rows, flat.size // (n_expert * rows))
    return [GGUFMatrix(per_expert[e], ggml_type, (rows, cols)) for e in range(n_expert)]

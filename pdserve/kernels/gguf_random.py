"""Random GGUF blocks of every type `pack_gguf` takes, for the kernel tests and benchmarks.

Every bit of the quant values and sub-block scales is random; the fp16 block scales are finite and of a sane size
(|d| in [0.001, 0.05], signs random; Q4_1/Q5_1 mins in [-0.3, 0.3]), so products stay far from overflow.
"""

from __future__ import annotations

import numpy as np

# name: (ggml type id, values per block, bytes per block, byte offsets of the fp16 scales, offset of the fp16 min)
BLOCKS: dict[str, tuple[int, int, int, tuple[int, ...], int | None]] = {
    "Q4_0": (2, 32, 18, (0,), None),
    "Q4_1": (3, 32, 20, (0,), 2),
    "Q5_0": (6, 32, 22, (0,), None),
    "Q5_1": (7, 32, 24, (0,), 2),
    "Q8_0": (8, 32, 34, (0,), None),
    "Q2_K": (10, 256, 84, (80, 82), None),
    "Q3_K": (11, 256, 110, (108,), None),
    "Q4_K": (12, 256, 144, (0, 2), None),
    "Q5_K": (13, 256, 176, (0, 2), None),
    "Q6_K": (14, 256, 210, (208,), None),
    "IQ4_NL": (20, 32, 18, (0,), None),
    "IQ4_XS": (23, 256, 136, (0,), None),
}


def random_blocks(rng: np.random.Generator, n: int, k: int, name: str) -> np.ndarray:
    """uint8 [n, k / block_values * block_bytes]: n rows of K values in GGUF blocks of type `name`."""
    _, qb, bb, scales, mn = BLOCKS[name]
    nb = k // qb
    blk = rng.integers(0, 256, size=(n, nb, bb), dtype=np.uint8)
    for off in scales:
        d = rng.uniform(0.001, 0.05, size=(n, nb)) * rng.choice([-1.0, 1.0], size=(n, nb))
        blk[..., off:off + 2] = d.astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    if mn is not None:
        blk[..., mn:mn + 2] = rng.uniform(-0.3, 0.3, size=(n, nb)).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    return blk.reshape(n, nb * bb)

"""llama.cpp's rope metadata in Hugging Face terms: Llama 3's rope_freqs tensor back to rope_scaling (llama3)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np


def round_f32(value: float) -> float:
    """Shortest decimal that round-trips the float32 metadata value (9.999999747e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _llama3_factors(factor: float, low: float, high: float, orig_ctx: float, wavelen: np.ndarray) -> np.ndarray:
    """llama.cpp's rope_freqs for HF rope_type=llama3 (the divisor applied to each inverse frequency)."""
    out = np.empty_like(wavelen)
    for i, wl in enumerate(wavelen):
        if wl < orig_ctx / high:
            out[i] = 1.0
        elif wl > orig_ctx / low:
            out[i] = factor
        else:
            smooth = (orig_ctx / wl - low) / (high - low)
            out[i] = 1.0 / ((1.0 - smooth) / factor + smooth)
    return out


def llama3_rope_scaling_from_freqs(rope_freqs: np.ndarray, rope_theta: float, head_dim: int) -> dict[str, Any] | None:
    """Recover HF `rope_scaling` (rope_type=llama3) from llama.cpp's `rope_freqs.weight`.

    The factors depend only on orig_ctx/low_freq_factor and orig_ctx/high_freq_factor, so orig_ctx is fixed at 8192
    (Llama 3's value) and the two factors are fitted; the result reproduces `rope_freqs` (checked: warns past 1e-3).
    """
    factors = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    if np.allclose(factors, 1.0):
        return None
    factor = float(factors.max())
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if inv_freq.shape != factors.shape:
        raise ValueError(f"rope_freqs has {factors.size} entries, expected head_dim/2 = {inv_freq.size}")
    wavelen = 2 * math.pi / inv_freq
    orig = 8192.0
    candidates = [(1.0, 4.0)]  # Llama 3.1 / 3.2 / 3.3 defaults
    mid = (factors > 1 + 1e-4) & (factors < factor - 1e-4 * factor)
    if mid.sum() >= 2:
        # 1/f = (1-s)/factor + s  ->  s;  s = orig/wl / (high-low) - low/(high-low) is linear in 1/wl.
        s = (1.0 / factors[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(1.0 / wavelen[mid], s, 1)
        width = orig / slope
        candidates.append((-intercept * width, -intercept * width + width))
    elif not mid.any():
        # No smoothed band: any thresholds between the neighbouring wavelengths reproduce the factors.
        ones, full = wavelen[factors < 1 + 1e-4], wavelen[factors > factor * (1 - 1e-4)]
        hi_wl = ones.max() if ones.size else wavelen.min() / 2
        lo_wl = full.min()
        edge = math.sqrt(lo_wl * hi_wl)
        candidates.append((orig / edge, orig / edge * (1 + 1e-6)))
    best, best_err = (1.0, 4.0), math.inf
    # the first candidate that fits to float32 precision wins, so round numbers are preferred to the raw fit
    candidates = [c for lo, hi in candidates
                  for c in ((round(float(lo), 3), round(float(hi), 3)), (float(lo), float(hi)))]
    for low, high in candidates:
        if not (0 < low < high):
            continue
        err = float(np.max(np.abs(_llama3_factors(factor, low, high, orig, wavelen) - factors) / factors))
        if err < best_err:
            best, best_err = (low, high), err
        if err < 1e-5:
            break
    if best_err > 1e-3:
        warnings.warn(f"rope_freqs is not exactly llama3 rope scaling (relative error {best_err:.1e}); using "
                      f"low_freq_factor={best[0]}, high_freq_factor={best[1]}", stacklevel=3)
    return {
        "rope_type": "llama3",
        "factor": round_f32(factor),
        "low_freq_factor": best[0],
        "high_freq_factor": best[1],
        "original_max_position_embeddings": int(orig),
    }

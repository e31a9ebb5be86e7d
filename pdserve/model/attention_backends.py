"""Choosing the PyTorch path's attention backend by name: sdpa (model/attention.py), flex (model/flex_attention.py).
The native kernels bring their own (model/native_ops.py)."""

from __future__ import annotations

import logging

import torch

from pdserve.model.attention import AttentionBackend, SDPABackend
from pdserve.model.flex_attention import FlexBackend, flex_available


def get_attention_backend(name: str, device: torch.device | str = "cpu") -> AttentionBackend:
    """sdpa | flex. flex falls back to sdpa (with a warning) where this PyTorch has no FlexAttention."""
    if name == "flex":
        if flex_available():
            return FlexBackend(device)
        logging.getLogger("pdserve.attention").warning("FlexAttention is unavailable in torch %s; using sdpa",
                                                       torch.__version__)
        return SDPABackend()
    if name == "sdpa":
        return SDPABackend()
    raise ValueError(f"unknown attention backend {name!r}; available: ['flex', 'sdpa']")

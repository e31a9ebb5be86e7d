"""Where pdserve keeps what it works out once per machine: converted tokenizers, measured device peaks."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$PDSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/pdserve`, else `~/.cache/pdserve` (not created here). Tests point
    `PDSERVE_CACHE_DIR` at a session directory so they never read or write a user's cache."""
    if os.environ.get("PDSERVE_CACHE_DIR"):
        return Path(os.environ["PDSERVE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pdserve"

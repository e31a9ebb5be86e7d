"""Committing KV cache pages before the blocks on them are first written.

The CPU KV cache is allocated lazily (runner.lazy_zeros: pages committed on first touch), so a server starts fast and
holds only the memory it uses. The price is paid inside steps: the first write of a never-used block faults its pages
in, and the kernel zeroes them (measured in a KVM guest: ~1 s per GiB, ~100 ms of a 1.7B model's 512-token prefill).
`populate` commits a range ahead of use with madvise(MADV_POPULATE_WRITE) (Linux 5.14+), which never changes the
contents, so it is safe on pages that already hold KV. The engine calls it while idle, a bounded number of blocks
ahead of the highest block handed out (engine.LLMEngine.prefault_kv).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class PagePopulator:
    """madvise(MADV_POPULATE_WRITE) over address ranges; `available` turns False for good at the first refusal
    (another OS, an older kernel)."""

    def __init__(self) -> None:
        self.available = sys.platform.startswith("linux")
        self._madvise = None
        if self.available:
            libc = ctypes.CDLL(None, use_errno=True)
            self._madvise = libc.madvise
            self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            self._madvise.restype = ctypes.c_int

    def populate(self, addr: int, length: int) -> bool:
        """Commit the pages covering [addr, addr + length); False (and unavailable from now on) if refused."""
        if not self.available or length <= 0:
            return self.available
        start = addr - addr % _PAGE
        end = -(-(addr + length) // _PAGE) * _PAGE
        assert self._madvise is not None
        if self._madvise(start, end - start, MADV_POPULATE_WRITE) != 0:  # the GIL is released by ctypes meanwhile
            err = ctypes.get_errno()
            logger.info("KV cache pages are committed on first write (madvise populate refused: %s)",
                        os.strerror(err))
            self.available = False
        return self.available

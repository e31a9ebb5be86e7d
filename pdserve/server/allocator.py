"""The C allocator of a process that loads and unloads models: glibc's mmap threshold fixed (tune_allocator), freed
heap pages handed back (release_memory), and the bytes in use (heap_in_use_bytes) that tell a leak from memory the
allocator keeps: RSS after an unload also counts free memory held in glibc's per-thread arenas, which a later load
reuses; the bytes in use do not."""

from __future__ import annotations

import ctypes
import functools
import gc
import os

M_MMAP_THRESHOLD = -3  # glibc mallopt parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 2**20  # blocks from 1 MiB up are mmapped, so freeing them returns them to the OS at once


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def tune_allocator() -> None:
    """Fix glibc's mmap threshold at 1 MiB (for a process that loads and unloads models). By default the threshold
    is dynamic: the first free of an mmapped block raises it to that block's size (up to 32 MiB), so later weights,
    load buffers and activations of up to 32 MiB come from the heap arenas, where a freed model leaves fragments
    that malloc_trim cannot return (BENCHMARKS.md, "Model lifecycle", has the RSS with and without it). A
    threshold the user set (MALLOC_MMAP_THRESHOLD_) is left alone."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or (libc := _libc()) is None:
        return
    libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def release_memory() -> None:
    """After a model's load or unload: collect garbage (the objects frozen before included), freeze what survives,
    then hand freed heap pages of every arena back to the OS (glibc keeps them otherwise). Frozen objects (the
    loaded models, the tokenizers' tables, the server's own) are left out of Python's later full collections: with
    the default model loaded such a collection scanned ~224k objects and stopped every Python thread, the engine's
    included, for 50-190 ms, about once per 250 requests served at c=32 (BENCHMARKS.md); after the freeze it scans
    only what was made since. Reference counting still frees frozen objects; only cycles among them wait for the
    next load or unload."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    trim_heap()


def trim_heap() -> None:
    """Hand freed heap pages of every arena back to the OS (glibc's malloc_trim; no garbage collection: after a
    large response its objects are already freed by reference counting). A large response (prompt_logprobs of a
    long prompt: ~10^5 small dicts and floats) leaves its pages free but kept by the allocator: measured, RSS
    +78 MB after one 7,602-token prompt_logprobs=20 reply with the heap in use back within 1 MB."""
    if (libc := _libc()) is not None:
        libc.malloc_trim(0)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_in_use_bytes() -> int | None:
    """Bytes the C allocator has handed out and not freed, over every arena plus mmapped blocks (glibc's mallinfo2:
    uordblks + hblkhd); None where the C library has no mallinfo2 (not glibc >= 2.33)."""
    libc = _libc()
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None
    if fn is None:
        return None
    fn.restype = _MallInfo2
    info = fn()
    return int(info.uordblks + info.hblkhd)

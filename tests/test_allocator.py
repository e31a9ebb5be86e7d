"""release_memory (after a model's load or unload): what survives is frozen out of Python's later full collections,
and what was frozen is collected by the next one."""

from __future__ import annotations

import gc
import weakref

from pdserve.server.allocator import release_memory


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector frees it


def test_survivors_are_frozen_and_collected_at_the_next_release() -> None:
    try:
        node = Node()
        ref = weakref.ref(node)
        release_memory()
        assert gc.get_freeze_count() > 0
        del node
        gc.collect()  # a full collection leaves frozen objects alone (what keeps it short while serving)
        assert ref() is not None
        release_memory()  # the next load or unload collects them
        assert ref() is None
    finally:
        gc.unfreeze()

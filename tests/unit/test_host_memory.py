"""Freed host memory goes back to the OS (glibc malloc_trim) when the serving loop goes idle."""

import sys

import pytest

from redknot.engine.host_memory import release_free_heap, resident_bytes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim and /proc are Linux's")
def test_trim_returns_fragmented_free_memory():
    """Many small blocks freed with every hundredth kept (what per-request buffers leave behind):
    the arenas keep the freed memory until the trim gives it back."""
    blocks = [bytearray(4000) for _ in range(60_000)]  # ~240 MB of small (brk/arena) allocations
    keep = blocks[::100]
    del blocks
    before = resident_bytes()
    assert release_free_heap()
    after = resident_bytes()
    assert before > 0 and after < before - 100 * 2**20, (before, after)
    del keep

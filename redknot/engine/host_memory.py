"""Freed host memory given back to the operating system when the server goes idle.

Serving allocates and frees many short-lived host buffers per request (token lists, numpy
scratch, tokenizer output, staging copies). glibc's malloc keeps the freed memory in its arenas,
fragmented, so a long-running server's resident size climbs and stays although its live objects
do not grow; ``malloc_trim(0)`` returns the free pages. It costs milliseconds, so the serving
loop calls it only when the engine has just gone idle.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None (another C library, or not Linux)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Give the C heap's free pages back to the OS; True if any were (False where unsupported)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


def resident_bytes() -> int:
    """This process's resident set size in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0

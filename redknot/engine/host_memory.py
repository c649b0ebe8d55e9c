"""Freed host memory given back to the operating system: when the server goes idle, and under load.

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
import time
from collections.abc import Callable
from dataclasses import dataclass, field


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


# Torch's CPU GEMMs cache per distinct operand shape twice: oneDNN its compiled primitives
# (ONEDNN_PRIMITIVE_CACHE_CAPACITY) and ideep, torch's oneDNN wrapper that runs the prepacked
# linears (models/linear.py), whole computations (LRU_CACHE_CAPACITY); 1,024 entries each by
# default. Recoveries compute a different row count per layer and request, so a CPU server sees
# ever new shapes and both caches grow for tens of minutes: live native memory that no heap trim
# returns (measured, bundled model: +90 MiB in 5 minutes of mixed requests with ideep's default,
# flat with 16 or 64 entries, at the same throughput). A small cache keeps the current step's shapes.
CPU_PRIMITIVE_CACHE_CAPACITY = 64
CPU_SHAPE_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def cap_cpu_primitive_cache(capacity: int = CPU_PRIMITIVE_CACHE_CAPACITY) -> None:
    """Bound oneDNN's and ideep's per-shape caches unless the user set them; each library reads its
    variable when it builds its cache, so this acts only before the process's first CPU GEMM."""
    for name in CPU_SHAPE_CACHE_VARIABLES:
        os.environ.setdefault(name, str(capacity))


def resident_bytes() -> int:
    """This process's resident set size in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@dataclass
class HeapTrimPolicy:
    """When the serving loop trims the heap while requests keep running (it never goes idle).

    ``due(finished)`` at a step boundary says whether to trim now: at least ``interval_s`` since
    the last trim (stretched so trims take at most ``max_share`` of wall time, from the last trim's
    measured cost), requests finished since (their buffers are what was freed), and resident
    memory grown by ``min_growth`` of its size after the last trim. ``trim(finished)`` trims and
    records the cost. ``clock`` and ``rss`` are injectable (tests use fakes)."""

    interval_s: float = 10.0
    max_share: float = 0.01
    min_growth: float = 0.02
    clock: Callable[[], float] = time.monotonic
    rss: Callable[[], int] = resident_bytes
    release: Callable[[], bool] = release_free_heap
    trims: int = 0
    seconds: float = 0.0  # time spent trimming, in all
    last_cost: float = 0.0
    _at: float | None = field(default=None, repr=False)  # clock at the last trim
    _rss_after: int = 0  # resident bytes right after the last trim
    _finished: int = 0  # requests finished at the last trim

    def wait_s(self) -> float:
        """The least time between two trims under load: the interval, or longer where a trim costs
        more than ``max_share`` of it."""
        return max(self.interval_s, self.last_cost / self.max_share)

    def due(self, finished: int) -> bool:
        if self._at is None:  # the first call starts the clock; the baseline is the memory then
            self._at, self._rss_after, self._finished = self.clock(), self.rss(), finished
            return False
        if finished == self._finished or self.clock() - self._at < self.wait_s():
            return False
        return self.rss() > self._rss_after * (1 + self.min_growth)

    def trim(self, finished: int) -> None:
        start = self.clock()
        self.release()
        end = self.clock()
        self.last_cost = end - start
        self.seconds += self.last_cost
        self.trims += 1
        self._at, self._rss_after, self._finished = end, self.rss(), finished

"""A step's phases: host seconds per phase, and a profiler range (``engine.<phase>``) around each."""

from __future__ import annotations

import time
from contextlib import contextmanager

from torch.profiler import record_function


@contextmanager
def phase(timings: dict, name: str):
    t0 = time.perf_counter()
    with record_function(f"engine.{name}"):
        try:
            yield
        finally:
            timings[name] += time.perf_counter() - t0
